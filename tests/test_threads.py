"""The CPU thread policy every vexpert process starts with (vexpert_runtime.threads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vexpert_runtime.cli import main
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.threads import THREADS_ENV, configure_cpu_threads, cpu_threads


def test_default_is_one_thread_with_passive_waits() -> None:
    env: dict[str, str] = {}
    assert configure_cpu_threads(env) == 1
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["OMP_NUM_THREADS"] == "1"


def test_vexpert_threads_wins_and_explicit_settings_are_kept() -> None:
    env = {THREADS_ENV: "3", "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"}
    assert configure_cpu_threads(env) == 3
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["OMP_WAIT_POLICY"] == "active"  # a user's explicit choice stays
    assert cpu_threads({"OMP_NUM_THREADS": "4"}) == 4
    assert cpu_threads({"OMP_NUM_THREADS": "junk"}) == 1


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_vexpert_threads_is_a_one_line_error(bad: str, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(VExpertInputError, match=f"^{THREADS_ENV}: .*\\(fix: "):
        cpu_threads({THREADS_ENV: bad})
    monkeypatch.setenv(THREADS_ENV, bad)
    assert main(["trace", "--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {THREADS_ENV}: ") and "(fix: " in err[0]


def test_a_vexpert_process_runs_torch_on_one_passive_thread() -> None:
    """What `vexpert` itself applies before torch loads: the torch it imports reports one thread,
    and OpenMP saw PASSIVE (threads that spin would burn a busy machine's CPU)."""
    probe = (
        "import os, sys; from vexpert_runtime import cli; "
        "cli.configure_cpu_threads(); import torch; "
        "print(torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in (THREADS_ENV, "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["1", "PASSIVE"]
    env[THREADS_ENV] = "2"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["2", "PASSIVE"]
