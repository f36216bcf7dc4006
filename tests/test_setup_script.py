"""scripts/setup.sh installs the CPU build of torch where no NVIDIA GPU is visible, without first
resolving `torch` against PyPI (which gives the multi-GB CUDA build with 16 nvidia-* packages)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def dry_run(tmp_path: Path, nvidia_smi_exit: int | None, **env: str) -> subprocess.CompletedProcess[str]:
    """setup.sh's torch plan with PATH holding only a fake nvidia-smi (exiting with the given code) or none."""
    bindir = Path(tempfile.mkdtemp(dir=tmp_path))
    if nvidia_smi_exit is not None:
        fake = bindir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nexit {nvidia_smi_exit}\n")
        fake.chmod(0o755)
    path = f"{bindir}:/usr/bin:/bin"
    if nvidia_smi_exit is None:
        assert not any(Path(d, "nvidia-smi").exists() for d in path.split(":")), "this machine has nvidia-smi on /usr/bin"
    clean = {k: v for k, v in os.environ.items() if k != "VEXPERT_TORCH"}
    return subprocess.run(["bash", str(SETUP)], env={**clean, "PATH": path, "SETUP_DRY_RUN": "1", **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("nvidia_smi_exit", [None, 9], ids=["no nvidia-smi", "nvidia-smi without a GPU"])
def test_no_gpu_asks_for_the_cpu_build_first(tmp_path: Path, nvidia_smi_exit: int | None) -> None:
    result = dry_run(tmp_path, nvidia_smi_exit)
    assert result.returncode == 0, result.stderr
    first, fallback = result.stdout.splitlines()[1:3]
    assert result.stdout.startswith("torch: cpu")
    assert "torch==2.13.0+cpu" in first and "index" not in first  # the configured sources (local wheels, mirror)
    assert fallback.startswith("else:") and "torch==2.13.0+cpu" in fallback
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in fallback


def test_a_gpu_gets_the_default_cuda_build(tmp_path: Path) -> None:
    result = dry_run(tmp_path, 0)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["torch: cuda", "python -m pip install -q torch==2.13.0"]


def test_override_and_bad_override(tmp_path: Path) -> None:
    assert dry_run(tmp_path, 0, VEXPERT_TORCH="cpu").stdout.startswith("torch: cpu")
    bad = dry_run(tmp_path, None, VEXPERT_TORCH="rocm")
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: VEXPERT_TORCH: ") and "(fix: " in bad.stderr
