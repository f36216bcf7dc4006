"""Test doubles that script or inject faults into a node run (they live here, not in the
production types).

:class:`FaultySlotFiller` is passed as ``NodeOptions(filler=faulty_filler(...))``; the partial is
pickled into the coordinator process, which imports this module (the test directory is on the
spawned process's ``sys.path``). Each fault fires once per coordinator process.
:class:`ScriptedBalance` is passed as ``NodeRuntime(..., balance=scripted_plans({...}))``: the node
serves fixed plans from fixed iterations and makes none of its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.node.balance import BalanceState, PlanMade
from vexpert_runtime.node.plans import ScheduledPlan
from vexpert_runtime.node.protocol import Assignment, FillAborted, SlotFiller
from vexpert_runtime.node.report import NodeOptions
from vexpert_runtime.node.setup import NodeSetup
from vexpert_runtime.node.supervisor import BalanceFactory
from vexpert_runtime.policy.allocator import Plan, allocate
from vexpert_runtime.workload import Workload

_FIRED: set[tuple[str, int]] = set()  # (fault, sequence) already injected in this process


def _once(fault: str, seq: int) -> bool:
    if (fault, seq) in _FIRED:
        return False
    _FIRED.add((fault, seq))
    return True


class SlotFillError(RuntimeError):
    """An injected copy failure (an ``Exception``: the fill loop fails and its coordinator exits)."""


class FillLoopKilled(BaseException):
    """Not an ``Exception``: the fill loop dies of it (the node must keep serving and restart it)."""


class FaultySlotFiller(SlotFiller):
    """A :class:`SlotFiller` that is late to publish an iteration, stalls before or dies at a layer's
    fill, or fails half way through a copy.

    publish_delays: iteration → seconds before publishing it; delays: layer sequence (t·L + l) →
    seconds to stall before filling it; kill_at: layer sequence at which the fill loop dies;
    fail_at_copy: layer sequence → index of the copy that writes half a row and then raises.
    """

    def __init__(self, *args: Any, publish_delays: dict[int, float] | None = None,
                 delays: dict[int, float] | None = None, kill_at: int | None = None,
                 fail_at_copy: dict[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.publish_delays = dict(publish_delays or {})
        self.delays = dict(delays or {})
        self.kill_at = kill_at
        self.fail_at_copy = dict(fail_at_copy or {})

    def publish(self, iteration: int, plan_id: int, k: int, stop: bool) -> list[bool] | None:
        delay = self.publish_delays.get(iteration, 0.0)
        if delay and _once("publish", iteration) and self.abort.wait(delay):
            return None
        return super().publish(iteration, plan_id, k, stop)

    def fill_layer(self, seq: int, layer: int, assignment: Assignment, filling: list[bool]) -> None:
        if seq == self.kill_at and _once("kill", seq):
            raise FillLoopKilled(f"fill loop killed at sequence {seq}")
        delay = self.delays.get(seq, 0.0)
        if delay and _once("delay", seq) and self.abort.wait(delay):
            raise FillAborted
        super().fill_layer(seq, layer, assignment, filling)

    def copy(self, seq: int, index: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if index == self.fail_at_copy.get(seq, -1) and _once("fail", seq):
            half = dst.shape[0] // 2
            dst[:half].copy_(src[:half])
            raise SlotFillError(f"injected failure half way through a copy of sequence {seq}")
        super().copy(seq, index, dst, src)


def faulty_filler(**faults: Any) -> Callable[..., SlotFiller]:
    """``NodeOptions.filler`` for a :class:`FaultySlotFiller` with ``faults`` (picklable)."""
    return functools.partial(FaultySlotFiller, **faults)


def slow_allocator(delay_s: float) -> Callable[..., Plan]:
    """``NodeOptions.allocator``: the real allocator, ``delay_s`` slower."""

    def allocate_slowly(*args: Any, **kwargs: Any) -> Plan:
        time.sleep(delay_s)
        return allocate(*args, **kwargs)

    return allocate_slowly


@dataclass(frozen=True)
class PacedWorkload(Workload):
    """A :class:`Workload` whose every iteration takes at least ``pace_s`` (a slow model): lets a
    test see what happens over wall-clock time (restarts with backoff) within few iterations."""

    pace_s: float = 0.05

    def inputs(self, iteration: int, rank: int, hidden: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        time.sleep(self.pace_s)
        return super().inputs(iteration, rank, hidden, dtype)


class ScriptedBalance(BalanceState):
    """A balance state that replays ``plans`` (iteration → allocator :class:`Plan` served from that
    iteration on, under plan ids 1, 2, … in iteration order) and makes no plan of its own: a test
    fixes the iterations of the plan switches."""

    def __init__(self, setup: NodeSetup, options: NodeOptions, plans: dict[int, Plan]) -> None:
        super().__init__(setup, options.workload.tokens_per_worker)
        self.script = dict(plans)

    def opening_plans(self) -> list[ScheduledPlan]:
        opening = super().opening_plans()
        return opening + [ScheduledPlan(self.adopt(self.script[i]), i) for i in sorted(self.script)]

    def next_plan(self, counts: torch.Tensor) -> PlanMade | None:
        return None


def scripted_plans(plans: dict[int, Plan]) -> BalanceFactory:
    """``NodeRuntime(..., balance=)`` for a :class:`ScriptedBalance` of ``plans``."""
    return lambda setup, options: ScriptedBalance(setup, options, plans)
