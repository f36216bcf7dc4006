"""The GPU path of issue #7, measured: slot fills over CUDA IPC, GPU-side handshakes, a decode
iteration as one CUDA graph, plan switches, and a skewed 2-GPU MoE step (static vs vExpert).

One coordinator process (this one: the pinned L2 pool, one copy stream per GPU) and one worker
process per GPU (base experts, the slot ring and its flags in HBM, exported through CUDA IPC).
Everything the workers do runs on their streams; the only CPU synchronisation is at the start and
end of each measurement.

    python benchmarks/gpu_path.py --device cuda --out results/gpu_path          # H200 host
    python benchmarks/gpu_path.py --device cpu --small --out /tmp/gp             # CPU twin (CI)

Sections (each writes ``<out>/<section>.json``; ``summary.json`` collects them):
  bandwidth  plain pinned H2D vs. fills into the workers' slots through IPC, per GPU and all at once
  memory     HBM of the slot ring + flags per worker; pinned memory per process vs. per-worker pools
  pipeline   MoE layer time with slots pre-filled vs. streamed layer-ahead, over token counts
  switch     per-iteration time series with a plan switch every few iterations (CUDA graph replay)
  skew       all workers, NCCL all-to-all, DeepSeek-V3 per-layer loads: static vs. vExpert step time
The CPU twin runs the same protocol (shared-memory slots and flags, polling waits, gloo) with tiny
shapes; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    RoutingTable,
    ep_moe_layer,
    static_table,
    table_from_plan,
)
from vexpert_runtime.node.gpu_pipeline import RingFiller, SlotRing
from vexpert_runtime.node.gpu_sync import acquire, flag_ops_for, release
from vexpert_runtime.policy.allocator import AllocatorConfig, allocate
from vexpert_runtime.policy.placement import static_placement
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.trace import load_bundled_distribution

DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------------------------
# Shapes and shared helpers
# ------------------------------------------------------------------------------------------------


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    if args.small:
        return dict(hidden=64, inter=32, local_experts=4, layers=4, ring=2, vmax=1, pool_rows=8,
                    sweep=[64, 256], switch_pairs=128, switch_iters=24, switch_every=6, iters=4, warmup=1,
                    skew_tokens=64, skew_topk=2, skew_layers=3, skew_reps=3, bw_reps=3)
    return dict(hidden=7168, inter=2048, local_experts=8, layers=4, ring=2, vmax=1, pool_rows=16,
                sweep=[512, 2048, 8192, 16384, 32768], switch_pairs=32768, switch_iters=160, switch_every=20,
                iters=12, warmup=3, skew_tokens=4096, skew_topk=4, skew_layers=6, skew_reps=10,
                bw_reps=8)


def expert_row(seed: int, numel: int, device: torch.device) -> torch.Tensor:
    """Deterministic packed expert ``seed`` (the same bits on every device of one kind)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(numel, generator=gen, device=device) * 0.02).to(DTYPE)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """CUDA events on the GPU, wall clock on the CPU twin. Milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float:
        if self.device.type == "cuda":
            return float(a.elapsed_time(b))
        return (b - a) * 1e3


def host_pinned_bytes() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        values = stats()
        return int(values.get("allocated_bytes.current", values.get("allocated_bytes", 0)))
    except Exception:
        return None


def skewed_local(pairs: int, groups: int, seed: int, device: torch.device) -> torch.Tensor:
    """Local expert of each pair, Zipf-like over ``groups`` (the first one hottest). [pairs] int64."""
    weights = torch.tensor([1.0 / (g + 1) for g in range(groups)])
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(weights, pairs, replacement=True, generator=gen).to(device)


# ------------------------------------------------------------------------------------------------
# Worker
# ------------------------------------------------------------------------------------------------


def worker_main(rank: int, world: int, args: argparse.Namespace, shape: dict[str, Any], port: int,
                to_coord: Any, from_coord: Any) -> None:
    try:
        _worker(rank, world, args, shape, port, to_coord, from_coord)
    except BaseException:
        to_coord.put(("error", rank, traceback.format_exc()))
        raise


def _worker(rank: int, world: int, args: argparse.Namespace, shape: dict[str, Any], port: int,
            to_coord: Any, from_coord: Any) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    hidden, inter = shape["hidden"], shape["inter"]
    numel = 3 * hidden * inter
    ops = flag_ops_for(device, timeout_s=30.0)
    stream = None  # flag operations go on the current stream (the capturing one under graph capture)
    timer = Timer(device)

    allocated0 = torch.cuda.memory_allocated(device) if cuda else 0
    ring = SlotRing.allocate(shape["ring"], shape["vmax"], numel, DTYPE, device)
    ring_allocated = (torch.cuda.memory_allocated(device) - allocated0) if cuda else ring.nbytes
    base = torch.stack([expert_row(1000 + rank * shape["local_experts"] + e, numel, device)
                        for e in range(shape["local_experts"])])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    to_coord.put(("ring", rank, ring.slots, ring.flags,
                  dict(ring_bytes=ring.nbytes, ring_allocated=ring_allocated, pinned=host_pinned_bytes(),
                       free_before_coordinator=torch.cuda.mem_get_info(device)[0] if cuda else None)))

    def go() -> None:
        to_coord.put(("captured", rank, None))
        command, _ = from_coord.get()
        assert command == "go", command

    while True:
        command, params = from_coord.get()
        if command == "stop":
            break
        params["go"] = go
        started = time.perf_counter()
        if command == "pipeline":
            result = run_pipeline(rank, params, shape, device, base, ring, ops, stream, timer)
        elif command == "switch":
            result = run_switch(rank, params, shape, device, base, ring, ops, stream, timer)
        elif command == "skew":
            result = run_skew(rank, world, params, shape, device, base, ring, timer)
        elif command == "pin_own_pool":
            result = pin_own_pool(params["rows"], numel)
        elif command == "memory":
            result = dict(free_total=list(torch.cuda.mem_get_info(device)) if cuda else None,
                          allocated=torch.cuda.memory_allocated(device) if cuda else None,
                          pinned=host_pinned_bytes())
        else:
            raise ValueError(command)
        result["worker_wall_s"] = time.perf_counter() - started
        to_coord.put(("done", rank, result))
    dist.destroy_process_group()


def pin_own_pool(rows: int, numel: int) -> dict[str, Any]:
    """What a design without a coordinator does: every worker pins its own full pool (paper Table 1)."""
    start = time.perf_counter()
    pool = torch.empty(rows, numel, dtype=DTYPE, pin_memory=torch.cuda.is_available())
    pool.view(torch.int16)[:, :: 2048].fill_(1)  # touch every page
    pinned = host_pinned_bytes()
    seconds = time.perf_counter() - start
    nbytes = pool.numel() * pool.element_size()
    del pool
    return dict(bytes=nbytes, seconds=seconds, pinned_after=pinned)


def hot_copy_table(shares: list[float], experts: int, slots: int, plan_id: int = 1) -> RoutingTable:
    """One GPU holding every expert; slot 0 of each layer holds a second copy of expert 0 (the
    hottest) that takes ``shares[layer]`` of its pairs — a replica of a hot expert, on one GPU."""
    layers = len(shares)
    gpu = np.full((layers, experts, 2), -1, dtype=np.int64)
    gpu[:, :, 0] = 0
    gpu[:, 0, 1] = 0
    local = np.full_like(gpu, -1)
    local[:, :, 0] = np.arange(experts)
    local[:, 0, 1] = experts
    cum = np.full((layers, experts, 2), np.inf)
    cum[:, :, 0] = 1.0
    cum[:, 0, 0] = 1.0 - np.asarray(shares)
    cum[:, 0, 1] = 1.0
    slot_expert = np.full((layers, 1, slots), -1, dtype=np.int64)
    slot_expert[:, 0, 0] = 0
    return RoutingTable(plan_id, gpu, local, cum, slot_expert)


def _routes(pairs: int, layers: int, shape: dict[str, Any], device: torch.device, seed: int,
            slot_share: float) -> tuple[DeviceRoutingTable, list[torch.Tensor], torch.Tensor]:
    """A one-GPU plan in a device table (``slot_share`` of the hot expert's pairs to its copy in the
    slot), per-layer expert ids [pairs, 1] with a Zipf skew over the local experts, and tokens."""
    le = shape["local_experts"]
    table = DeviceRoutingTable.of(hot_copy_table([slot_share] * layers, le, shape["vmax"]), device, replicas=2)
    ids = [skewed_local(pairs, le, seed + layer, device).unsqueeze(1) for layer in range(layers)]
    x = torch.randn(pairs, shape["hidden"], device=device).to(DTYPE)
    return table, ids, x


def _iteration(x: torch.Tensor, base: torch.Tensor, ring: SlotRing, table: DeviceRoutingTable,
               ids: list[torch.Tensor], shape: dict[str, Any], ops: Any, stream: Any) -> torch.Tensor:
    """The node's layer (``ep_moe_layer``, one rank) per layer over ring buffer layer mod R, with the
    slot handshake in its hooks when ``ops`` is given (None: slots pre-filled)."""
    weights = torch.ones(x.shape[0], 1, device=x.device)
    y = x
    for layer, layer_ids in enumerate(ids):
        buffer = layer % ring.ring
        stacks = ExpertStacks(base, ring.slots[buffer], shape["inter"])
        wait = None if ops is None else (lambda b=buffer: acquire(ops, stream, ring.flags, b))
        free = None if ops is None else (lambda b=buffer: release(ops, stream, ring.flags, b))
        y, _ = ep_moe_layer(x, layer_ids, weights, table, layer, stacks, None, 0, 1, None,
                            slot_wait=wait, after_compute=free)
    return y


def _capture(fn: Any, device: torch.device) -> tuple[Any, str]:
    """A CUDA graph of ``fn`` (replay callable) or the eager function if capture fails."""
    if device.type != "cuda":
        return fn, "eager (cpu)"
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize(device)
        return graph.replay, "cuda-graph"
    except Exception as exc:  # record why and measure eagerly
        torch.cuda.synchronize(device)
        return fn, f"eager (capture failed: {type(exc).__name__}: {str(exc)[:200]})"


def run_pipeline(rank: int, params: dict[str, Any], shape: dict[str, Any], device: torch.device,
                 base: torch.Tensor, ring: SlotRing, ops: Any, stream: Any, timer: Timer) -> dict[str, Any]:
    pairs, mode, iters = params["pairs"], params["mode"], params["iters"] + params["warmup"]
    table, ids, x = _routes(pairs, shape["layers"], shape, device, seed=10 * rank, slot_share=0.5)
    out: list[torch.Tensor] = []
    # Warm up without the handshake (allocations, kernels), then capture the real iteration.
    _iteration(x, base, ring, table, ids, shape, None, stream)
    sync(device)
    step_ops = ops if mode == "pipeline" else None
    replay, how = _capture(lambda: out.append(_iteration(x, base, ring, table, ids, shape, step_ops, stream)), device)
    sync(device)
    params["go"]()  # the coordinator starts its fills now
    marks = [timer.mark()]
    for _ in range(iters):
        replay()
        marks.append(timer.mark())
    sync(device)
    times = [timer.elapsed(a, b) for a, b in itertools.pairwise(marks)][params["warmup"]:]
    return dict(pairs=pairs, mode=mode, how=how, iteration_ms=times,
                layer_ms=float(np.mean(times)) / shape["layers"], checksum=float(out[-1].float().abs().sum()))


def run_switch(rank: int, params: dict[str, Any], shape: dict[str, Any], device: torch.device,
               base: torch.Tensor, ring: SlotRing, ops: Any, stream: Any, timer: Timer) -> dict[str, Any]:
    pairs, iters, every = params["pairs"], params["iters"], params["every"]
    plans = [hot_copy_table([share] * shape["layers"], shape["local_experts"], shape["vmax"], plan_id=p + 1)
             for p, share in enumerate((0.5, 0.3))]
    table, ids, x = _routes(pairs, shape["layers"], shape, device, seed=100 * rank, slot_share=0.5)
    _iteration(x, base, ring, table, ids, shape, None, stream)
    sync(device)
    replay, how = _capture(lambda: _iteration(x, base, ring, table, ids, shape, ops, stream), device)
    sync(device)
    params["go"]()
    marks = [timer.mark()]
    switches = []
    for it in range(iters):
        if it and it % every == 0:  # plan switch: the new plan into the captured device table
            table.load(plans[(it // every) % 2])
            switches.append(it)
        replay()
        marks.append(timer.mark())
    sync(device)
    times = [timer.elapsed(a, b) for a, b in itertools.pairwise(marks)]
    return dict(pairs=pairs, how=how, iteration_ms=times, switches=switches)


def run_skew(rank: int, world: int, params: dict[str, Any], shape: dict[str, Any], device: torch.device,
             base: torch.Tensor, ring: SlotRing, timer: Timer) -> dict[str, Any]:
    """One MoE step (dispatch all-to-all, grouped GEMMs, combine all-to-all) per layer and plan."""
    hidden, inter, le = shape["hidden"], shape["inter"], shape["local_experts"]
    tokens, topk = params["tokens"], params["topk"]
    stacks = ExpertStacks(base, ring.slots[0], inter)  # slots: buffer 0, pre-filled by the coordinator
    table = DeviceRoutingTable.allocate(1, le * world, world, shape["vmax"], device)
    results = []
    for case in params["cases"]:
        gen = torch.Generator().manual_seed(case["seed"] * 97 + rank)
        probs = torch.tensor(case["probs"], dtype=torch.float64)
        ids = torch.multinomial(probs.expand(tokens, -1).float(), topk, replacement=False, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen).to(DTYPE).to(device)
        weights = torch.full((tokens, topk), 1.0 / topk, device=device)
        ids = ids.to(device)
        row = {}
        for plan_name in ("static", "vexpert"):
            table.load(_table_of(case[plan_name]))  # a plan switch: the same device tensors
            stats_of: list[Any] = []

            def step(stats_of: list[Any] = stats_of, x: torch.Tensor = x, ids: torch.Tensor = ids,
                     weights: torch.Tensor = weights) -> torch.Tensor:
                y, stats = ep_moe_layer(x, ids, weights, table, 0, stacks, None, rank, world, dist.group.WORLD)
                stats_of[:] = [stats]
                return y.float()

            for _ in range(2):
                step()
            sync(device)
            dist.barrier()
            times = []
            for _ in range(params["reps"]):
                a = timer.mark()
                out = step()
                b = timer.mark()
                sync(device)
                times.append(timer.elapsed(a, b))
            t = torch.tensor([float(np.median(times))], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            pairs_here = stats_of[0].computed.sum().to(torch.float32).reshape(1)
            loads = [torch.zeros(1, device=device) for _ in range(world)]
            dist.all_gather(loads, pairs_here)
            row[plan_name] = dict(step_ms=float(t), loads=[float(v) for v in loads],
                                  checksum=float(out.abs().sum()), out=out.cpu() if rank == 0 else None)
        if rank == 0:
            ref, got = row["static"].pop("out"), row["vexpert"].pop("out")
            row["rel_err_vexpert_vs_static"] = float((got - ref).norm() / ref.norm().clamp(min=1e-12))
        else:
            row["static"].pop("out")
            row["vexpert"].pop("out")
        results.append(dict(case=case["name"], **row))
    return dict(cases=results)


# ------------------------------------------------------------------------------------------------
# Coordinator
# ------------------------------------------------------------------------------------------------


class Coordinator:
    def __init__(self, args: argparse.Namespace, shape: dict[str, Any]) -> None:
        self.args, self.shape = args, shape
        self.cuda = args.device == "cuda"
        self.world = (args.gpus or torch.cuda.device_count()) if self.cuda else (args.gpus or 2)
        # The skew section's experts: local_experts per worker; the pool holds every one of them
        # (pool row e = expert e), and at least 8 rows for the other sections.
        shape["skew_experts"] = shape["local_experts"] * self.world
        shape["pool_rows"] = max(shape["pool_rows"], shape["skew_experts"])
        self.numel = 3 * shape["hidden"] * shape["inter"]
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] = dict(device=args.device, world=self.world, shape=shape,
                                            torch=torch.__version__)
        if self.cuda:
            self.summary["gpu"] = torch.cuda.get_device_name(0)

    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", g) if self.cuda else torch.device("cpu") for g in range(self.world)]

    def start(self) -> None:
        t0 = time.perf_counter()
        rows = self.shape["pool_rows"]
        self.pool = torch.empty(rows, self.numel, dtype=DTYPE, pin_memory=self.cuda)
        pin_s = time.perf_counter() - t0
        dev0 = self.devices()[0]
        for r in range(rows):  # pool row r = expert seed 1000 + r (the skew section's experts)
            self.pool[r].copy_(expert_row(1000 + r, self.numel, dev0))
        self.summary["pool"] = dict(rows=rows, bytes=self.pool.numel() * self.pool.element_size(),
                                    pin_seconds=pin_s, pinned_after=host_pinned_bytes())
        ctx = mp.get_context("spawn")
        self.to_coord = ctx.Queue()
        self.queues = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self.procs = [ctx.Process(target=worker_main, args=(r, self.world, self.args, self.shape, port,
                                                             self.to_coord, self.queues[r]), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()
        self.rings: list[SlotRing] = [None] * self.world  # type: ignore[list-item]
        self.worker_info: list[dict[str, Any]] = [{}] * self.world
        for _ in range(self.world):
            _, rank, slots, flags, info = self.receive()
            self.rings[rank] = SlotRing(slots, flags)  # opened through CUDA IPC (shared memory on CPU)
            self.worker_info[rank] = info
        self.ops = flag_ops_for(self.devices()[0], timeout_s=30.0)
        self.streams = [torch.cuda.Stream(d) if self.cuda else None for d in self.devices()]
        self.fillers = [RingFiller(self.rings[r], self.pool, self.ops, self.streams[r]) for r in range(self.world)]
        self.summary["startup_s"] = time.perf_counter() - t0

    def receive(self, timeout: float = 120.0) -> tuple[Any, ...]:
        message = self.to_coord.get(timeout=timeout)
        if message[0] == "error":
            raise RuntimeError(f"worker {message[1]} failed:\n{message[2]}")
        return tuple(message)

    def command(self, name: str, params: list[dict[str, Any]] | dict[str, Any],
                at_start: Any = None) -> list[dict[str, Any]]:
        """Run ``name`` on every worker. With ``at_start``: wait until every worker has captured its
        graph, call ``at_start()`` (start the fills), then let them go."""
        per = params if isinstance(params, list) else [params] * self.world
        for r in range(self.world):
            self.queues[r].put((name, per[r]))
        if at_start is not None:
            for _ in range(self.world):
                kind, rank, _ = self.receive()
                assert kind == "captured", kind
            at_start()
            for q in self.queues:
                q.put(("go", {}))
        results: list[dict[str, Any]] = [{}] * self.world
        for _ in range(self.world):
            _, rank, result = self.receive()
            results[rank] = result
        return results

    def stop(self) -> None:
        for q in self.queues:
            q.put(("stop", {}))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def save(self, section: str, data: Any) -> None:
        self.summary[section] = data
        (self.out / f"{section}.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        print(f"[{section}] {json.dumps(_brief(section, data), default=str)}", flush=True)

    # -------------------------------------------------------------------------------- sections

    def bandwidth(self) -> dict[str, Any]:
        reps, rows = self.shape["bw_reps"], self.shape["pool_rows"]
        nbytes_row = self.numel * 2
        local = [torch.empty(self.shape["ring"] * self.shape["vmax"], self.numel, dtype=DTYPE, device=d)
                 for d in self.devices()]
        targets = {"plain": [buf.view(-1, self.numel) for buf in local],
                   "ipc": [ring.slots.view(-1, self.numel) for ring in self.rings]}
        result: dict[str, Any] = dict(bytes_per_copy=nbytes_row)

        def run(kind: str, gpus: list[int]) -> float:
            copies = 0
            for g in gpus:
                sync(self.devices()[g])
            t0 = time.perf_counter()
            for rep in range(reps):
                for g in gpus:
                    dst = targets[kind][g]
                    with torch.cuda.stream(self.streams[g]) if self.cuda else contextlib.nullcontext():
                        for s in range(dst.shape[0]):
                            dst[s].copy_(self.pool[(rep + s + g) % rows], non_blocking=True)
                            copies += 1
            for g in gpus:
                if self.cuda:
                    self.streams[g].synchronize()
            seconds = time.perf_counter() - t0
            return copies * nbytes_row / seconds / 1e9

        for kind in ("plain", "ipc"):  # warm-up
            run(kind, list(range(self.world)))
        for g in range(self.world):
            for kind in ("plain", "ipc"):
                result[f"{kind}_gpu{g}_GBps"] = max(run(kind, [g]) for _ in range(3))
        for kind in ("plain", "ipc"):
            result[f"{kind}_all_GBps"] = max(run(kind, list(range(self.world))) for _ in range(3))
        result["ipc_over_plain_per_gpu"] = [result[f"ipc_gpu{g}_GBps"] / result[f"plain_gpu{g}_GBps"]
                                            for g in range(self.world)]
        result["ipc_over_plain_all"] = result["ipc_all_GBps"] / result["plain_all_GBps"]
        result["copy_ms_per_expert"] = nbytes_row / (min(result[f"ipc_gpu{g}_GBps"] for g in range(self.world)) * 1e9) * 1e3
        del local
        return result

    def memory(self) -> dict[str, Any]:
        if self.cuda:
            torch.cuda.empty_cache()
        reserved = [torch.cuda.memory_reserved(d) if self.cuda else 0 for d in self.devices()]
        workers = self.command("memory", {})
        # What the coordinator costs on each worker's GPU: its CUDA context (and anything it keeps
        # reserved), seen as the drop in free memory since the worker exported its ring.
        coordinator_on_gpu = [(i["free_before_coordinator"] - w["free_total"][0]) if self.cuda else None
                              for i, w in zip(self.worker_info, workers, strict=True)]
        own = self.command("pin_own_pool", {"rows": self.shape["pool_rows"]})
        pool_bytes = self.pool.numel() * self.pool.element_size()
        return dict(
            slot_ring_bytes_per_worker=[i["ring_bytes"] for i in self.worker_info],
            slot_ring_allocated_per_worker=[i["ring_allocated"] for i in self.worker_info],
            slot_ring_MiB=self.worker_info[0]["ring_bytes"] / 2**20,
            worker_pinned_bytes_at_start=[i["pinned"] for i in self.worker_info],
            worker_memory=workers,
            coordinator_pinned_bytes=pool_bytes,
            coordinator_pin_seconds=self.summary["pool"]["pin_seconds"],
            per_worker_pool_alternative=dict(bytes_each=[o["bytes"] for o in own], seconds_each=[o["seconds"] for o in own],
                                             node_total_bytes=sum(o["bytes"] for o in own)),
            node_pinned_ours=pool_bytes,
            node_pinned_per_worker_pools=pool_bytes * self.world,
            coordinator_on_each_gpu_bytes=coordinator_on_gpu,
            coordinator_reserved_bytes=reserved,
            nvml=_nvml_process_memory(os.getpid()) if self.cuda else None,
        )

    def _fill_sequences(self, sequences: int, row_of: Any) -> threading.Thread:
        """Enqueue ``sequences`` layer fills for every worker, from a thread (the CPU may block
        when a stream's queue is full: that is the backpressure)."""

        def go() -> None:
            for s in range(sequences):
                for r, filler in enumerate(self.fillers):
                    filler.fill(s, [row_of(s, r)])

        thread = threading.Thread(target=go, daemon=True)
        return thread

    def pipeline(self) -> dict[str, Any]:
        shape = self.shape
        rows: list[dict[str, Any]] = []
        for pairs in shape["sweep"]:
            for mode in ("prefilled", "pipeline", "prefilled"):  # prefilled before and after: clock drift
                iters = shape["iters"] + shape["warmup"]
                fill = self._fill_sequences(iters * shape["layers"], lambda s, r: (s + r) % shape["pool_rows"])

                def start(fill: threading.Thread = fill, mode: str = mode) -> None:
                    if mode == "pipeline":
                        fill.start()

                per = [dict(pairs=pairs, mode=mode, iters=shape["iters"], warmup=shape["warmup"])
                       for _ in range(self.world)]
                results = self.command("pipeline", per, start)
                if mode == "pipeline":
                    fill.join()
                    for stream in self.streams:
                        if stream is not None:
                            stream.synchronize()
                for r, res in enumerate(results):
                    rows.append(dict(worker=r, pairs=pairs, mode=mode, how=res["how"], layer_ms=res["layer_ms"],
                                     iteration_ms_median=float(np.median(res["iteration_ms"]))))
        return dict(rows=rows, table=_pipeline_table(rows, self.summary.get("bandwidth", {}).get("copy_ms_per_expert")))

    def switch(self) -> dict[str, Any]:
        shape = self.shape
        iters, every = shape["switch_iters"], shape["switch_every"]
        # Plan p streams pool rows {p, p+2}: a switch changes the copy list's sources (coordinator side).
        fill = self._fill_sequences(iters * shape["layers"],
                                    lambda s, r: ((s // shape["layers"]) // every % 2 + 2 * (s % 2)) % shape["pool_rows"])

        per = [dict(pairs=shape["switch_pairs"], iters=iters, every=every) for _ in range(self.world)]
        results = self.command("switch", per, fill.start)
        fill.join()
        out = []
        for r, res in enumerate(results):
            times = np.asarray(res["iteration_ms"][2:])  # first two: start-up of the fill stream
            switch_iters = [s - 2 for s in res["switches"] if s >= 2]
            near = sorted({i for s in switch_iters for i in (s, s + 1) if 0 <= i < len(times)})
            away = [i for i in range(len(times)) if i not in near]
            out.append(dict(worker=r, how=res["how"], iteration_ms=res["iteration_ms"], switches=res["switches"],
                            median_ms=float(np.median(times)), p99_ms=float(np.percentile(times, 99)),
                            max_ms=float(times.max()),
                            at_switch_mean_ms=float(times[near].mean()) if near else None,
                            at_switch_max_ms=float(times[near].max()) if near else None,
                            away_mean_ms=float(times[away].mean()),
                            spike_ratio=float(times[near].max() / np.median(times[away])) if near else None))
        return dict(workers=out)

    def skew(self) -> dict[str, Any]:
        shape = self.shape
        if self.world < 2:
            return dict(skipped="needs 2 workers")
        dist_ds3 = load_bundled_distribution("decode_in1000out1000")
        experts, le = shape["skew_experts"], shape["local_experts"]
        rng = np.random.default_rng(0)
        cases = []
        layers = np.linspace(0, dist_ds3.shape[0] - 1, shape["skew_layers"]).astype(int)
        base_gpu = static_placement(1, experts, self.world)
        config = AllocatorConfig(group_size=1, vmax=shape["vmax"], balance_threshold=0.95, use_cost_model=False)
        for i, layer in enumerate(layers):
            ranking = np.argsort(-dist_ds3[layer])
            # The layer's hottest expert plus random others: a hot expert on one GPU, as at EP32–64
            # where a GPU holds only a few experts.
            picks = np.concatenate([ranking[:1], ranking[1 + rng.choice(len(ranking) - 1, size=experts - 1, replace=False)]])
            probs = dist_ds3[layer][picks]
            probs = probs[rng.permutation(experts)]
            probs = probs / probs.sum()
            counts = torch.tensor(probs * shape["skew_tokens"] * self.world * shape["skew_topk"]).unsqueeze(0).float()
            plan = allocate(counts, base_gpu, self.world, config)
            vex, static = table_from_plan(plan, 1), static_table(1, experts, self.world, shape["vmax"])
            cases.append(dict(name=f"layer{int(layer) + 3}", seed=i, probs=probs.tolist(),
                              static=_table_json(static), vexpert=_table_json(vex)))
        results = []
        for case in cases:
            # Prefill each worker's slot 0 (buffer 0) with the plan's replicated expert over the IPC ring.
            # Pre-fill each worker's buffer 0 with the plan's replicated experts (pool row e = expert e,
            # generated from the same seed as the worker's resident copy); streaming is measured above.
            for r in range(self.world):
                for s, expert in enumerate(case["vexpert"]["slot_expert"][r]):
                    if expert >= 0:
                        self.rings[r].slots[0, s].copy_(self.pool[expert])
            for d in self.devices():
                sync(d)
            params = dict(tokens=shape["skew_tokens"], topk=shape["skew_topk"], reps=shape["skew_reps"],
                          cases=[case])
            res = self.command("skew", params)[0]["cases"][0]
            st, vx = res["static"], res["vexpert"]
            bal = {k: float(np.mean(v["loads"]) / max(v["loads"])) for k, v in (("static", st), ("vexpert", vx))}
            results.append(dict(case=res["case"], static_ms=st["step_ms"], vexpert_ms=vx["step_ms"],
                                speedup=st["step_ms"] / vx["step_ms"], balance_static=bal["static"],
                                balance_vexpert=bal["vexpert"], balance_gain=bal["vexpert"] / bal["static"],
                                loads_static=st["loads"], loads_vexpert=vx["loads"],
                                rel_err_vexpert_vs_static=res.get("rel_err_vexpert_vs_static")))
        return dict(tokens_per_gpu=shape["skew_tokens"], topk=shape["skew_topk"], experts=experts,
                    local_experts=le, cases=results)


def _table_json(table: RoutingTable) -> dict[str, Any]:
    return dict(plan_id=table.plan_id, gpu=table.gpu[0].tolist(), local=table.local[0].tolist(),
                cum_share=table.cum_share[0].tolist(), slot_expert=table.slot_expert[0].tolist())


def _table_of(data: dict[str, Any]) -> RoutingTable:
    """The one-layer :class:`RoutingTable` :func:`_table_json` wrote."""
    return RoutingTable(data["plan_id"], np.asarray(data["gpu"])[None], np.asarray(data["local"])[None],
                        np.asarray(data["cum_share"], dtype=np.float64)[None], np.asarray(data["slot_expert"])[None])


def _nvml_process_memory(pid: int) -> dict[str, Any] | None:
    try:
        import pynvml  # nvidia-ml-py, present on the GPU host

        pynvml.nvmlInit()
        out = {}
        for g in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(g)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                out.setdefault(f"gpu{g}", {})[str(proc.pid)] = proc.usedGpuMemory
        return {"this_pid": pid, "per_gpu_process_bytes": out}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _pipeline_table(rows: list[dict[str, Any]], copy_ms: float | None) -> list[dict[str, Any]]:
    table = []
    for pairs in sorted({r["pairs"] for r in rows}):
        for worker in sorted({r["worker"] for r in rows}):
            pre = [r["layer_ms"] for r in rows if r["pairs"] == pairs and r["worker"] == worker
                   and r["mode"] == "prefilled"]
            pipe = next(r for r in rows if r["pairs"] == pairs and r["worker"] == worker and r["mode"] == "pipeline")
            prefilled = float(np.mean(pre))
            table.append(dict(pairs=pairs, worker=worker, prefilled_layer_ms=prefilled, prefilled_runs_ms=pre,
                              pipeline_layer_ms=pipe["layer_ms"], growth=pipe["layer_ms"] / prefilled - 1,
                              copy_ms=copy_ms, copy_fits=(copy_ms is not None and copy_ms <= prefilled),
                              how=pipe["how"]))
    return table


def _brief(section: str, data: Any) -> Any:
    if section == "pipeline":
        return data["table"]
    if section == "switch":
        return [{k: v for k, v in w.items() if k not in ("iteration_ms", "switches")} for w in data["workers"]]
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes (the CPU twin in CI)")
    parser.add_argument("--out", default="benchmarks/results/gpu_path")
    parser.add_argument("--sections", default="bandwidth,memory,pipeline,switch,skew")
    parser.add_argument("--gpus", type=int, default=0, help="workers (default: every visible GPU; 2 on the CPU)")
    args = parser.parse_args(argv)
    shape = shape_of(args)
    coord = Coordinator(args, shape)
    failures = 0
    coord.start()
    try:
        for section in args.sections.split(","):
            t0 = time.perf_counter()
            try:
                data = getattr(coord, section)()
                data["seconds"] = time.perf_counter() - t0
                coord.save(section, data)
            except Exception:
                failures += 1
                coord.save(section, {"error": traceback.format_exc()})
                if not all(p.is_alive() for p in coord.procs):
                    break  # a worker died: the remaining sections would only wait for it
    finally:
        coord.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
