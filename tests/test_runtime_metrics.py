"""The node's HTTP endpoint (``/metrics`` Prometheus, ``/ready`` for the readiness probe) and the
tuning inputs it exports: ``vexpert_balance_decay``, ``vexpert_pool_hit_ratio`` and
``vexpert_pinned_memory_pressure``."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from runtime_support import TINY_DEEPSEEK_SPEC
from vexpert_runtime.config import load_runtime_config
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import NodeOptions, NodeRuntime, Progress, resolve_setup
from vexpert_runtime.node.balance import pool_hits
from vexpert_runtime.node.metrics import BalanceDecay, NodeMetrics, PoolHits, memory_pressure
from vexpert_runtime.simulation.workload import drifting_workload

SPEC = TINY_DEEPSEEK_SPEC



def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


# ------------------------------------------------------------------------------------------------
# HTTP endpoint
# ------------------------------------------------------------------------------------------------


def test_ready_and_metrics_over_http() -> None:
    metrics = NodeMetrics(num_layers=2)
    state: dict[str, Any] = {"reason": "1/2 workers have loaded the model\nand joined the process group"}
    port = metrics.serve(0, "127.0.0.1", readiness=lambda: state["reason"])
    base = f"http://127.0.0.1:{port}"
    try:
        status, body = _get(f"{base}/ready")
        assert status == 503
        assert body == "not ready: 1/2 workers have loaded the model and joined the process group\n"  # one line
        state["reason"] = None
        assert _get(f"{base}/ready") == (200, "ready\n")
        state["reason"] = "stopping"
        assert _get(f"{base}/ready") == (503, "not ready: stopping\n")
        for path in ("/metrics", "/"):
            status, text = _get(base + path)
            values = _samples(text)
            assert status == 200 and "vexpert_pooled_experts" in values
            assert math.isnan(values["vexpert_balance_decay"]) and math.isnan(values["vexpert_pool_hit_ratio"])
            assert values["vexpert_pinned_memory_pressure"] == 0.0
        assert _get(f"{base}/readyz")[0] == 404
        assert _get(f"{base}/metrics/x")[0] == 404
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/ready", timeout=2)


def test_a_failing_readiness_check_answers_503() -> None:
    metrics = NodeMetrics(num_layers=1)

    def broken() -> str | None:
        raise RuntimeError("boom")

    port = metrics.serve(0, "127.0.0.1", readiness=broken)
    try:
        status, body = _get(f"http://127.0.0.1:{port}/ready")
        assert status == 503 and body.startswith("not ready: readiness check failed") and body.count("\n") == 1
    finally:
        metrics.close()


def _config(path: Path, checkpoint: Path, **sections: dict[str, Any]) -> Path:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    raw: dict[str, Any] = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": master_port},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": 3},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_node_is_ready_only_once_formed_and_loaded_and_exports_the_tuning_inputs(tmp_path: Path) -> None:
    """A real node (2 CPU workers): 503 while it starts, 200 once the group formed and iterated, and
    afterwards the three tuning gauges hold real values."""
    write_tiny_checkpoint(tmp_path / "ckpt", SPEC, seed=3)
    limit = 10_000_000
    config = _config(tmp_path / "runtime.yaml", tmp_path / "ckpt", tuning={"allocation_interval": 3, "pooled_experts": 3},
                     runtime={"host_memory_limit_bytes": limit})
    setup = resolve_setup(load_runtime_config(config), tmp_path / "ckpt")
    seen: dict[str, Any] = {}

    def on_metrics(port: int) -> None:  # called once serving, before the pool and the workers exist
        seen["port"] = port
        seen["starting"] = _get(f"http://127.0.0.1:{port}/ready")

    def progress(p: Progress) -> None:
        if "running" not in seen:
            seen["running"] = _get(f"http://127.0.0.1:{seen['port']}/ready")
            seen["metrics"] = _get(f"http://127.0.0.1:{seen['port']}/metrics")

    workload = drifting_workload((("prefill_in4096", 60), ("decode_in1000out1000", 1000)), 2, 8, tokens_per_worker=32)
    runtime = NodeRuntime(setup, NodeOptions(workload=workload, iterations=60, progress=progress,
                                             metrics_addr="127.0.0.1", on_metrics=on_metrics))
    assert runtime.readiness() == "loading the expert pool"
    report = runtime.run()
    assert seen["starting"] == (503, "not ready: loading the expert pool\n")
    assert seen["running"] == (200, "ready\n")
    assert seen["metrics"][0] == 200 and "vexpert_balance_ratio" in seen["metrics"][1]
    assert runtime.readiness() == "stopping"

    values = _samples(report.metrics_text)
    # pressure: the bytes the limit check counts (CPU: pool + every worker's slots and base experts)
    expected = (report.pool_bytes + 2 * (report.slot_bytes_per_worker + setup.memory.base_bytes_per_worker)) / limit
    assert report.pool_bytes == 2 * 3 * SPEC.expert_numel * 4
    assert values["vexpert_pinned_memory_pressure"] == pytest.approx(expected)
    assert 0 <= values["vexpert_pool_hit_ratio"] <= 1  # Np=3 < E=8: measured against the unrestricted choice
    assert math.isfinite(values["vexpert_balance_decay"]) and -1 <= values["vexpert_balance_decay"] <= 1


# ------------------------------------------------------------------------------------------------
# Tuning inputs
# ------------------------------------------------------------------------------------------------


def test_balance_decay_follows_plan_intervals_whatever_the_arrival_order() -> None:
    decay = BalanceDecay(history=4)
    plans = [0, 0, 1, 1, 1, 2, 2, 2, 3]  # iteration → plan the workers ran
    balances = [0.5, 0.5, 0.9, 0.8, 0.72, 1.0, 0.95, 0.9, 0.9]
    for i in reversed(range(len(plans))):  # balances (windows) first, newest first
        decay.balance(i, balances[i])
    assert math.isnan(decay.value)
    for i, plan in enumerate(plans):
        decay.plan(i, plan)
    # plan 0 (static) is skipped, plan 3 is not complete yet
    assert decay.intervals == 2
    assert decay.value == pytest.approx(((0.9 - 0.72) / 0.9 + (1.0 - 0.9) / 1.0) / 2)


def test_a_kept_plan_starts_an_interval_even_on_the_static_placement() -> None:
    """A window the allocator skipped (it would have kept the plan) is an allocation interval too:
    on plan 0 that no allocation chose nothing counts; from a kept boundary on, it does."""
    decay = BalanceDecay(history=4)
    balances = [0.9, 0.8, 0.95, 0.9, 0.85, 1.0, 0.9, 0.7]
    for i, value in enumerate(balances):
        decay.plan(i, 0)
        decay.balance(i, value)
    assert decay.intervals == 0  # the static placement, never chosen by an allocation
    decay.kept(2)  # too late: iteration 2 is already folded; nothing changes
    decay.kept(8)
    decay.kept(11)
    for i, value in enumerate([1.0, 0.9, 0.8, 0.8, 0.6, 0.5], start=8):
        decay.plan(i, 0)
        decay.balance(i, value)
    # 8..10 kept (1.0 → 0.8) is complete; 11..13 (0.8 → 0.5) is in progress
    assert decay.intervals == 1 and decay.value == pytest.approx(0.2)
    decay.plan(14, 1)
    decay.balance(14, 0.9)
    assert decay.intervals == 2 and decay.value == pytest.approx((0.2 + (0.8 - 0.5) / 0.8) / 2)


def test_balance_decay_skips_single_iterations_resets_and_stays_bounded() -> None:
    decay = BalanceDecay(history=2)
    for i, (plan, balance) in enumerate([(1, 0.8), (2, 0.8), (2, 0.4), (3, 0.5), (3, 0.5), (4, 0.9)]):
        decay.plan(i, plan)
        decay.balance(i, balance)
    assert decay.intervals == 2 and decay.value == pytest.approx((0.5 + 0.0) / 2)  # plan 1 had one iteration
    decay.plan(6, 4)
    decay.balance(6, 0.45)
    decay.reset()  # k changed: plan 4's interval started under the old k
    decay.plan(7, 5)
    decay.balance(7, 0.9)
    assert decay.intervals == 0 and math.isnan(decay.value)
    for i in range(8, 8 + BalanceDecay.MAX_PENDING + 2):  # plan ids that never get a balance
        decay.plan(i, 6)
    assert len(decay._plans) <= BalanceDecay.MAX_PENDING


def test_pool_hits_count_wanted_vexperts_inside_the_pool() -> None:
    slot_expert = torch.tensor([[[3, -1], [5, 1]], [[0, -1], [-1, -1]]])  # [L=2, N=2, S=2]
    pooled = torch.zeros(2, 8, dtype=torch.bool)
    pooled[0, [1, 3]] = True
    pooled[1, 0] = True
    assert pool_hits(slot_expert, pooled) == (3, 4)  # expert 5 of layer 0 is not pooled
    hits = PoolHits(history=2)
    assert math.isnan(hits.value)
    hits.add(0, 0)
    assert hits.value == 1.0  # nothing wanted, nothing missed
    hits.add(3, 4)
    hits.add(1, 4)
    assert hits.value == pytest.approx(4 / 8)  # the oldest fell out of the history
    with pytest.raises(ValueError):
        hits.add(5, 4)
    assert memory_pressure(90, 100) == 0.9 and memory_pressure(90, None) == 0.0 and memory_pressure(90, 0) == 0.0
