"""The operator runs without torch, and serves its own metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BLOCK_TORCH = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or name in ("numpy", "safetensors"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_operator_imports_and_registers_handlers_without_torch() -> None:
    result = run_without_torch("""
import kopf
import vexpert_operator.main
registry = kopf.get_default_registry()
names = {h.id for h in registry._watching.get_all_handlers()} | {h.id for h in registry._changing.get_all_handlers()}
assert "track" in names and "reconcile_now" in names, names
# no handler makes kopf put a finalizer on a deployment (deletion must not need the operator)
assert not registry._spawning.get_all_handlers(), "a daemon or timer puts a finalizer on every object"
assert "torch" not in sys.modules
print("ok")
""")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_render_command_runs_without_torch() -> None:
    result = run_without_torch(f"""
from vexpert_runtime.cli import main
code = main(["render", "-f", r"{REPO / 'examples' / 'qwen-moe-small.yaml'}"])
assert "torch" not in sys.modules
sys.exit(code)
""")
    assert result.returncode == 0, result.stderr
    assert "kind: StatefulSet" in result.stdout


def test_operator_metrics_endpoint() -> None:
    from vexpert_operator import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.DEPLOYMENT_PHASES.set("ns", "a", "Running")
    metrics.DEPLOYMENT_PHASES.set("ns", "b", "Calibrating")
    metrics.RECONCILES.labels("periodic").inc()
    metrics.serve(port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'vexpert_operator_deployments{phase="Running"} 1.0' in body
    assert 'vexpert_operator_deployments{phase="Invalid"} 0.0' in body
    for name in ("vexpert_operator_reconciles_total", "vexpert_operator_reconcile_duration_seconds",
                 "vexpert_operator_calibration_jobs_total", "vexpert_operator_tuning_decisions_total"):
        assert name in body
    metrics.DEPLOYMENT_PHASES.forget("ns", "a")
    metrics.DEPLOYMENT_PHASES.forget("ns", "b")
