"""Allocator on CUDA: end-to-end latency and a per-stage breakdown (run on a GPU host).

    python benchmarks/gpu_allocator.py [--repeats 200]

Prints one JSON object per line: the `vexpert bench allocator --device cuda` result, then stage
timings (CUDA-synchronised wall clock, ms) so the cost of host syncs is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vexpert_runtime.policy import allocator as A
from vexpert_runtime.policy.bench import bench_allocator, benchmark_counts
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, static_placement
from vexpert_runtime.policy.profile import PerformanceProfile


def stage_times(device: str, repeats: int) -> dict[str, float]:
    w = benchmark_counts(58, 256, 64).to(device)
    base = static_placement(58, 256, 64, device=device)
    cfg, prof, consts = A.AllocatorConfig(), PerformanceProfile(), InferenceConstants()

    def timed(fn, *args):  # type: ignore[no-untyped-def]
        out, ts = None, []
        for _ in range(repeats):
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            out = fn(*args)
            torch.cuda.synchronize() if device == "cuda" else None
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), out

    res: dict[str, float] = {}
    bal = balance_ratio(base_gpu_loads(w, base, 64))
    res["assign"], v = timed(A.assign_vexpert_counts, bal, cfg, prof, consts)
    res["replica_counts"], c = timed(A.replica_counts, w, v * 64, 64)
    res["place"], _ls = timed(A.place_replicas, w, base, c, v, 64)
    res["total"], plan = timed(A.allocate, w, base, 64)
    res["water_fill"], _ = timed(A.water_fill_shares, w, plan.replica_gpu, 64, cfg.share_refinement_sweeps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    for device in ("cuda", "cpu"):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        print(json.dumps(bench_allocator(58, 256, 64, 8, device, args.repeats)))
        print(json.dumps({"device": device, "stages_ms": stage_times(device, 50)}))
    if torch.cuda.is_available():
        # CPU and CUDA must give the same plan.
        w = benchmark_counts(58, 256, 64)
        base = static_placement(58, 256, 64)
        cpu = A.allocate(w, base, 64)
        gpu = A.allocate(w.cuda(), base.cuda(), 64).to("cpu")
        print(json.dumps({"same_vexperts": bool(torch.equal(cpu.vexperts, gpu.vexperts)),
                          "same_slots": bool(torch.equal(cpu.slot_expert, gpu.slot_expert)),
                          "share_max_abs_diff": float((cpu.replica_share - gpu.replica_share).abs().max())
                          if cpu.replica_share.shape == gpu.replica_share.shape else -1.0,
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
