"""``vexpert_degraded`` follows the iterations, not the order their messages arrive in: a count window
is handled before the reports of its own iterations (one batch of messages), so a window whose
iterations have not reported yet must not clear the gauge while the node still runs degraded (an
alert on it flickered, and a test that waited for it to clear saw degraded iterations after)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime_support import TINY_DEEPSEEK_SPEC
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import NodeRuntime, resolve_setup
from vexpert_runtime.node.messages import CountsWindow, IterationDone
from vexpert_runtime.node.report import NodeOptions


def _degraded(runtime: NodeRuntime) -> float:
    value = runtime.metrics.registry.get_sample_value("vexpert_degraded")
    assert value is not None
    return value


def test_a_window_ahead_of_its_reports_keeps_the_node_degraded_until_an_undegraded_iteration_completes(
        tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", TINY_DEEPSEEK_SPEC, seed=2)
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    })
    setup = resolve_setup(config, checkpoint)
    runtime = NodeRuntime(setup, NodeOptions(allocate=False))
    runtime.coordinator.attached = True  # a coordinator is attached: only the iterations say degraded
    layers, experts, workers = TINY_DEEPSEEK_SPEC.num_layers, TINY_DEEPSEEK_SPEC.num_experts, setup.local_workers

    def window(start: int, n: int) -> CountsWindow:
        counts = np.full((n, layers, experts), 4.0)
        loads = np.full((n, layers, setup.world), 4.0 * experts / setup.world)
        return CountsWindow(start, counts, loads)

    def report(iteration: int, degraded: bool) -> None:
        for rank in range(workers):
            runtime._handle(IterationDone(rank=rank, iteration=iteration, step_s=0.01, wait_s=0.0,
                                          degraded_layers=layers if degraded else 0, plan_ids=[1] * layers))

    runtime._on_window(window(0, 4), allocate=False)
    for i in range(4):
        report(i, degraded=True)
    assert _degraded(runtime) == 1.0
    runtime._on_window(window(4, 4), allocate=False)  # iterations 4..7 have not reported yet
    assert _degraded(runtime) == 1.0, "an empty window cleared the gauge while the node ran degraded"
    for i in range(4, 8):
        report(i, degraded=False)
    runtime._on_window(window(8, 4), allocate=False)  # again ahead, but the last completed one ran undegraded
    assert _degraded(runtime) == 0.0
    runtime.coordinator.attached = False  # the coordinator died: degraded whatever the iterations said
    runtime._on_window(window(12, 4), allocate=False)
    assert _degraded(runtime) == 1.0
