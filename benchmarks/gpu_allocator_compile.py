"""Experiment: can torch.compile fuse the static allocator enough for ≤ 1 ms on one GPU?

    python benchmarks/gpu_allocator_compile.py

Compares, on 58 layers × 256 experts × 64 GPUs (DeepSeek-V3 loads): eager, our CUDA-graph capture
(GraphedAllocator), and torch.compile of the static allocation (inductor kernels) captured in a
CUDA graph. Prints one JSON line per variant with median/p90 ms and compile time.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from vexpert_runtime.policy.allocator import AllocatorConfig, GraphedAllocator, allocate
from vexpert_runtime.policy.bench import benchmark_counts
from vexpert_runtime.policy.placement import static_placement


def timed(fn, repeats=200):  # type: ignore[no-untyped-def]
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {"median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * len(ts))]}


def main() -> None:
    counts = benchmark_counts(58, 256, 64).cuda()
    base = static_placement(58, 256, 64, device="cuda")
    cfg = AllocatorConfig()
    ref = allocate(counts, base, 64, cfg)
    print(json.dumps({"variant": "eager", **timed(lambda: allocate(counts, base, 64, cfg), 50)}))
    graphed = GraphedAllocator(58, 256, 64, cfg)
    graphed(counts, base)
    print(json.dumps({"variant": "cuda-graph", **timed(lambda: graphed(counts, base))}))

    def static_fn(c: torch.Tensor, b: torch.Tensor):  # type: ignore[no-untyped-def]
        p = allocate(c, b, 64, cfg, static=True)
        return p.vexperts, p.slot_expert, p.replica_gpu, p.replica_slot, p.replica_share, p.balance_predicted

    for mode in ("max-autotune-no-cudagraphs", "default"):
        try:
            t0 = time.perf_counter()
            compiled = torch.compile(static_fn, mode=mode, dynamic=False)
            out = compiled(counts, base)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            same = bool(torch.equal(out[1], ref.slot_expert))
            # capture the compiled kernels in a CUDA graph
            static_c, static_b = counts.clone(), base.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    compiled(static_c, static_b)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = compiled(static_c, static_b)

            def replay(static_c: torch.Tensor = static_c, g: torch.cuda.CUDAGraph = g) -> None:
                static_c.copy_(counts)
                g.replay()

            res = timed(replay)
            same_graph = bool(torch.equal(outs[1], ref.slot_expert))
            print(json.dumps({"variant": f"compile[{mode}]+graph", **res, "compile_s": compile_s,
                              "same_plan": same and same_graph}))
        except Exception as exc:  # report and go on: this is an experiment
            print(json.dumps({"variant": f"compile[{mode}]", "error": repr(exc)[:500]}))


if __name__ == "__main__":
    main()
