"""The supervisor's handle on its coordinator process (:mod:`~vexpert_runtime.node.coordinator`):
spawn it on a pipe of its own once every worker exported its slots, read what it reports, restart it
with backoff when it dies, send it plans and the allocation interval, and stop it.

While no coordinator is attached the workers serve on their base experts (``vexpert_degraded`` 1;
the shared state tells them none is attached, so they do not wait); a new one re-opens the slots,
builds its pool and resumes at the iteration the workers reached, with the handle's schedule.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from vexpert_runtime.node.coordinator import CoordinatorArgs, coordinator_main
from vexpert_runtime.node.messages import (
    Attached,
    CoordinatorFailed,
    Exit,
    FillLoopDied,
    FillTotals,
    FromCoordinator,
    NewPlan,
    PlanSwitched,
    SetInterval,
    ToCoordinator,
)
from vexpert_runtime.node.metrics import NodeMetrics
from vexpert_runtime.node.plans import PlanSwitch, ScheduledPlan, add_to_schedule
from vexpert_runtime.node.processes import exit_line, stop_processes, stop_signals_held
from vexpert_runtime.node.protocol import SharedState, SlotFiller
from vexpert_runtime.node.setup import NodeSetup

MAX_RESTART_DELAY_S = 30.0


def restart_delay(first_s: float, restarts: int) -> float:
    """Backoff before restart number ``restarts + 1``: doubling from ``first_s``, at most 30 s."""
    return min(MAX_RESTART_DELAY_S, first_s * 2 ** min(restarts, 5))


class FillTally:
    """Bytes streamed and copy time of the coordinators that died or stopped, plus the running one's."""

    def __init__(self) -> None:
        self.bytes_done = self.bytes_now = 0
        self.copy_s_done = self.copy_s_now = 0.0

    def running(self, msg: FillTotals) -> None:
        self.bytes_now, self.copy_s_now = msg.bytes_streamed, msg.copy_s

    def close(self) -> None:
        """The running coordinator is gone: its totals are final."""
        self.bytes_done += self.bytes_now
        self.copy_s_done += self.copy_s_now
        self.bytes_now, self.copy_s_now = 0, 0.0

    @property
    def bytes_streamed(self) -> int:
        return self.bytes_done + self.bytes_now

    @property
    def copy_s(self) -> float:
        return self.copy_s_done + self.copy_s_now


class CoordinatorHandle:
    """One coordinator process at a time, and what the supervisor knows of it.

    ``filler`` builds the fill loop's slot filler in the coordinator (picklable);
    ``restart_delay_s`` is the first backoff; ``abort`` set: no more restarts."""

    def __init__(self, ctx: Any, setup: NodeSetup, metrics: NodeMetrics, log: Callable[[str], None],
                 filler: Callable[..., SlotFiller], restart_delay_s: float, abort: threading.Event) -> None:
        self.ctx = ctx
        self.setup = setup
        self.metrics = metrics
        self.log = log
        self.filler = filler
        self.restart_delay_s = restart_delay_s
        self.abort = abort
        self.shared: SharedState | None = None
        self.handles: dict[int, Any] = {}  # local worker → its exported slot buffers
        self.schedule: list[ScheduledPlan] = []
        self.k = setup.k
        self._sent_k = setup.k
        self.proc: Any = None
        self.conn: Any = None  # the supervisor's end of the pipe
        self.attached = False
        self.pool_loaded = False  # some coordinator attached (its pool is built)
        self.fill_loop_down = False
        self.restarts = 0
        self._restart_at: float | None = None
        self._down_since: float | None = None
        self.fills = FillTally()
        self.last_plan = -1
        self.switches: list[PlanSwitch] = []

    @property
    def pid(self) -> int | None:
        """Pid of the coordinator process now running (None while there is none)."""
        proc = self.proc
        return proc.pid if proc is not None and proc.exitcode is None else None

    @property
    def degraded(self) -> bool:
        """The workers serve on base experts only: no coordinator attached, or its fill loop died."""
        return self.fill_loop_down or not self.attached

    # -- what the coordinator should have -----------------------------------------------------

    def slots_exported(self, local_rank: int, handle: Any) -> None:
        """A worker's slot buffer; the coordinator starts once every local worker's is here."""
        self.handles[local_rank] = handle
        if len(self.handles) == self.setup.local_workers:
            self.start()

    def schedule_plan(self, scheduled: ScheduledPlan) -> None:
        """Add a plan to the schedule; an attached coordinator gets it now, a starting one in its
        spawn arguments or when it attaches, a dead one at its restart."""
        self.schedule = add_to_schedule(self.schedule, scheduled)
        self._send(NewPlan(scheduled))

    def set_interval(self, k: int) -> None:
        self.k = k
        if self.attached and self._sent_k != k:
            self._send(SetInterval(k))
            self._sent_k = k

    def _send(self, msg: ToCoordinator) -> None:
        if self.conn is not None and self.attached:
            with contextlib.suppress(OSError):
                self.conn.send(msg)

    # -- process ------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn a coordinator on a pipe of its own; it re-opens the workers' slots, builds its
        pool and resumes filling where the workers are."""
        setup = self.setup
        assert self.shared is not None and self.schedule
        ours, theirs = self.ctx.Pipe()
        args = CoordinatorArgs(
            checkpoint=str(setup.checkpoint),
            spec=setup.spec,
            dtype=setup.dtype,
            device=setup.device,
            ranks=setup.ranks,
            shared=self.shared,
            handles=[self.handles[i] for i in range(setup.local_workers)],
            conn=theirs,
            parent_pid=os.getpid(),
            plans=list(self.schedule),
            k=self.k,
            filler=self.filler,
        )
        proc = self.ctx.Process(target=coordinator_main, args=(args,), name="vexpert-coordinator", daemon=True)
        with stop_signals_held():
            proc.start()
        theirs.close()
        self.proc, self.conn = proc, ours
        self._sent_k = self.k
        self.log(f"coordinator process {proc.pid} started")

    def poll(self) -> None:
        """Read what the coordinator sent; notice if it died, and restart it when its backoff is over."""
        self._read()
        self._watch()

    def _read(self) -> None:
        conn = self.conn
        while conn is not None:
            try:
                if not conn.poll(0):
                    return
                msg: FromCoordinator = conn.recv()
            except (EOFError, OSError):
                return
            self._on_message(msg)

    def _on_message(self, msg: FromCoordinator) -> None:
        if isinstance(msg, Attached):
            self._on_attached(msg)
        elif isinstance(msg, PlanSwitched):
            if msg.plan_id != self.last_plan:
                self.last_plan = msg.plan_id
                self.switches.append(PlanSwitch(msg.iteration, msg.plan_id))
        elif isinstance(msg, FillTotals):
            self.fills.running(msg)
        elif isinstance(msg, FillLoopDied):
            self.fill_loop_down = True
            self.metrics.slot_fill_errors.inc()
            self.metrics.degraded.set(1)
            self.log(f"slot fill loop died ({msg.error}): its coordinator exits and is restarted")
        elif isinstance(msg, CoordinatorFailed):
            lines = msg.traceback.strip().splitlines()
            self.log(f"coordinator failed: {lines[-1] if lines else '?'}")

    def _on_attached(self, msg: Attached) -> None:
        self.attached = self.pool_loaded = True
        self.metrics.coordinator_up.set(1)
        if self._down_since is not None:
            self.log(f"coordinator {msg.pid} attached at iteration {msg.iteration}, "
                     f"{time.monotonic() - self._down_since:.1f} s after its predecessor died")
            self._down_since = None
        self.set_interval(self.k)
        # a plan made while it was starting went into its spawn arguments or must follow now
        self._send(NewPlan(self.schedule[-1]))

    def _watch(self) -> None:
        """If the coordinator died, the workers keep serving on their base experts (no waiting: the
        shared state says none is attached) and it is restarted with backoff."""
        proc, now = self.proc, time.monotonic()
        if proc is not None and proc.exitcode is not None:
            self._read()  # what it sent before dying (its last stats)
            self.fills.close()
            assert self.shared is not None and self.conn is not None
            self.shared.detach_coordinator()
            self.conn.close()
            self.proc, self.conn = None, None
            if self.fill_loop_down:  # it exited because its fill loop failed
                self.metrics.fill_loop_restarts.inc()
            self.attached = self.fill_loop_down = False
            self._down_since = now
            delay = restart_delay(self.restart_delay_s, self.restarts)
            self._restart_at = now + delay
            self.metrics.degraded.set(1)
            self.metrics.coordinator_up.set(0)
            self.log(f"{exit_line(proc)}: serving with base experts only, restarting it in {delay:.1f} s")
        if self._restart_at is not None and now >= self._restart_at and not self.abort.is_set():
            self._restart_at = None
            self.restarts += 1
            self.metrics.coordinator_restarts.inc()
            self.start()

    def stop(self) -> None:
        """Ask the coordinator to exit (its last fill totals arrive as it stops), then make sure it did."""
        proc, conn = self.proc, self.conn
        if proc is None:
            return
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(Exit())
        proc.join(timeout=5.0)
        if conn is not None:
            self._read()
            conn.close()
        self.fills.close()
        stop_processes([proc])
        self.proc, self.conn = None, None

    def prune(self, keep: int) -> None:
        del self.switches[: max(0, len(self.switches) - keep)]
