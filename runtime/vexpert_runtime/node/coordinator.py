"""The coordinator process: the node's L2 expert pool and its slot-fill loop, in a process of its own.

``vexpert node`` (:class:`~vexpert_runtime.node.NodeRuntime`) is the supervisor: it owns the shared
protocol state (:class:`~vexpert_runtime.node.protocol.SharedState`), the workers, the balance state
(the plans), the metrics and the verification, and runs this process as a child through its
:class:`~vexpert_runtime.node.coordinator_handle.CoordinatorHandle`, which restarts it with backoff
when it dies. The workers do not depend on it: while it is down they run every iteration on their base
experts (``vexpert_degraded`` 1), and they fill the layers a dead coordinator left half done from the
checkpoint themselves, so outputs stay equal to the reference.

A coordinator attaches the same way at start and after a restart:

1. it re-opens every worker's slot buffers from the handles the workers exported (CPU: shared-memory
   tensors; GPU: CUDA IPC handles, opened only here, never in the supervisor);
2. it builds its pool from the checkpoint (the experts the supervisor's plans pool);
3. it attaches (a new generation, :meth:`SharedState.attach_coordinator`) and starts its fill loop at
   the first iteration no worker has seen (:meth:`SharedState.resume_iteration`), serving at each
   iteration boundary the newest plan of the supervisor's schedule in effect
   (:mod:`~vexpert_runtime.node.plans`).

Messages (:mod:`~vexpert_runtime.node.messages`) go over one pipe to the supervisor, a new pipe per
coordinator, so nothing a killed one half-wrote can wedge the next.

If its fill loop fails, this process exits (after telling the supervisor why): a fresh process and
the workers' rescue recover cleanly, where a loop restarted in place would race the workers' rescue
for the iteration it left half filled.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vexpert_runtime.gc_heap import freeze_heap
from vexpert_runtime.model.checkpoint import CheckpointReader, MoESpec
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.messages import (
    Attached,
    CoordinatorFailed,
    Exit,
    FillLoopDied,
    FillTotals,
    NewPlan,
    PlanSwitched,
    SetInterval,
    ToCoordinator,
)
from vexpert_runtime.node.plans import NodePlan, ScheduledPlan, add_to_schedule, in_effect
from vexpert_runtime.node.processes import ignore_stop_signals
from vexpert_runtime.node.protocol import Assignment, FillLoop, FillStats, SharedState, SlotFiller
from vexpert_runtime.node.slots import SlotBuffers
from vexpert_runtime.node.transport import make_transport

STATS_INTERVAL_S = 0.1


def die_with_parent(parent_pid: int) -> None:
    """Make the kernel kill this process when its parent (the node) dies (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


@dataclass
class CoordinatorArgs:
    """Everything a coordinator process needs (pickled at spawn)."""

    checkpoint: str
    spec: MoESpec
    dtype: str
    device: str
    ranks: list[int]
    shared: SharedState
    handles: list[Any]  # per local worker, what its transport exported
    conn: Any  # this coordinator's end of its pipe to the node
    parent_pid: int
    plans: list[ScheduledPlan]  # the supervisor's schedule (the newest plan in effect serves; never empty)
    k: int = 1
    filler: Callable[..., SlotFiller] = SlotFiller  # builds the fill loop's filler (picklable)


def coordinator_main(args: CoordinatorArgs) -> None:
    """Entry point of a coordinator process."""
    die_with_parent(args.parent_pid)
    ignore_stop_signals()  # the node stops its children (see stop_signals_held)
    torch.set_num_threads(1)
    try:
        Coordinator(args).run()
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            args.conn.send(CoordinatorFailed(traceback.format_exc()))
        raise SystemExit(1) from None


class Coordinator:
    def __init__(self, args: CoordinatorArgs) -> None:
        self.args = args
        self.spec = args.spec
        # Pool rows in the expert storage format (uint8 for block FP8), not the compute dtype.
        self.compute_dtype: torch.dtype = getattr(torch, args.dtype)
        self.dtype: torch.dtype = args.spec.row_dtype(self.compute_dtype)
        self.reader = CheckpointReader(Path(args.checkpoint), args.spec)
        self.transport = make_transport(args.device)
        self.abort = threading.Event()
        self.lock = threading.Lock()
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # fill thread → pipe
        self.k = args.k
        self.last_plan = -1
        self.loop: FillLoop | None = None
        self.pool: ExpertPool | None = None
        self.filler: SlotFiller | None = None
        self.stats = FillStats()
        self.buffers: list[SlotBuffers] = []
        self.schedule: list[ScheduledPlan] = []  # the plans to serve (under ``lock``)
        self.assignments: dict[int, Assignment] = {}  # plan id → the plan with its pool (under ``lock``)

    # -- pool ---------------------------------------------------------------------------------

    def _load(self, layer: int, experts: list[int]) -> torch.Tensor:
        return self.reader.experts(layer, experts, self.compute_dtype)

    def _read_into(self, layer: int, experts: list[int], out: torch.Tensor) -> None:
        """Read rows straight into the pool buffer ``out`` (no temporary copy of the layer)."""
        self.reader.experts(layer, experts, self.compute_dtype, out=out)

    def _alloc(self, rows: int, numel: int) -> torch.Tensor:
        return self.transport.host_buffer(rows, numel, self.dtype)

    def _assignment(self, plan: NodePlan) -> Assignment:
        """The plan with a pool holding its experts (unchanged layers share the current buffers)."""
        pool = self.pool
        assert pool is not None
        if plan.pooled.shape != pool.experts.shape or not torch.equal(plan.pooled, pool.experts):
            pool = pool.refreshed(plan.pooled, self._load, self._alloc, self._read_into)
            self.pool = pool
        return Assignment(plan.table, pool)

    def _schedule(self, scheduled: ScheduledPlan) -> None:
        """Add a plan to the schedule, its pool built here (main thread), not in the fill loop."""
        assignment = self._assignment(scheduled.plan)
        with self.lock:
            self.schedule = add_to_schedule(self.schedule, scheduled)
            live = {s.plan.plan_id for s in self.schedule}
            self.assignments = {i: a for i, a in self.assignments.items() if i in live}
            self.assignments[scheduled.plan.plan_id] = assignment

    # -- fill loop callbacks (fill thread) ----------------------------------------------------

    def _take_plan(self, iteration: int) -> Assignment:
        with self.lock:
            assignment = self.assignments[in_effect(self.schedule, iteration).plan.plan_id]
        if assignment.table.plan_id != self.last_plan:
            self.last_plan = assignment.table.plan_id
            self.outbox.put(PlanSwitched(iteration, assignment.table.plan_id))
        return assignment

    def _control(self, iteration: int) -> tuple[int, bool]:
        stop_at = int(self.args.shared.stop_at[0])
        return self.k, 0 <= stop_at <= iteration

    def _start_loop(self) -> int:
        shared = self.args.shared
        generation = shared.attach_coordinator()
        iteration = shared.resume_iteration()
        self.filler = self.args.filler(
            shared, self.buffers, self.args.ranks, self.transport, self.spec.num_layers, self.abort, generation,
            stats=self.stats, resume_iteration=iteration,
        )
        self.loop = FillLoop(self.filler, self._take_plan, self._control, iteration)
        self.loop.start()
        return iteration

    # -- main -----------------------------------------------------------------------------------

    def run(self) -> None:
        args = self.args
        self.buffers = buffers = [self.transport.open(handle) for handle in args.handles]
        self.pool = ExpertPool.build(args.plans[0].plan.pooled, self.spec.num_experts, self.spec.expert_numel,
                                     self._load, self._alloc, self._read_into)
        for scheduled in args.plans:
            self._schedule(scheduled)
        freeze_heap()  # the pool is built; before the fill loop runs (gc_heap)
        iteration = self._start_loop()
        args.conn.send(Attached(os.getpid(), iteration))
        sent = (-1, -1.0)
        next_stats = 0.0
        try:
            while True:
                if args.conn.poll(0.02):
                    try:
                        msg = args.conn.recv()
                    except EOFError:
                        return
                    if isinstance(msg, Exit):
                        return
                    self._handle(msg)
                if self.loop is not None and self.loop.error is not None:
                    # Its iteration is half filled: exit, so the node marks this coordinator gone and
                    # the workers rescue what it left (a restarted loop here would race them).
                    self.outbox.put(FillLoopDied(repr(self.loop.error)))
                    raise SystemExit(1)
                while True:
                    try:
                        args.conn.send(self.outbox.get_nowait())
                    except queue.Empty:
                        break
                now = time.monotonic()
                stats = (self.stats.bytes_streamed, self.stats.copy_s)
                if stats != sent and now >= next_stats:
                    args.conn.send(FillTotals(*stats))
                    sent, next_stats = stats, now + STATS_INTERVAL_S
        finally:
            self.abort.set()
            if self.loop is not None:
                self.loop.join(timeout=5)
            try:
                while True:
                    args.conn.send(self.outbox.get_nowait())
            except (queue.Empty, OSError):
                pass
            with contextlib.suppress(OSError):
                args.conn.send(FillTotals(self.stats.bytes_streamed, self.stats.copy_s))
            # Let enqueued copies land before the IPC mappings go (the workers free their buffers only
            # after this process exited). Bounded: a fill enqueued for an iteration the workers
            # stopped before waits for a FREE flag that will never be set.
            for opened in self.buffers:
                self.transport.drain(opened, timeout_s=2.0)
                if self.filler is not None:
                    self.filler.buffers = []
                self.buffers = []
                buffers.clear()

    def _handle(self, msg: ToCoordinator) -> None:
        if isinstance(msg, NewPlan):
            self._schedule(msg.scheduled)
        elif isinstance(msg, SetInterval):
            self.k = msg.k

