"""The node's EP MoE layer (``ep_moe_layer``) on one GPU: eager vs. replayed from a CUDA graph, and
whether it runs with torch's sync debug mode set to "error" (no host synchronisation).

DeepSeek-V3 expert shape (H 7168, I 2048, bf16), 8 resident experts and 1 slot (a copy of the
hottest expert taking half of its pairs), top-8, world 1 (no all-to-all: the dispatch bookkeeping,
group layout, grouped GEMMs and combine are what is timed).

    python benchmarks/ep_layer_graph.py --pairs 512,2048,8192 --out results/ep_layer_graph.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.model.ep_moe import DeviceRoutingTable, ExpertStacks, RoutingTable, ep_moe_layer


def hot_copy_table(share: float, experts: int) -> RoutingTable:
    gpu = np.full((1, experts, 2), -1, dtype=np.int64)
    gpu[:, :, 0] = 0
    gpu[:, 0, 1] = 0
    local = np.full_like(gpu, -1)
    local[:, :, 0] = np.arange(experts)
    local[:, 0, 1] = experts
    cum = np.full((1, experts, 2), np.inf)
    cum[:, :, 0] = 1.0
    cum[:, 0, 0] = 1.0 - share
    cum[:, 0, 1] = 1.0
    return RoutingTable(1, gpu, local, cum, np.zeros((1, 1, 1), dtype=np.int64))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", default="512,2048,8192")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    numel = 3 * args.hidden * args.inter
    base = (torch.randn(args.experts, numel, device=dev) * 0.02).to(torch.bfloat16)
    slots = base[:1].clone()
    stacks = ExpertStacks(base, slots, args.inter)
    table = DeviceRoutingTable.of(hot_copy_table(0.5, args.experts), dev, replicas=2)
    rows = []
    for pairs in [int(p) for p in args.pairs.split(",")]:
        tokens = pairs // args.topk
        gen = torch.Generator(device=dev).manual_seed(pairs)
        probs = 1.0 / torch.arange(1, args.experts + 1, device=dev, dtype=torch.float32)
        ids = torch.multinomial(probs.expand(tokens, -1), args.topk, generator=gen)
        weights = torch.rand(tokens, args.topk, device=dev, generator=gen)
        x = torch.randn(tokens, args.hidden, device=dev, generator=gen).to(torch.bfloat16)

        def layer(x: torch.Tensor = x, ids: torch.Tensor = ids, weights: torch.Tensor = weights) -> torch.Tensor:
            return ep_moe_layer(x, ids, weights, table, 0, stacks, None, 0, 1, None)[0]

        for _ in range(3):
            eager = layer()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer()
            sync_free = True
        except RuntimeError as exc:
            sync_free = f"{exc}"[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer()
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(captured, eager))

        def timed(fn: Any, reps: int = args.reps) -> float:
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps

        eager_ms, graph_ms = timed(layer), timed(graph.replay)
        row = dict(pairs=pairs, tokens=tokens, eager_ms=eager_ms, graph_ms=graph_ms, sync_free=sync_free,
                   replay_equals_eager=same)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
