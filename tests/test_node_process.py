"""The node runtime in its own process (``vexpert serve``'s node process, node/runtime_process.py),
driven from this one as the API process drives it: readiness arrives without asking, the node's
metrics come on request, a stop signal sent to the whole process group leaves it running (the API
process drains, then stops it), a stop ends it cleanly (no failure), and a node process that dies is a
failure named by its exit, reported once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from runtime_support import TINY_DEEPSEEK_SPEC, metric_value
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import NodeOptions, resolve_setup
from vexpert_runtime.node.runtime_process import STARTING, NodeProcess
from vexpert_runtime.ports import free_port
from vexpert_runtime.workload import Workload


def _node(tmp_path: Path) -> tuple[Any, Any, NodeOptions]:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", TINY_DEEPSEEK_SPEC, seed=3)
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    })
    ctx = torch.multiprocessing.get_context("spawn")
    # no iteration bound: it runs until stopped, as a serving node does
    return ctx, resolve_setup(config, checkpoint), NodeOptions(workload=Workload(tokens_per_worker=8, seed=1))


def _wait_ready(node: NodeProcess, timeout_s: float = 120.0) -> list[str | None]:
    seen: list[str | None] = []
    deadline = time.monotonic() + timeout_s
    while (reason := node.readiness()) is not None:
        if not seen or seen[-1] != reason:
            seen.append(reason)
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    return seen


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first (Linux: /proc/PID/task/PID/children)."""
    tree, i = [pid], 0
    while i < len(tree):
        children = Path(f"/proc/{tree[i]}/task/{tree[i]}/children")
        tree += [int(c) for c in children.read_text().split()] if children.exists() else []
        i += 1
    return tree


def test_the_node_process_pushes_readiness_renders_its_metrics_and_stops_without_a_failure(tmp_path: Path) -> None:
    ctx, setup, options = _node(tmp_path)
    failures: list[str] = []
    node = NodeProcess(ctx, setup, options, on_failure=failures.append)
    assert node.readiness() == STARTING
    node.start()
    try:
        seen = _wait_ready(node)
        assert seen[0] == STARTING and any(r and r != STARTING for r in seen), seen  # the node said why not yet
        first = node.metrics_text()
        assert metric_value(first, "vexpert_coordinator_up") == 1.0
        time.sleep(0.5)
        later = node.metrics_text()  # rendered now, in the node process: iterations went on
        assert metric_value(later, "vexpert_iterations_total") > metric_value(first, "vexpert_iterations_total")
        pid = node.pid
        assert pid is not None
        # a stop signal to the whole process group (a terminal's Ctrl-C, systemd's SIGTERM) is the API process's
        # to handle: the node process, its coordinator and its workers ignore it and go on
        tree = _descendants(pid)
        assert len(tree) >= 4, tree  # the node process, its coordinator, two workers
        for sig in (signal.SIGTERM, signal.SIGINT):
            for member in tree:
                os.kill(member, sig)
        time.sleep(0.5)
        after = node.metrics_text()
        assert metric_value(after, "vexpert_iterations_total") > metric_value(later, "vexpert_iterations_total")
        assert failures == [] and node.readiness() is None and _descendants(pid) == tree
    finally:
        node.stop()
    assert failures == [] and node.failure is None
    assert pid is not None and not Path(f"/proc/{pid}").exists()  # exited and reaped
    assert node.metrics_text() == b""  # not running: /metrics shows the API's series only


def test_a_killed_node_process_is_one_failure_named_by_its_exit(tmp_path: Path) -> None:
    ctx, setup, options = _node(tmp_path)
    failures: list[str] = []
    reported = threading.Event()

    def on_failure(message: str) -> None:
        failures.append(message)
        reported.set()

    node = NodeProcess(ctx, setup, options, on_failure=on_failure)
    node.start()
    try:
        _wait_ready(node)
        assert node.pid is not None
        os.kill(node.pid, signal.SIGKILL)
        assert reported.wait(30.0)
        assert node.readiness() == f"node failed: {failures[0]}"
    finally:
        node.stop()
    assert failures == ["vexpert-node exited with code -9 (killed by SIGKILL)"]
