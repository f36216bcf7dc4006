"""Allocator latency with the adjacency bound on and off (58 × 256 × 64, G = 2, Vmax = 1, CPU).

Interleaves the two configurations so that machine noise hits both alike; also times the
vExpert-count search (:func:`assign_vexpert_counts`) alone. Prints one JSON line.

    python benchmarks/allocator_adjacency.py >> benchmarks/results/allocator_adjacency_cpu.jsonl
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from vexpert_runtime.policy.allocator import AllocatorConfig, allocate, assign_vexpert_counts
from vexpert_runtime.policy.bench import benchmark_counts
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, static_placement
from vexpert_runtime.policy.profile import PerformanceProfile


def main(layers: int = 58, experts: int = 256, gpus: int = 64, repeats: int = 200) -> None:
    counts = benchmark_counts(layers, experts, gpus, 0)
    base = static_placement(layers, experts, gpus)
    balance = balance_ratio(base_gpu_loads(counts, base, gpus))
    profile, consts = PerformanceProfile(), InferenceConstants(experts_per_gpu=experts // gpus)
    configs = {"bound": AllocatorConfig(), "no_bound": AllocatorConfig(adjacency_bound=False)}
    full: dict[str, list[float]] = {k: [] for k in configs}
    search: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(50):
        for cfg in configs.values():
            allocate(counts, base, gpus, cfg)
    for _ in range(repeats):
        for name, cfg in configs.items():
            t0 = time.perf_counter()
            allocate(counts, base, gpus, cfg)
            full[name].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            assign_vexpert_counts(balance, cfg, profile, consts)
            search[name].append((time.perf_counter() - t0) * 1e3)
    out = {"layers": layers, "experts": experts, "gpus": gpus, "repeats": repeats, "torch_threads": torch.get_num_threads()}
    for name in configs:
        out[f"{name}_allocate_median_ms"] = round(statistics.median(full[name]), 3)
        out[f"{name}_search_median_ms"] = round(statistics.median(search[name]), 3)
        plan = allocate(counts, base, gpus, configs[name])
        out[f"{name}_balance_after"] = round(float(plan.balance_predicted.mean()), 4)
        out[f"{name}_vexperts_per_gpu"] = int(plan.vexperts.sum())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
