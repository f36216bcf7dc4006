"""A worker process: one EP rank. It holds its base experts, routes its tokens and runs the EP MoE
forward with the other workers over torch.distributed, computing with the slots the coordinator
filled (layer by layer, under the :mod:`~vexpert_runtime.node.protocol`).

On CPU everything goes over gloo; on GPUs (one worker per GPU, ``cuda:<local rank>``) the rows and
counts are all-to-all'd over NCCL on device tensors and the tiny control collectives (plan agreement,
count windows) over gloo, through one process group with the ``cpu:gloo,cuda:nccl`` backend.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
    MoESpec,
)
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    RoutingTable,
    base_experts,
    ep_moe_layer,
    static_table,
)
from vexpert_runtime.model.grouped_moe import grouped_gemm_runs
from vexpert_runtime.model.moe_math import rms_norm, shared_forward
from vexpert_runtime.model.routing import route
from vexpert_runtime.node.coordinator import die_with_parent
from vexpert_runtime.node.messages import (
    Bye,
    CountsWindow,
    Heartbeat,
    IterationDone,
    SlotsExported,
    WorkerDone,
    WorkerFailed,
    WorkerInputError,
    WorkerReady,
)
from vexpert_runtime.node.protocol import SharedState, WorkerSlots, agree
from vexpert_runtime.node.slots import FULL, row_checksum
from vexpert_runtime.node.step_graph import StepGraph, graphs_enabled
from vexpert_runtime.node.transport import make_transport
from vexpert_runtime.simulation.workload import Workload

COLLECTIVE_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerArgs:
    """Everything a worker process needs (pickled at spawn)."""

    local_rank: int
    gpu: int  # cuda:<gpu> on GPU nodes
    shared_gpu: bool  # other workers use the same GPU: everything over gloo (NCCL refuses)
    rank: int
    world: int
    master_addr: str
    master_port: int
    checkpoint: str
    spec: MoESpec
    dtype: str
    device: str
    slots: int
    k: int
    timeout_s: float
    workload: Workload
    shared: SharedState
    results: Any
    control: Any
    parent_pid: int
    verify: bool
    record: bool
    serve: Any = None  # ServeWorkerArgs: serve requests through the model (vexpert serve) instead of ``workload``
    dispatch: str = "plan"  # replica dispatch of every layer (plan | local | global; the same on every rank)




def _on_device(weights: Any, device: torch.device) -> Any:
    """A copy of a weights dataclass (router, shared expert) with every tensor on ``device``."""
    if weights is None or device.type == "cpu":
        return weights
    moved = {f.name: getattr(weights, f.name) for f in fields(weights)}
    return replace(weights, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a worker process."""
    die_with_parent(args.parent_pid)
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack on stderr
    try:
        _Worker(args).run()
    except VExpertInputError as exc:
        args.results.put(WorkerInputError(args.rank, exc.field, exc.problem, exc.fix))
    except BaseException:
        args.results.put(WorkerFailed(args.rank, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


PROFILE_ENV = "VEXPERT_PROFILE"  # "<first>[-<last>]:<directory>": trace those iterations of every worker


def _profile_request() -> tuple[range, Path]:
    """The iterations to trace (each in its own file) and where (``VEXPERT_PROFILE``); none by default."""
    raw = os.environ.get(PROFILE_ENV, "")
    if not raw:
        return range(0), Path(".")
    at, _, directory = raw.partition(":")
    first, _, last = at.partition("-")
    if not first.isdigit() or (last and not last.isdigit()) or not directory:
        raise VExpertInputError(PROFILE_ENV, f"{raw!r} is not <first>[-<last>]:<directory>",
                                "e.g. VEXPERT_PROFILE=50:/tmp/trace or 400-409:/tmp/trace")
    return range(int(first), int(last or first) + 1), Path(directory)


@dataclass
class _Current:
    """An iteration a worker runs: its plan's table, whether it uses the plan's slots, and the
    generation of the coordinator whose fills it consumes (None: it set its flags itself)."""

    iteration: int
    table: RoutingTable
    use_plan: bool
    publisher: int | None
    end: Any = None  # GPU: CUDA event recorded after the iteration's last layer (None while enqueueing)


class _Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        spec = args.spec
        self.spec = spec
        self.dtype: torch.dtype = getattr(torch, args.dtype)
        self.per_gpu = spec.num_experts // args.world
        self.tables: dict[int, RoutingTable] = {
            0: static_table(spec.num_layers, spec.num_experts, args.world, args.slots)
        }
        self.digests: dict[int, int] = {}
        self.stopping = threading.Event()
        self.inflight: collections.deque[_Current] = collections.deque()  # GPU: iterations not yet finished on the device
        self.rescued = 0  # layers this worker filled itself after its coordinator died
        self.compute_stream: Any = None
        self.device = torch.device("cuda", args.gpu) if args.device == "cuda" else torch.device("cpu")
        self.expert_format = spec.expert_format(self.dtype)  # how slot and resident rows are stored
        num_local = self.per_gpu + args.slots
        # The iteration's statistics, accumulated on the device, reach the host once per iteration
        # (pinned on a GPU: an asynchronous copy after the last layer, read once the step is done).
        # Counts [L, E] and computed rows [L, E/N + S] are column blocks of one tensor: one memset and
        # one copy per iteration.
        pinned = self.device.type == "cuda"
        width = spec.num_experts + num_local
        self.device_stats = torch.zeros(spec.num_layers, width, dtype=torch.int64, device=self.device)
        self.host_stats = torch.zeros(spec.num_layers, width, dtype=torch.int64, pin_memory=pinned)
        self.device_counts, self.device_computed = self.device_stats[:, :spec.num_experts], self.device_stats[:, spec.num_experts:]
        self.host_counts, self.host_computed = self.host_stats[:, :spec.num_experts], self.host_stats[:, spec.num_experts:]
        self.step_graph: StepGraph | None = None
        self.graphed_last = False  # whether the last step was a graph replay
        # The step is one CUDA graph where every collective in it can be captured (NCCL, or none),
        # the experts run as grouped GEMMs (the fp32 loop reads group ends on the host) and nothing
        # reads slots on the host per layer (recording runs).
        self.graphable = (grouped_gemm_runs(self.device, self.dtype) and not args.shared_gpu and not args.record
                          and graphs_enabled())

    def _publisher_gone(self) -> bool:
        """CPU waits for a FULL flag give up (and rescue) once the coordinator that publishes this
        iteration is gone, or when the worker stops."""
        return self.stopping.is_set() or self.slots.publisher_gone()

    def _digest(self, table: RoutingTable) -> int:
        if table.plan_id not in self.digests:
            self.digests[table.plan_id] = table.digest()
        return self.digests[table.plan_id]

    def _table(self, plan_id: int) -> RoutingTable:
        """The routing table of ``plan_id`` (the coordinator queues it before announcing it)."""
        while plan_id not in self.tables:
            msg = self.args.control.get(timeout=COLLECTIVE_TIMEOUT_S)
            if isinstance(msg, RoutingTable):
                self.tables[msg.plan_id] = msg
        for old in [p for p in self.tables if 0 < p < plan_id - 4]:
            del self.tables[old]
            self.digests.pop(old, None)
        return self.tables[plan_id]

    def run(self) -> None:
        import torch.distributed as dist

        args, spec = self.args, self.spec
        device = self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Fixed-shape device tables the layer reads: the static one (degraded iterations) and the
        # current plan's, which a plan switch overwrites in place (same tensors, no new shapes).
        self.device_tables = {
            static: DeviceRoutingTable.allocate(spec.num_layers, spec.num_experts, args.world, args.slots, device)
            for static in (True, False)
        }
        transport = make_transport(args.device, args.gpu)
        buffers = transport.allocate(args.slots, spec.expert_numel, spec.row_dtype(self.dtype), spec.num_layers)
        args.results.put(SlotsExported(args.local_rank, transport.export(buffers)))
        self.reader = reader = CheckpointReader(args.checkpoint, spec)
        layers = range(spec.num_layers)
        if args.serve is None:  # a server's model holds its own router, shared and resident experts
            self.routers = [_on_device(reader.router(i), device) for i in layers]
            self.shared = [_on_device(reader.shared(i, self.dtype), device) for i in layers]
            mine = base_experts(spec.num_experts, args.world, args.rank)
            self.base = [reader.experts(i, mine, self.dtype).to(device) for i in layers]
        dist.init_process_group(
            "gloo" if device.type == "cpu" or args.shared_gpu else "cpu:gloo,cuda:nccl",
            init_method=f"tcp://{args.master_addr}:{args.master_port}",
            rank=args.rank,
            world_size=args.world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.group = dist.group.WORLD if args.world > 1 else None
        if device.type == "cuda":
            # A stream of its own: the watchdog's side stream must not serialise behind it, as it
            # would behind the legacy default stream.
            self.compute_stream = torch.cuda.Stream(device=device)
            torch.cuda.set_stream(self.compute_stream)
        ops = transport.flag_ops(self.stopping.is_set if device.type == "cuda" else self._publisher_gone)
        self.slots = WorkerSlots(args.shared, args.local_rank, buffers, args.timeout_s, ops,
                                 self.compute_stream if device.type == "cuda" else None)
        self.serving = None
        if args.serve is not None:
            from vexpert_runtime.serve.rank import ServingRank  # transformers: only where a worker serves

            rescue = self._rescue if device.type == "cpu" else None
            self.serving = ServingRank(args.serve, args.rank, args.world, self.group, device, self.dtype,
                                       self.device_tables[False], buffers.slots,
                                       wait=lambda layer: self.slots.acquire(layer, rescue),
                                       release=self.slots.release, dispatch=args.dispatch,
                                       graph_stream=self.compute_stream if self.graphable else None)
            if self.serving.num_moe_layers != spec.num_layers:
                raise VExpertInputError("model.checkpoint_path",
                                        f"the model has {self.serving.num_moe_layers} MoE layers, its spec {spec.num_layers}",
                                        "serve the checkpoint the node's config names")
            self.serving.report_load(force=True)
        args.results.put(WorkerReady(args.rank))
        self.slots.wait_for_coordinator(STARTUP_TIMEOUT_S)  # then degraded until one attaches
        watchdog = None
        if device.type == "cuda":
            watchdog = threading.Thread(target=self._watchdog, name="vexpert-watchdog", daemon=True)
            watchdog.start()
        try:
            self._loop()
        finally:
            self.stopping.set()
            if watchdog is not None:
                watchdog.join(timeout=5)
        args.results.put(WorkerDone(args.rank))
        if device.type == "cuda":
            self._await_bye()

    def _await_bye(self) -> None:
        """Keep the IPC-exported slots alive until the coordinator has dropped its mappings."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                if isinstance(self.args.control.get(timeout=max(0.0, deadline - time.monotonic())), Bye):
                    return
            except queue.Empty:
                return

    def _loop(self) -> None:
        args, spec = self.args, self.spec
        k = args.k
        window: list[torch.Tensor] = []
        window_start = 0
        iteration = 0
        profile_at, profile_dir = _profile_request()
        while True:
            if self.serving is not None:
                self._await_work(iteration)
            profiler = self._profiler(profile_dir) if iteration in profile_at else None
            start = time.perf_counter()
            h = bias = None
            if self.serving is None:
                h = self._upload(args.workload.inputs(iteration, args.rank, spec.hidden_size, self.dtype))
                bias = args.workload.logit_bias(iteration)
                if bias is not None:
                    bias = self._upload(bias)
            checksums: list[list[str]] = []
            layer_wait, rescued = self.slots.layer_wait_s, self.rescued
            header, waited = self.slots.begin(iteration)
            announced = self._table(header.plan_id) if header is not None and not header.stop else None
            digest = self._digest(announced) if announced is not None else -1
            stop_flag = self.slots.stop_requested(iteration)
            agreement = agree(header is not None, header, digest, args.world, self.group, stop=stop_flag)
            if agreement.stop:
                if window:
                    self._flush(window, window_start)
                return
            k = agreement.k or k
            use_plan = agreement.use_plan and announced is not None
            table = announced if use_plan and announced is not None else self.tables[0]
            self.current = _Current(iteration, table, use_plan, self.slots.publisher)
            if self.device.type == "cuda":
                self.inflight.append(self.current)
            if self.serving is not None:
                self._serve_step(table)
            else:
                assert h is not None
                h = self._step(h, table, bias, use_plan, iteration, checksums if args.record else None)
            self.host_stats.copy_(self.device_stats, non_blocking=True)
            if self.device.type == "cuda":
                # the host waits for this iteration's end (step time, counts): an event, not the device
                end = torch.cuda.Event()
                end.record(self.compute_stream)
                self.current.end = end  # assigned once recorded: the watchdog reads it
                end.synchronize()
            counts, computed = self.host_counts.clone(), self.host_computed.clone()
            self.slots.finish(iteration)
            step = time.perf_counter() - start
            if profiler is not None:
                profiler.__exit__(None, None, None)
                profiler.export_chrome_trace(str(profile_dir / f"worker{args.rank}-iteration{iteration}.json"))
            loads = torch.zeros(spec.num_layers, args.world, dtype=torch.int64)
            loads[:, args.rank] = computed.sum(1)
            window.append(torch.cat([counts, loads], dim=1))
            args.results.put(
                IterationDone(
                    rank=args.rank,
                    iteration=iteration,
                    step_s=step,
                    wait_s=waited + self.slots.layer_wait_s - layer_wait,
                    degraded_layers=0 if use_plan else spec.num_layers,
                    plan_ids=[table.plan_id] * spec.num_layers,
                    output=h.to(torch.float32).cpu().numpy() if args.verify and h is not None else None,
                    computed=computed.tolist() if args.record else None,
                    slot_checksums=checksums if args.record else None,
                    rescued_layers=self.rescued - rescued,
                    graphed=self.graphed_last,
                )
            )
            iteration += 1
            if len(window) >= k:
                self._flush(window, window_start)
                window, window_start = [], iteration

    def _await_work(self, iteration: int) -> None:
        """A serving worker: take its new requests and wait until some rank has work or the node
        stops (one tiny all-reduce per wait; an idle server runs no iterations, so the coordinator
        streams nothing while nobody sends requests)."""
        import torch.distributed as dist

        assert self.serving is not None
        beat = time.monotonic()
        while True:
            self.serving.take_requests()
            busy = self.serving.has_work() or self.slots.stop_requested(iteration) or self.stopping.is_set()
            flag = torch.tensor([int(busy)])
            if self.group is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if int(flag):
                return
            self.serving.report_load()
            if time.monotonic() - beat > 5.0:
                self.args.results.put(Heartbeat(self.args.rank))
                beat = time.monotonic()
            self.serving.take_requests(timeout_s=0.02)

    def _serve_step(self, table: RoutingTable) -> None:
        """One serving iteration: the scheduler's batch through the model, the EP experts reading
        this iteration's table and slots; its statistics land in the device counters."""
        assert self.serving is not None
        # One device table for every serving iteration, static or plan, loaded in place: a captured
        # decode graph reads whatever it holds.
        device_table = self.device_tables[False]
        if device_table.plan_id != table.plan_id:
            device_table.load(table)
        self.serving.experts.table = device_table
        self.device_stats.zero_()
        self.graphed_last = self.serving.run_iteration(self.device_counts, self.device_computed)

    def _device_table(self, table: RoutingTable) -> DeviceRoutingTable:
        """The device table for ``table`` (the static one, or the plan one with ``table`` loaded in
        place: a captured step reads the new plan without re-capture)."""
        device_table = self.device_tables[table.plan_id == 0]
        if device_table.plan_id != table.plan_id:
            device_table.load(table)
        return device_table

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the worker's device; on a GPU through pinned memory, without waiting."""
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _step(self, h: torch.Tensor, table: RoutingTable, bias: torch.Tensor | None, check: bool,
              iteration: int, checksums: list[list[str]] | None) -> torch.Tensor:
        """Enqueue (GPU) or run (CPU) every MoE layer of one iteration; the new hidden states.

        Plan iterations on a GPU replay the captured step (captured at the first one after two
        warm-up iterations); degraded ones (static table) run eagerly."""
        device_table = self._device_table(table)
        graph = self.step_graph
        self.graphed_last = False
        if self.graphable and table.plan_id != 0 and iteration >= 2 and (graph is None or graph.fits(h, bias)):
            if graph is None:
                try:
                    graph = self.step_graph = StepGraph(
                        lambda x, b: self._layers(x, device_table, b, check=False, checksums=None),
                        self.compute_stream, h, bias)
                except Exception as exc:  # serve eagerly rather than not at all
                    self.graphable = False
                    print(f"vexpert-worker-{self.args.rank}: CUDA graph capture failed, running eagerly: {exc}",
                          file=sys.stderr, flush=True)
            if graph is not None:
                self.graphed_last = True
                return graph.replay(h, bias)
        return self._layers(h, device_table, bias, check, checksums)

    def _layers(self, h: torch.Tensor, device_table: DeviceRoutingTable, bias: torch.Tensor | None, check: bool,
                checksums: list[list[str]] | None) -> torch.Tensor:
        self.device_counts.zero_()
        for layer in range(self.spec.num_layers):
            h = self._layer(h, layer, device_table, bias, check, checksums)
        return h

    def _layer(
        self,
        h: torch.Tensor,
        layer: int,
        device_table: DeviceRoutingTable,
        bias: torch.Tensor | None,
        check: bool,
        checksums: list[list[str]] | None,
    ) -> torch.Tensor:
        args, spec = self.args, self.spec
        normed = rms_norm(h)
        ids, weights = route(normed, self.routers[layer], spec, None if bias is None else bias[layer])
        flat = ids.reshape(-1)
        self.device_counts[layer].scatter_add_(0, flat, torch.ones_like(flat))
        base, slots = self.base[layer], self.slots

        def slot_wait() -> None:
            slots.acquire(layer, self._rescue if self.device.type == "cpu" else None)
            if check and self.device.type == "cpu":  # on a GPU the wait is only enqueued
                slots.check_tags(self.current.iteration, self.current.table, layer, args.rank)
            if checksums is not None:  # what this layer computes with, before its slots are released
                checksums.append(self._checksums())

        y, stats = ep_moe_layer(
            normed,
            ids,
            weights,
            device_table,
            layer,
            # Grouped GEMMs on CUDA (bf16/fp16), the per-expert loop elsewhere; block-FP8 rows are
            # dequantised into the GEMM.
            ExpertStacks(base, slots.buffers.slots, spec.intermediate_size, format=self.expert_format),
            shared_forward(normed, self.shared[layer]),
            args.rank,
            args.world,
            self.group,
            slot_wait=slot_wait,
            after_compute=lambda: slots.release(layer),
            dispatch=args.dispatch,  # type: ignore[arg-type]  # validated by the setup
        )
        self.device_computed[layer] = stats.computed
        return h + y

    def _profiler(self, directory: Path) -> Any:
        """A torch profiler (CPU and CUDA activity) around one iteration, started."""
        from torch.profiler import ProfilerActivity, profile

        directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        profiler = profile(activities=activities)
        profiler.__enter__()
        return profiler

    # -- rescue: the coordinator that published an iteration died before filling all its layers --

    def _rescue(self, layer: int, current: _Current | None = None, stream: Any = None,
                staging: torch.Tensor | None = None) -> None:
        """Fill this worker's slots of ``layer`` for ``current`` (default: the iteration being run)
        from the checkpoint and set its FULL flag (on ``stream`` on a GPU, through the pinned
        ``staging`` row). Slow and exact: only after a coordinator died mid-iteration."""
        current = current or self.current
        slots = self.slots
        if current.use_plan:
            for slot, expert in enumerate(current.table.slot_expert[layer, self.args.rank].tolist()):
                if expert >= 0:
                    row = self.reader.experts(layer, [expert], self.dtype)[0]
                    if staging is None:
                        slots.slot(slot).copy_(row)
                    else:
                        stream.synchronize()  # the staging row is free again
                        staging.copy_(row)
                        slots.slot(slot).copy_(staging, non_blocking=True)
                    slots.set_tag(slot, layer, expert)
        slots.ops.write(stream, slots.buffers.flags, layer, FULL, 1)
        self.rescued += 1

    def _watchdog(self) -> None:
        """GPU workers: a stalled compute stream waits for a FULL flag whose coordinator is gone —
        rescue that layer on a side stream (the layer before it is done, so no slot is in use).

        Nothing here may allocate host or device memory while the compute stream is stalled (a
        pinned allocation can wait for the device): the host buffers are made up front."""
        side = torch.cuda.Stream(device=self.device)
        buffers = self.slots.buffers
        progress = torch.empty(buffers.progress.shape, dtype=buffers.progress.dtype, pin_memory=True)
        flags = torch.empty(buffers.flags.shape, dtype=buffers.flags.dtype, pin_memory=True)
        staging = torch.empty(buffers.slots.shape[1], dtype=buffers.slots.dtype, pin_memory=True)

        def read(tensor: torch.Tensor) -> torch.Tensor:
            host = progress if tensor is buffers.progress else flags
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
            side.synchronize()
            return host

        while not self.stopping.wait(0.02):
            while self.inflight and self.inflight[0].end is not None and self.inflight[0].end.query():
                self.inflight.popleft()
            if not self.inflight:
                continue
            oldest = self.inflight[0]
            if oldest.publisher is None or self.slots.shared.publisher_alive(oldest.publisher):
                continue
            layer = self.slots.stalled_layer(read)
            if layer is not None:
                # on the side stream: this thread's default (legacy) stream would wait for the
                # stalled compute stream and never run the rescue
                with torch.cuda.device(self.device), torch.cuda.stream(side):
                    self._rescue(layer, oldest, side, staging)

    def _checksums(self) -> list[str]:
        return [row_checksum(self.slots.slot(s)) for s in range(self.args.slots)]

    def _flush(self, window: list[torch.Tensor], start: int) -> None:
        """All-reduce the window's [n, L, E + N] counts/loads; local rank 0 hands them to its coordinator."""
        import torch.distributed as dist

        data = torch.stack(window)
        if self.group is not None:
            dist.all_reduce(data, group=self.group)
        if self.args.local_rank == 0:
            self.args.results.put(CountsWindow(start, data.numpy()))

