"""Allocator micro-benchmark: time one allocation for a given shape, next to our EPLB on the same input."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.allocator import AllocatorConfig, allocate
from vexpert_runtime.policy.placement import check_divisible, static_placement


def benchmark_counts(layers: int, experts: int, gpus: int, seed: int = 0, window: int = 10) -> torch.Tensor:
    """[L, E] counts of a k-iteration window: real DeepSeek-V3 distributions when the shape
    allows (bundled SGLang statistics), else a skewed Dirichlet draw."""
    rng = np.random.default_rng(seed)
    tokens = window * gpus * 256 * 8
    probs: np.ndarray
    try:
        from vexpert_runtime.simulation.trace import load_bundled_distribution

        real = load_bundled_distribution("decode_in1000out1000")
        if real.shape[1] == experts:
            probs = real[np.arange(layers) % real.shape[0]]
        else:
            raise LookupError
    except (LookupError, VExpertInputError):
        probs = rng.dirichlet(np.full(experts, 0.3), size=layers)
    return torch.from_numpy(rng.multinomial(tokens, probs)).to(torch.float32)


def _timed(fn: Any, repeats: int, sync: Any) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench_allocator(
    layers: int, experts: int, gpus: int, nodes: int = 8, device: str = "cpu", repeats: int = 50,
    eplb_repeats: int = 10, group_size: int = 2, vmax: int = 1, seed: int = 0,
) -> dict[str, Any]:
    """Median/p90 allocation time (ms) and EPLB's on the same counts. EPLB (CPU, with one
    redundant expert per GPU, as B2) is the reference implementation's job per rebalance. On CUDA,
    ``median_ms`` is the captured-graph allocator and ``eager_median_ms`` the plain one."""
    from vexpert_runtime.policy import eplb

    if layers <= 0 or experts <= 0:
        raise VExpertInputError("--layers/--experts", "must be positive")
    check_divisible(experts, gpus)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VExpertInputError("--device", "CUDA was asked for but no CUDA device is visible", "drop --device cuda")
    counts = benchmark_counts(layers, experts, gpus, seed).to(device)
    base = static_placement(layers, experts, gpus, device=device)
    cfg = AllocatorConfig(group_size=group_size, vmax=vmax)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # A long-running coordinator allocates every k iterations for hours; the first ~100 calls
    # of a fresh process run slower (allocator caches, page faults), so warm up before timing.
    for _ in range(max(50, repeats)):
        allocate(counts, base, gpus, cfg)
    eager_times = _timed(lambda: allocate(counts, base, gpus, cfg), repeats, sync)
    times = eager_times
    if device.startswith("cuda"):
        # On a GPU the allocation runs as one captured CUDA graph (GraphedAllocator).
        from vexpert_runtime.policy.allocator import GraphedAllocator

        graphed = GraphedAllocator(layers, experts, gpus, cfg, device=device)
        graphed(counts, base)
        times = _timed(lambda: graphed(counts, base), repeats, sync)
    plan = allocate(counts, base, gpus, cfg)
    groups = 8 if experts % 8 == 0 and experts >= 64 else 1
    eplb_nodes = nodes if gpus % nodes == 0 else 1
    cpu_counts = counts.cpu()
    eplb_times = _timed(lambda: eplb.rebalance_experts(cpu_counts, experts + gpus, groups, eplb_nodes, gpus), eplb_repeats, lambda: None)
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(times),
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "eager_median_ms": statistics.median(eager_times),
        "eplb_median_ms": statistics.median(eplb_times),
        "speedup_vs_eplb": statistics.median(eplb_times) / statistics.median(times),
        "layers": layers, "experts": experts, "gpus": gpus, "nodes": nodes, "device": device,
        "torch_threads": torch.get_num_threads(), "repeats": repeats,
        "balance_before": float(plan.balance_before.mean()), "balance_after": float(plan.balance_predicted.mean()),
        "vexperts_per_gpu": int(plan.vexperts.sum()),
    }
