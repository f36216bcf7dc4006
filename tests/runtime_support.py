"""Shared fixtures of the node-runtime tests: the tiny DeepSeek-shaped MoE they all build."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from vexpert_runtime.model.expert_layout import FP8_BLOCK
from vexpert_runtime.model.families import DEEPSEEK
from vexpert_runtime.model.moe_spec import MoESpec

# 2 MoE layers × 8 experts, group-limited top-2 routing, correction bias, a shared expert:
# every DeepSeek-V3 routing feature at a size the 2-core CI machine runs in milliseconds.
TINY_DEEPSEEK_SPEC = MoESpec(
    architecture=DEEPSEEK,
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    moe_layers=(1, 2),
    n_group=2,
    topk_group=2,
    routed_scaling_factor=1.5,
    correction_bias=True,
    shared_intermediate_size=16,
)

# A block-FP8 checkpoint (DeepSeek-V3's format) with real 128×128 blocks: H = 256 is two whole
# blocks, I = 192 one whole and one partial block (gate/up rows, down columns).
TINY_FP8_DEEPSEEK_SPEC = dataclasses.replace(
    TINY_DEEPSEEK_SPEC,
    hidden_size=256,
    intermediate_size=192,
    num_experts=4,
    shared_intermediate_size=192,
    fp8_block=(128, 128),
    expert_storage=FP8_BLOCK,
)


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float) -> None:
    """Terminate a runtime process started by a test; kill it if it has not exited after ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    """Wait until ``vexpert serve`` at ``url`` answers ``/health`` with 200; fail with the end of its ``log`` if it
    exits first or ``timeout_s`` pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"vexpert serve exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no /health 200 in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}"
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)


def run_in_triton_interpreter(module: str, function: str) -> None:
    """Run ``tests/<module>.py``'s ``function()`` in a subprocess with ``TRITON_INTERPRET=1`` (set before
    Triton is imported: its interpreter patches ``tl.sort``/``tl.cumsum`` at import); fail with its stderr."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(repo / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_policy_node(checkpoint: Path, policy: str, workers: int, iterations: int, k: int) -> tuple[Any, Any]:
    """One local CPU node of ``workers`` EP ranks under placement ``policy`` (``vexpert.placement_policy``),
    ``iterations`` of the bundled skewed decode load, an allocation every ``k``, outputs verified against
    the single-process reference; returns (the resolved NodeSetup, the NodeReport). What
    tests/test_node_placement_policies.py asserts on and benchmarks/node_placement_policies.py prints."""
    from vexpert_runtime.config import RuntimeConfig
    from vexpert_runtime.node import NodeOptions, resolve_setup, run_node
    from vexpert_runtime.ports import free_port
    from vexpert_runtime.simulation.workload import drifting_workload

    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": workers, "gpus_per_node": workers, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95, "placement_policy": policy},
        "tuning": {"allocation_interval": k},
        "runtime": {"device": "cpu", "cpu_workers": workers, "metrics_port": 0},
    })
    setup = resolve_setup(config, checkpoint)
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=16)
    return setup, run_node(setup, NodeOptions(workload=workload, iterations=iterations, verify=True))


def planned_balance(report: Any, k: int) -> tuple[float, float]:
    """Mean balance of the static placement and as measured, over the iterations served by a plan
    (from the second window of ``k`` on: the first one runs the static table)."""
    records = [r for r in report.records if r.iteration >= k and r.vexpert_balance is not None]
    if not records:
        raise ValueError("no iteration ran under a plan")
    return (sum(r.static_balance or 0.0 for r in records) / len(records),
            sum(r.vexpert_balance for r in records) / len(records))


def metric_value(text: str | bytes, name: str) -> float:
    """The value of the unlabelled sample ``name`` in Prometheus exposition ``text``."""
    for line in (text.decode() if isinstance(text, bytes) else text).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")
