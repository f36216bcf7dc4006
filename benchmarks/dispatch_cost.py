"""Cost of per-iteration replica dispatch per MoE layer (issue #14: ≤ 30 µs on an H200).

One EP rank at DeepSeek-V3 shape: E = 256 experts over N = 64 GPUs (EP64), S = 2 slots per GPU
(G = 2, Vmax = 1), replica width R = ``max_replicas(64, 2)`` = 64, B = 256 tokens of this rank,
top-8. The plan is the allocator's (static shapes) for a bundled DeepSeek-V3 layer distribution;
the batch routes with that distribution jittered (σ = 0.3 on the log-probabilities), so the plan's
shares are stale as they are between allocations.

Timed per mode (``plan``, ``local``, ``global``), with CUDA events, eager and replayed from a CUDA
graph: ``shares`` = :func:`dispatch_cum_share` alone (the dispatch's extra work, on a GPU the fused
Triton kernel of ``dispatch_kernel`` after the counts; ``plan`` reads the table: ~0) and
``choose`` = shares + :func:`choose_replicas` (what ``ep_moe_layer`` runs before its all-to-all). ``global`` here runs over no group: on one GPU its all-reduce is free, so the
number is the share computation only; run under ``torchrun --nproc-per-node 2`` (or more) and the
[E] int32 NCCL all-reduce is timed as well (``allreduce_us``, in a CUDA graph like the layer).
Then the torch twin of the kernel (what runs without Triton) and the kernel at 4–16 warps, each
with its largest difference from the twin, and the kernel alone (``kernel-only-*``: the counts made
beforehand) at 0 sweeps and at the default. Also reported: whether each mode runs with torch's sync debug mode at "error" (no host
sync), the kernels one call launches (torch profiler), and the shares' balance on the batch as if it were the
whole group's (the local/global difference needs many ranks: see ``vexpert demo --dispatch``).

    python benchmarks/dispatch_cost.py --compile --out results/dispatch_cost.json  # one H200
    torchrun --nproc-per-node 2 benchmarks/dispatch_cost.py --out results/dispatch_cost_x2.json
    python benchmarks/dispatch_cost.py --cpu                                       # smoke (numbers meaningless)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.model.dispatch import (
    DISPATCH_MODES,
    SWEEPS,
    all_reduce_counts,
    cumulative_shares,
    dispatch_cum_share,
    fused_dispatch_runs,
    gpu_loads,
    layer_counts,
    level_shares,
    plan_shares,
)
from vexpert_runtime.model.ep_moe import DeviceRoutingTable, choose_replicas, max_replicas, table_from_plan
from vexpert_runtime.policy.allocator import AllocatorConfig, allocate
from vexpert_runtime.policy.placement import balance_ratio, static_placement
from vexpert_runtime.simulation.trace import load_bundled_distribution


def setup(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """The device table of one layer's plan and this rank's routing [B, K] for it."""
    dist_ = torch.tensor(load_bundled_distribution(args.phase), dtype=torch.float64)[args.layer : args.layer + 1]
    if dist_.shape[1] != args.experts:
        raise SystemExit(f"the bundled distribution has {dist_.shape[1]} experts, not {args.experts}")
    # every slot used (no τ, no cost model): the most replicated experts, the dispatch's worst case
    config = AllocatorConfig(group_size=args.slots, vmax=1, balance_threshold=1.0, use_cost_model=False)
    counts = (dist_ * args.tokens * args.topk * args.gpus).to(torch.float32)
    plan = allocate(counts, static_placement(1, args.experts, args.gpus), args.gpus, config, static=True)
    table = DeviceRoutingTable.of(table_from_plan(plan, 1), dev, replicas=max_replicas(args.gpus, args.slots))
    gen = torch.Generator().manual_seed(args.seed)
    jittered = dist_[0] * torch.exp(0.3 * torch.randn(args.experts, generator=gen, dtype=torch.float64))
    ids = torch.multinomial(jittered.expand(args.tokens, -1), args.topk, generator=gen).to(dev)
    return {"table": table, "ids": ids, "replicated": int(((table.gpu[0] >= 0).sum(-1) > 1).sum())}


def timed(fn: Callable[[], Any], reps: int, dev: torch.device) -> float:
    """Mean µs per call (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(3):
        fn()
    if dev.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e6 * (time.perf_counter() - start) / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * begin.elapsed_time(end) / reps


def kernels(fn: Callable[[], Any], dev: torch.device) -> int:
    """Kernels (GPU) or aten ops (CPU) one call launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if dev.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)


def sync_free(fn: Callable[[], Any], dev: torch.device) -> bool | str | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as exc:
        return f"{exc}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def graphed(fn: Callable[[], Any], dev: torch.device) -> Callable[[], Any] | None:
    if dev.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def shares_row(name: str, fn: Callable[[], Any], reps: int, dev: torch.device) -> dict[str, Any]:
    """Eager and graph-replayed µs, kernels and sync-freedom of one share computation."""
    row: dict[str, Any] = {"mode": name, "shares_eager_us": round(timed(fn, reps, dev), 2),
                           "kernels_shares": kernels(fn, dev), "sync_free": sync_free(fn, dev)}
    replay = graphed(fn, dev)
    if replay is not None:
        row["shares_graph_us"] = round(timed(replay, reps, dev), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--gpus", type=int, default=64, help="N: EP ranks the plan spreads over")
    parser.add_argument("--slots", type=int, default=2, help="S = G·Vmax slots per GPU")
    parser.add_argument("--tokens", type=int, default=256, help="B: this rank's tokens")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--phase", default="decode_in1000out1000", help="bundled DeepSeek-V3 distribution")
    parser.add_argument("--layer", type=int, default=10, help="its layer")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweeps", type=int, default=SWEEPS, help=f"water-filling sweeps (default {SWEEPS})")
    parser.add_argument("--compile", action="store_true",
                        help="also time level_shares through torch.compile (fused kernels; not what the runtime runs)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test: numbers meaningless)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = None
    if world > 1:
        dist.init_process_group("gloo" if args.cpu else "nccl", device_id=None if args.cpu else dev)
        group = dist.group.WORLD
    reps = min(args.reps, 20) if args.cpu else args.reps
    s = setup(args, dev)
    table, ids = s["table"], s["ids"]
    gpu, local, cum = table.gpu[0], table.local[0], table.cum_share[0]
    copies = table.copies(0)
    rows = []
    for mode in DISPATCH_MODES:
        # with a group every rank runs this loop in the same order: the all-reduces pair up
        def shares(mode: str = mode) -> torch.Tensor:
            return dispatch_cum_share(mode, ids, gpu, cum, args.gpus, group, args.sweeps,  # type: ignore[arg-type]
                                      copies=copies)

        def choose(mode: str = mode) -> tuple[torch.Tensor, torch.Tensor]:
            return choose_replicas(ids, gpu, local, shares(mode), rank, args.gpus)

        share = plan_shares(shares()).to(torch.float32)
        counts = torch.zeros(args.experts, device=dev).index_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=dev))
        row: dict[str, Any] = {
            "mode": mode,
            "shares_eager_us": round(timed(shares, reps, dev), 2),
            "choose_eager_us": round(timed(choose, reps, dev), 2),
            "kernels_shares": kernels(shares, dev),
            "sync_free": sync_free(choose, dev),
            "batch_balance": round(float(balance_ratio(gpu_loads(counts, gpu, share, args.gpus))), 4),
        }
        for name, fn in (("shares", shares), ("choose", choose)):
            replay = graphed(fn, dev)
            if replay is not None:
                row[f"{name}_graph_us"] = round(timed(replay, reps, dev), 2)
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    if dev.type == "cuda" and fused_dispatch_runs(copies):
        # The product path above runs the fused kernel (dispatch_kernel); here its torch twin (the
        # same arithmetic in ~140 kernels) and the kernel's block sizes, for the record.
        from vexpert_runtime.model.dispatch_kernel import fused_cum_shares

        def twin() -> torch.Tensor:
            return cumulative_shares(level_shares(layer_counts(ids, args.experts), gpu, args.gpus, args.sweeps,
                                                  plan_shares(cum)), gpu)

        twin_out = twin()
        fin = torch.isfinite(twin_out)

        variants: list[tuple[str, Callable[[], Any]]] = [("local-torch-twin", twin)]
        for warps in (4, 8, 16):
            def fused(warps: int = warps) -> torch.Tensor:
                return fused_cum_shares(layer_counts(ids, args.experts), copies, cum, args.gpus, args.sweeps,
                                        num_warps=warps)

            variants.append((f"local-fused-warps{warps}", fused))
        # the kernel alone (counts made beforehand), and its fixed part (0 sweeps: load, write, cumulate)
        counts_once = layer_counts(ids, args.experts)
        for sweeps in (0, args.sweeps):
            def kernel_only(sweeps: int = sweeps) -> torch.Tensor:
                return fused_cum_shares(counts_once, copies, cum, args.gpus, sweeps)

            variants.append((f"kernel-only-sweeps{sweeps}", kernel_only))
        for name, fn in variants:
            out = fn()
            reference = twin_out if not name.endswith("sweeps0") else cumulative_shares(
                level_shares(counts_once, gpu, args.gpus, 0, plan_shares(cum)), gpu)
            row = {**shares_row(name, fn, reps, dev),
                   "max_abs_diff_vs_twin": float((out[fin] - reference[fin]).abs().max()),
                   "same_padding": bool(torch.equal(torch.isfinite(out), fin))}
            if rank == 0:
                print(json.dumps(row), flush=True)
            rows.append(row)
    if args.compile and dev.type == "cuda":
        # The same arithmetic fused by Inductor: how far a fused kernel could take the cost.
        inductor_shares = torch.compile(level_shares, fullgraph=True, dynamic=False)

        def compiled() -> torch.Tensor:
            counts = all_reduce_counts(layer_counts(ids, args.experts), group)
            return cumulative_shares(inductor_shares(counts, gpu, args.gpus, args.sweeps, plan_shares(cum)), gpu)

        row = shares_row("global-compiled", compiled, reps, dev)
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    allreduce: dict[str, Any] = {}
    if group is not None:
        counts32 = torch.zeros(args.experts, dtype=torch.int32, device=dev)

        def reduce() -> None:
            dist.all_reduce(counts32, group=group)

        allreduce["allreduce_eager_us"] = round(timed(reduce, reps, dev), 2)
        replay = graphed(reduce, dev)
        if replay is not None:
            allreduce["allreduce_graph_us"] = round(timed(replay, reps, dev), 2)
        if rank == 0:
            print(json.dumps(allreduce), flush=True)
    summary = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (numbers meaningless)",
        "torch": torch.__version__,
        "world": world,
        "sweeps": args.sweeps,
        "shape": {"experts": args.experts, "gpus": args.gpus, "slots": args.slots, "replicas": table.replicas,
                  "tokens": args.tokens, "topk": args.topk, "replicated_experts": s["replicated"]},
        "rows": rows,
        **allreduce,
    }
    if args.out and rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
