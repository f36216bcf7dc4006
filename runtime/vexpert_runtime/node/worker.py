"""A worker process: one EP rank. It runs the slot protocol with the coordinator (layer by layer,
under the :mod:`~vexpert_runtime.node.protocol`), agrees on each iteration's plan with the other
workers, reports the expert counts and rescues slots whose coordinator died; the model work of each
iteration is its :class:`~vexpert_runtime.node.runners.ModelRunner`'s — the synthetic decode of
``vexpert node`` or a serving rank of ``vexpert serve`` — which runs the EP MoE forward with the
other workers over torch.distributed, computing with the slots the coordinator filled.

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
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.gc_heap import GcClock, freeze_heap
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
)
from vexpert_runtime.model.ep_moe import RoutingTable, static_table
from vexpert_runtime.model.grouped_moe import grouped_gemm_runs
from vexpert_runtime.node.coordinator import die_with_parent
from vexpert_runtime.node.messages import (
    Bye,
    CountsWindow,
    Heartbeat,
    IterationDone,
    PlanTable,
    SlotsExported,
    ToWorker,
    WorkerDone,
    WorkerFailed,
    WorkerInputError,
    WorkerReady,
)
from vexpert_runtime.node.processes import ignore_stop_signals
from vexpert_runtime.node.protocol import WorkerSlots, agree
from vexpert_runtime.node.runners import (
    DeviceTables,
    IterationOutput,
    IterationStats,
    ModelRunner,
    RunnerContext,
    choose_runner,
)
from vexpert_runtime.node.slot_probe import ProbedSlots, SlotProbe
from vexpert_runtime.node.slots import FULL
from vexpert_runtime.node.step_graph import graphs_enabled, step_stream
from vexpert_runtime.node.transport import make_transport
from vexpert_runtime.node.worker_args import WorkerArgs

COLLECTIVE_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------------------------


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a worker process."""
    die_with_parent(args.parent_pid)
    ignore_stop_signals()  # the node stops its children (see stop_signals_held)
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


def window_row(stats: np.ndarray, num_experts: int, world: int, rank: int) -> np.ndarray:
    """One iteration's row of a count window from this rank's statistics.

    Args: stats [L, E + E/N + S] int64 (:attr:`~.runners.IterationStats.all`: tokens routed to each
    expert, then rows computed per local expert and slot); the world size N and this rank.
    Returns [L, E + N] int64: the counts, then rows computed per rank — this rank's column only, the
    window's all-reduce adds the others'. (numpy: it runs every iteration, and the same in torch ops
    took 2.4x as long at DeepSeek-V3's size, ``benchmarks/worker_host_cost.py --baseline``.)
    """
    row = np.zeros((stats.shape[0], num_experts + world), dtype=np.int64)
    row[:, :num_experts] = stats[:, :num_experts]
    row[:, num_experts + rank] = stats[:, num_experts:].sum(1)
    return row


PROFILE_ENV = "VEXPERT_PROFILE"  # "<first>[-<last>]:<directory>": trace those iterations of every worker


def _profile_request() -> tuple[range, Path]:
    """The iterations to trace (one file over the range) and where (``VEXPERT_PROFILE``); none by default."""
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


@dataclass(frozen=True)
class _Launched:
    """An iteration whose work is enqueued (on a GPU) or done (on CPU), not reported yet."""

    iteration: int
    start: float  # perf_counter when it began
    waited: float  # seconds its start waited for the coordinator
    layer_wait: float  # the worker's slot-wait total before it
    rescued: int  # the worker's rescued-layer count before it
    table: RoutingTable
    use_plan: bool
    output: IterationOutput
    host_stats: IterationStats  # where its statistics land
    end: Any  # GPU: the CUDA event after its last kernel (None on CPU)


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
        num_local = self.per_gpu + args.slots
        # The iteration's statistics, accumulated on the device, reach the host once per iteration
        # (pinned on a GPU: an asynchronous copy after the last layer, read once the step is done).
        pinned = self.device.type == "cuda"
        self.device_stats = IterationStats.zeros(spec.num_layers, spec.num_experts, num_local, self.device)
        self.host_stats = [IterationStats.zeros(spec.num_layers, spec.num_experts, num_local, pin_memory=pinned)
                           for _ in range(2)]  # two: an overlapped iteration's copy lands beside the last one's
        # The step is one CUDA graph where every collective in it can be captured (NCCL, or none),
        # the experts run as grouped GEMMs (the fp32 loop reads group ends on the host) and nothing
        # reads slots on the host per layer (a slot probe). CUDA only: a CPU step is eager.
        self.graphable = (self.device.type == "cuda" and grouped_gemm_runs(self.device, self.dtype)
                          and not args.shared_gpu and args.probe is None
                          and graphs_enabled(enforce_eager=args.serve is not None and args.serve.enforce_eager))
        self.probe: SlotProbe | None = args.probe() if args.probe is not None else None
        self.gc_clock = GcClock().install()
        self._gc_reported = (0.0, 0.0, 0.0)  # the clock's totals at the last report
        self._gc_frozen = 0  # objects frozen out of the collector's reach (gc_heap.freeze_heap)

    def _publisher_gone(self) -> bool:
        """CPU waits for a FULL flag give up (and rescue) once the coordinator that publishes this
        iteration is gone, or when the worker stops."""
        return self.stopping.is_set() or self.slots.publisher_gone()

    def _digest(self, table: RoutingTable) -> int:
        if table.plan_id not in self.digests:
            self.digests[table.plan_id] = table.digest()
        return self.digests[table.plan_id]

    def _table(self, plan_id: int) -> RoutingTable:
        """The routing table of ``plan_id`` (the supervisor queues it before the coordinator
        announces the plan)."""
        while plan_id not in self.tables:
            msg: ToWorker = self.args.control.get(timeout=COLLECTIVE_TIMEOUT_S)
            if isinstance(msg, PlanTable):
                self.tables[msg.table.plan_id] = msg.table
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
        tables = DeviceTables.allocate(spec, args.world, args.slots, device)
        transport = make_transport(args.device, args.gpu)
        buffers = transport.allocate(args.slots, spec.expert_numel, spec.row_dtype(self.dtype), spec.num_layers)
        args.results.put(SlotsExported(args.local_rank, transport.export(buffers)))
        self.reader = CheckpointReader(args.checkpoint, spec)  # rescues read experts from it
        start_runner = choose_runner(args, self.reader, device, self.dtype)  # the one choice of the mode
        dist.init_process_group(
            "gloo" if device.type == "cpu" or args.shared_gpu else "cpu:gloo,cuda:nccl",
            init_method=args.rendezvous,
            rank=args.rank,
            world_size=args.world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.group = dist.group.WORLD if args.world > 1 else None
        if device.type == "cuda":
            # A stream of its own: the watchdog's side stream must not serialise behind it, as it
            # would behind the legacy default stream; above the side streams (step_graph.step_stream).
            self.compute_stream = step_stream(device)
            torch.cuda.set_stream(self.compute_stream)
        ops = transport.flag_ops(self.stopping.is_set if device.type == "cuda" else self._publisher_gone)
        stream = self.compute_stream if device.type == "cuda" else None
        self.slots = (WorkerSlots(args.shared, args.local_rank, buffers, args.timeout_s, ops, stream)
                      if self.probe is None
                      else ProbedSlots(self.probe, args.shared, args.local_rank, buffers, args.timeout_s, ops, stream))
        self.runner: ModelRunner = start_runner(RunnerContext(
            spec=spec, rank=args.rank, world=args.world, group=self.group, device=device, dtype=self.dtype,
            slots=self.slots, num_slots=args.slots,
            rescue=self._rescue if device.type == "cpu" else None,  # on a GPU the watchdog rescues
            tables=tables, stats=self.device_stats,
            graph_stream=self.compute_stream if self.graphable else None,
            dispatch=args.dispatch,
            stop_requested=lambda iteration: self.slots.stop_requested(iteration) or self.stopping.is_set(),
            heartbeat=lambda: args.results.put(Heartbeat(args.rank)),
        ))
        self._gc_frozen = freeze_heap()  # model, tokenizer, checkpoint index, torch itself (gc_heap)
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
                msg: ToWorker = self.args.control.get(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(msg, Bye):
                    return
            except queue.Empty:
                return

    def _loop(self) -> None:
        """Iterations until the node stops. A runner that ``overlaps_iterations`` (serving with CUDA
        graphs) has iteration i+1 enqueued before the worker reports iteration i — its statistics,
        its end for the coordinator, its ``IterationDone`` — so the host's work of both overlaps the
        device's (except after a claimed iteration, see below); other runners report each iteration
        before the next starts."""
        args = self.args
        k = args.k
        self._window: list[np.ndarray] = []
        self._window_start = 0
        self._last_report = time.perf_counter()
        iteration = 0
        profile_at, profile_dir = _profile_request()
        runner = self.runner
        launched: _Launched | None = None
        profiler = None
        while True:
            # Idle next: report what ran — alone only, since a report may all-reduce a counts window and
            # every rank of a group must reach its collectives in the same order (a group's ranks report
            # each iteration in the next one, or when they all stop).
            if launched is not None and self.group is None and not runner.has_work():
                self._report(launched, k)
                launched = None
            runner.await_work(iteration)
            if profile_at and iteration == profile_at.start:  # one trace over the whole range
                profiler = self._profiler(profile_dir)
            start = time.perf_counter()
            runner.prepare(iteration)
            layer_wait, rescued = self.slots.layer_wait_s, self.rescued
            header, waited = self.slots.begin(iteration)
            announced = self._table(header.plan_id) if header is not None and not header.stop else None
            digest = self._digest(announced) if announced is not None else -1
            stop_flag = self.slots.stop_requested(iteration)
            agreement = agree(header is not None, header, digest, args.world, self.group, stop=stop_flag)
            if agreement.stop:
                if launched is not None:
                    self._report(launched, k)
                if self._window:
                    self._flush(self._window, self._window_start)
                return
            k = agreement.k or k
            use_plan = agreement.use_plan and announced is not None
            table = announced if use_plan and announced is not None else self.tables[0]
            self.current = _Current(iteration, table, use_plan, self.slots.publisher)
            if self.device.type == "cuda":
                self.inflight.append(self.current)
            output = runner.run(iteration, table, use_plan)
            if iteration == 0 and self.device.type == "cuda":  # its compiled pieces and CUDA graphs too (a GPU
                self._gc_frozen = freeze_heap()  # iteration 0 captures them; elsewhere it adds nothing worth a pause)
            host = self.host_stats[iteration % 2]  # the other one may still wait for iteration − 1's report
            host.all.copy_(self.device_stats.all, non_blocking=True)
            if self.device.type == "cuda":
                end = torch.cuda.Event()
                end.record(self.compute_stream)
                self.current.end = end  # assigned once recorded: the watchdog reads it
            this = _Launched(iteration, start, waited, layer_wait, rescued, table, use_plan, output, host,
                             self.current.end)
            if launched is not None:
                self._report(launched, k)
            launched = this
            # An iteration some rank claimed (the agreement says so on every rank, so their reports'
            # collectives stay in step) is reported before the next one starts: the coordinator
            # publishes the iteration after a claimed one only once that is finished
            # (protocol.SlotFiller.publish), and an overlapped report would come one iteration late —
            # every later iteration would miss its publish and be claimed too.
            if not runner.overlaps_iterations or not agreement.all_published:
                self._report(this, k)
                launched = None
            if profiler is not None and iteration == profile_at.stop - 1:
                if launched is not None:
                    self._report(launched, k)
                    launched = None
                profiler.__exit__(None, None, None)
                name = f"worker{args.rank}-iterations{profile_at.start}-{iteration}.json"
                profiler.export_chrome_trace(str(profile_dir / name))
                profiler = None
            iteration += 1

    def _report(self, done: _Launched, k: int) -> None:
        """Wait for a launched iteration's end; send its statistics and tell the coordinator."""
        args, spec = self.args, self.spec
        if done.end is not None:  # the host waits for the iteration's end: an event, not the device
            done.end.synchronize()
        self._window.append(window_row(done.host_stats.all.numpy(), spec.num_experts, args.world, args.rank))
        details = self.probe.iteration_done(done.host_stats.computed.clone()) if self.probe is not None else None
        self.slots.finish(done.iteration)
        now = time.perf_counter()
        step, self._last_report = now - max(done.start, self._last_report), now  # its share of the wall time
        totals, before = self.gc_clock.totals(), self._gc_reported
        gc_s = (totals[0] - before[0], totals[1] - before[1], totals[2] - before[2])
        self._gc_reported = totals
        output = done.output
        args.results.put(
            IterationDone(
                rank=args.rank,
                iteration=done.iteration,
                step_s=step,
                wait_s=done.waited + self.slots.layer_wait_s - done.layer_wait,
                degraded_layers=0 if done.use_plan else spec.num_layers,
                plan_ids=[done.table.plan_id] * spec.num_layers,
                output=output.hidden.to(torch.float32).cpu().numpy()
                if args.verify and output.hidden is not None else None,
                details=details,
                rescued_layers=self.rescued - done.rescued,
                graphed=output.graphed,
                gc_s=gc_s,
                gc_frozen=self._gc_frozen,
            )
        )
        if len(self._window) >= k:
            self._flush(self._window, self._window_start)
            self._window, self._window_start = [], done.iteration + 1

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

    def _flush(self, window: list[np.ndarray], start: int) -> None:
        """All-reduce the window's counts and loads [n, L, E + N] (one collective); local rank 0
        hands them to the supervisor."""
        import torch.distributed as dist

        data = torch.from_numpy(np.stack(window))
        if self.group is not None:
            dist.all_reduce(data, group=self.group)
        if self.args.local_rank == 0:
            experts = self.spec.num_experts
            self.args.results.put(CountsWindow(start, data[..., :experts].numpy(), data[..., experts:].numpy()))

