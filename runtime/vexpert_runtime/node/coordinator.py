"""The coordinator process: the node's L2 expert pool and its slot-fill loop, in a process of its own.

``vexpert node`` (:class:`~vexpert_runtime.node.NodeRuntime`) is the supervisor: it owns the shared
protocol state (:class:`~vexpert_runtime.node.protocol.SharedState`), the workers, the allocator, the
metrics and the verification, and runs this process as a child that it restarts with backoff when it
dies. The workers do not depend on it: while it is down they run every group on their base experts
(``vexpert_degraded`` 1), with outputs equal to the reference.

A coordinator attaches the same way at start and after a restart:

1. it re-opens every worker's slot buffers from the handles the workers exported (CPU: shared-memory
   tensors; GPU: CUDA IPC handles, opened only here, never in the supervisor);
2. it builds its pool from the checkpoint (the experts the supervisor's latest plan pools);
3. it reads where the workers are (:meth:`SharedState.resume_seq`), marks itself attached and starts
   its fill loop there: filling resumes mid-iteration if need be, with the supervisor's latest plan.

Messages (:mod:`~vexpert_runtime.node.messages`) go over one pipe to the supervisor, a new pipe per
coordinator, so nothing a killed one half-wrote can wedge the next.

If only the fill *thread* dies, this process restarts it itself with backoff at the sequence the
workers reached.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vexpert_runtime.model.checkpoint import CheckpointReader, MoESpec
from vexpert_runtime.model.ep_moe import RoutingTable
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.messages import (
    Attached,
    CoordinatorFailed,
    Exit,
    FillFailed,
    FillLoopDied,
    FillLoopRestarted,
    FillTotals,
    NewPlan,
    PlanSwitched,
    SetInterval,
)
from vexpert_runtime.node.protocol import Assignment, FillLoop, FillStats, SharedState, SlotFiller
from vexpert_runtime.node.transport import make_transport

STATS_INTERVAL_S = 0.1
RECENT_PLANS = 4  # plans kept to finish an iteration under its own plan after a fill-loop restart


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
    group_size: int
    shared: SharedState
    handles: list[Any]  # per local worker, what its transport exported
    conn: Any  # this coordinator's end of its pipe to the node
    parent_pid: int
    plan: tuple[RoutingTable, torch.Tensor]  # the latest plan and the experts [L, Np] its pool holds
    scripted: dict[int, tuple[RoutingTable, torch.Tensor]] = field(default_factory=dict)  # iteration → plan (tests)
    k: int = 1
    filler: Callable[..., SlotFiller] = SlotFiller  # builds the fill loop's filler (picklable)
    restart_delay_s: float = 1.0


def coordinator_main(args: CoordinatorArgs) -> None:
    """Entry point of a coordinator process."""
    die_with_parent(args.parent_pid)
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
        self.dtype: torch.dtype = args.spec.row_dtype(getattr(torch, args.dtype))
        self.reader = CheckpointReader(Path(args.checkpoint), args.spec)
        self.transport = make_transport(args.device)
        self.abort = threading.Event()
        self.lock = threading.Lock()
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # fill thread → pipe
        self.k = args.k
        self.last_plan = -1
        self.recent: dict[int, Assignment] = {}  # plans the fill loop took, newest last (fill thread)
        self.loop: FillLoop | None = None
        self.restart_at: float | None = None
        self.restarts = 0
        self.pool: ExpertPool | None = None
        self.filler: SlotFiller | None = None
        self.stats = FillStats()  # running totals across fill-loop restarts
        self.buffers: list[torch.Tensor] = []

    # -- pool ---------------------------------------------------------------------------------

    def _load(self, layer: int, experts: list[int]) -> torch.Tensor:
        return self.reader.experts(layer, experts, self.dtype)

    def _alloc(self, rows: int, numel: int) -> torch.Tensor:
        return self.transport.host_buffer(rows, numel, self.dtype)

    def _assignment(self, table: RoutingTable, experts: torch.Tensor) -> Assignment:
        """The plan with a pool holding ``experts`` (unchanged layers share the current buffers)."""
        pool = self.pool
        assert pool is not None
        if experts.shape != pool.experts.shape or not torch.equal(experts, pool.experts):
            pool = pool.refreshed(experts, self._load, self._alloc)
            self.pool = pool
        return Assignment(table, pool)

    # -- fill loop callbacks (fill thread) ----------------------------------------------------

    def _take_plan(self, iteration: int, prefer: int | None = None) -> Assignment:
        with self.lock:
            assignment = self.current
            due = [i for i in self.scripted if i <= iteration]
            if due:
                assignment = self.scripted[max(due)]
            if prefer is not None and prefer in self.recent:  # finish an iteration under its plan
                assignment = self.recent[prefer]
        self.recent[assignment.table.plan_id] = assignment
        while len(self.recent) > RECENT_PLANS:
            self.recent.pop(next(iter(self.recent)))
        if assignment.table.plan_id != self.last_plan:
            self.last_plan = assignment.table.plan_id
            self.outbox.put(PlanSwitched(iteration, assignment.table.plan_id))
        return assignment

    def _control(self, iteration: int) -> tuple[int, bool]:
        stop_at = int(self.args.shared.stop_at[0])
        return self.k, 0 <= stop_at <= iteration

    def _on_failure(self, seq: int, exc: BaseException) -> None:
        self.outbox.put(FillFailed(seq, str(exc)))

    def _start_loop(self) -> int:
        seq = self.args.shared.resume_seq()
        self.filler = self.args.filler(
            self.args.shared, self.buffers, self.args.ranks, self.transport, self.spec.num_layers, self.abort, resume_seq=seq,
            stats=self.stats,
        )
        iteration, layer = divmod(seq, self.spec.num_layers)
        self.loop = FillLoop(
            self.filler, self._take_plan, self._control, iteration, self._on_failure, layer,
            resume_plan=self.args.shared.announced_plan(seq - 1) if layer else None,
        )
        self.loop.start()
        return seq

    # -- main -----------------------------------------------------------------------------------

    def run(self) -> None:
        args = self.args
        self.buffers = buffers = [self.transport.open(handle) for handle in args.handles]
        table, experts = args.plan
        self.pool = ExpertPool.build(experts, self.spec.num_experts, self.spec.expert_numel, self._load, self._alloc)
        self.current = Assignment(table, self.pool)
        self.scripted = {i: self._assignment(t, e) for i, (t, e) in args.scripted.items()}
        args.shared.set_coordinator(True)
        seq = self._start_loop()
        args.conn.send(Attached(os.getpid(), seq))
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
                self._watch_loop()
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
            if args.device == "cuda":  # drop the IPC mappings before the workers may free their slots
                torch.cuda.synchronize()
                if self.filler is not None:
                    self.filler.buffers = []
                self.buffers = []
                buffers.clear()

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, NewPlan):
            table, experts = pickle.loads(msg.payload)  # from the node (trusted), pickled by value
            assignment = self._assignment(table, experts)
            with self.lock:
                self.current = assignment
        elif isinstance(msg, SetInterval):
            self.k = msg.k

    def _watch_loop(self) -> None:
        """The fill thread died: workers serve on their base experts until it is restarted (backoff)
        at the sequence they reached."""
        loop, now = self.loop, time.monotonic()
        if loop is not None and loop.error is not None and self.restart_at is None:
            delay = min(30.0, self.args.restart_delay_s * 2 ** min(self.restarts, 5))
            self.outbox.put(FillLoopDied(repr(loop.error), delay))
            self.restart_at = now + delay
        if self.restart_at is not None and now >= self.restart_at and not self.abort.is_set():
            self.restart_at = None
            self.restarts += 1
            seq = self._start_loop()
            self.outbox.put(FillLoopRestarted(seq // self.spec.num_layers))
