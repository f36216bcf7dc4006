"""A worker's per-plan and per-iteration host work at a real model's size, without a device.

The worker's main thread also launches the GPU's iterations, so what it spends on bookkeeping delays
them. Two pieces grow with the model rather than with the batch: a plan switch (every k iterations
the rank loads the new routing table into its fixed device table, :meth:`DeviceRoutingTable.load`)
and the count window's row every iteration (:func:`~vexpert_runtime.node.worker.window_row`). Timed
here at DeepSeek-V3's size (58 MoE layers × 256 experts, 8 ranks, 2 slots each) and at the serving
benchmark's (3 × 8, one rank), on the product's own functions; ``--baseline`` also times the torch
version of the row the worker used before (for the record).

    .venv/bin/python benchmarks/worker_host_cost.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from vexpert_runtime.model.ep_moe import DeviceRoutingTable, static_table, table_from_plan
from vexpert_runtime.node.worker import window_row
from vexpert_runtime.policy.allocator import AllocatorConfig, allocate
from vexpert_runtime.policy.placement import static_placement


def per_call_us(fn: Callable[[int], object], calls: int) -> float:
    for i in range(min(20, calls)):
        fn(i)
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def torch_row(stats: torch.Tensor, num_experts: int, world: int, rank: int) -> torch.Tensor:
    """The row as the worker built it before (torch ops), for ``--baseline``."""
    counts, computed = stats[:, :num_experts].clone(), stats[:, num_experts:].clone()
    loads = torch.zeros(stats.shape[0], world, dtype=torch.int64)
    loads[:, rank] = computed.sum(1)
    return torch.cat([counts, loads], dim=1)


def measure(name: str, layers: int, experts: int, world: int, slots: int, calls: int, baseline: bool) -> dict[str, object]:
    """Microseconds per plan switch (a skewed plan with replicas and the static table alternately,
    each a full rewrite), per re-plan to the same routing, and per count-window row."""
    static = static_table(layers, experts, world, slots)
    table = DeviceRoutingTable.of(static, "cpu")
    row: dict[str, object] = {"model": name, "layers": layers, "experts": experts, "ranks": world, "slots": slots,
                              "plan_switch_us": None}
    if slots:
        counts = torch.rand(layers, experts, generator=torch.Generator().manual_seed(0)) ** 4 * 1000
        plan = table_from_plan(allocate(counts, static_placement(layers, experts, world), world,
                                        AllocatorConfig(2, slots // 2, 0.99, use_cost_model=False)), 1)
        tables = [dataclasses.replace(plan if i % 2 else static, plan_id=i + 1) for i in range(calls + 40)]
        row["plan_switch_us"] = per_call_us(lambda i: table.load(tables[i]), calls)
    table.load(static)  # then the same routing under new ids
    row["same_routing_switch_us"] = per_call_us(lambda i: table.load(dataclasses.replace(static, plan_id=10_000 + i)),
                                                calls)
    stats = torch.randint(0, 50, (layers, experts + experts // world + slots), dtype=torch.int64)
    row["window_row_us"] = per_call_us(lambda i: window_row(stats.numpy(), experts, world, world - 1), calls)
    if baseline:
        row["window_row_torch_us"] = per_call_us(lambda i: torch_row(stats, experts, world, world - 1), calls)
        assert np.array_equal(torch_row(stats, experts, world, world - 1).numpy(),
                              window_row(stats.numpy(), experts, world, world - 1))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--baseline", action="store_true")
    args = parser.parse_args()
    for name, shape in {"deepseek-v3": (58, 256, 8, 2), "bench-3x8": (3, 8, 1, 0)}.items():
        print(json.dumps(measure(name, *shape, args.calls, args.baseline)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
