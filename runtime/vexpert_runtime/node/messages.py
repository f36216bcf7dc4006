"""Messages between a node's processes: one frozen dataclass per message, one definition each.

* worker → supervisor (the results queue): :class:`SlotsExported`, :class:`WorkerReady`,
  :class:`IterationDone`, :class:`CountsWindow`, :class:`WorkerDone`, :class:`WorkerInputError`,
  :class:`WorkerFailed`;
* supervisor → worker (its control queue): :class:`PlanTable` before any header announces its plan,
  and :class:`Bye` once the coordinator dropped its CUDA IPC mappings;
* supervisor → coordinator (its pipe): :class:`NewPlan`, :class:`SetInterval`, :class:`Exit`;
* coordinator → supervisor: :class:`Attached`, :class:`PlanSwitched`, :class:`FillLoopDied`,
  :class:`FillTotals`, :class:`CoordinatorFailed`.

Each direction has its union type (:data:`FromWorker`, :data:`ToWorker`, :data:`ToCoordinator`,
:data:`FromCoordinator`). Everything here is plain data (pickled through ``multiprocessing`` queues
and pipes).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from vexpert_runtime.model.ep_moe import RoutingTable
from vexpert_runtime.node.plans import ScheduledPlan

# --------------------------------------------------------------------------------------------
# worker → supervisor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotsExported:
    """A worker's slot buffer, as its transport exported it (the coordinator opens it)."""

    local_rank: int
    handle: Any


@dataclass(frozen=True)
class WorkerReady:
    """The worker loaded its experts and joined the process group."""

    rank: int


@dataclass(frozen=True)
class Heartbeat:
    """An idle serving worker is alive (no iteration runs while no rank has a request)."""

    rank: int


@dataclass(frozen=True)
class IterationDone:
    """One decode iteration of one worker.

    ``plan_ids`` per layer (0 = static placement: degraded or no plan yet); ``output`` [B, H] float32
    when verifying; ``details``: what the worker's slot probe reported (:mod:`.slot_probe`; None
    without one).
    """

    rank: int
    iteration: int
    step_s: float
    wait_s: float
    degraded_layers: int
    plan_ids: list[int]
    output: np.ndarray | None = None
    details: Any = None
    rescued_layers: int = 0  # layers this worker filled itself (their coordinator died)
    graphed: bool = False  # the step was a replay of the worker's captured CUDA graph
    gc_s: tuple[float, float, float] = (0.0, 0.0, 0.0)  # seconds in the cyclic GC by generation since the last report
    gc_frozen: int = 0  # objects of the worker's startup heap frozen out of the GC's reach (gc_heap)


@dataclass(frozen=True)
class CountsWindow:
    """The all-reduced counts of the ``n`` iterations from ``start``: ``counts`` [n, L, E] tokens
    routed to each expert, ``loads`` [n, L, N] rows each EP rank computed."""

    start: int
    counts: np.ndarray
    loads: np.ndarray

    @property
    def length(self) -> int:
        return int(self.counts.shape[0])

    @property
    def span(self) -> WindowSpan:
        return WindowSpan(self.start, self.length)


class WindowSpan(NamedTuple):
    """The iterations one count window covers."""

    start: int
    length: int


@dataclass(frozen=True)
class WorkerDone:
    rank: int


@dataclass(frozen=True)
class WorkerInputError:
    """A worker found bad input (one ``error:`` line, exit 2)."""

    rank: int
    field: str
    problem: str
    fix: str


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    traceback: str


FromWorker = (SlotsExported | WorkerReady | Heartbeat | IterationDone | CountsWindow | WorkerDone | WorkerInputError
              | WorkerFailed)


# --------------------------------------------------------------------------------------------
# supervisor → worker
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanTable:
    """The routing table of a plan, sent to every worker before any header announces the plan."""

    table: RoutingTable


@dataclass(frozen=True)
class Bye:
    """The coordinator's IPC mappings of this worker's slots are gone: the worker may exit."""


ToWorker = PlanTable | Bye


# --------------------------------------------------------------------------------------------
# supervisor ↔ coordinator
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewPlan:
    """A plan for the coordinator's schedule. It crosses the pipe pickled by value: a tensor sent as
    itself would go through ``torch.multiprocessing``'s fd sharing, which a coordinator killed
    mid-receive interrupts."""

    scheduled: ScheduledPlan

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _new_plan_from_bytes, (pickle.dumps(self.scheduled),)


def _new_plan_from_bytes(payload: bytes) -> NewPlan:
    return NewPlan(pickle.loads(payload))  # from the supervisor (trusted)


@dataclass(frozen=True)
class SetInterval:
    """The allocation interval k the fill loop announces in its headers."""

    k: int


@dataclass(frozen=True)
class Exit:
    pass


ToCoordinator = NewPlan | SetInterval | Exit


@dataclass(frozen=True)
class Attached:
    """A coordinator opened the slots, built its pool and resumed publishing at ``iteration``."""

    pid: int
    iteration: int


@dataclass(frozen=True)
class PlanSwitched:
    iteration: int
    plan_id: int


@dataclass(frozen=True)
class FillLoopDied:
    """The fill loop failed; its coordinator exits (the workers rescue what it left unfilled)."""

    error: str


@dataclass(frozen=True)
class FillTotals:
    """Running totals of this coordinator's fills."""

    bytes_streamed: int
    copy_s: float


@dataclass(frozen=True)
class CoordinatorFailed:
    traceback: str


FromCoordinator = Attached | PlanSwitched | FillLoopDied | FillTotals | CoordinatorFailed
