"""Test doubles that inject faults into a node run (they live here, not in the production types).

:class:`FaultySlotFiller` is passed as ``NodeOptions(filler=faulty_filler(...))``; the partial is
pickled into the coordinator process, which imports this module (the test directory is on the
spawned process's ``sys.path``), so it imports no more of the node than the coordinator does. Each
fault fires once per coordinator process. Scripted plans are in :mod:`scripted_plans`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.node.protocol import Assignment, FillAborted, SlotFiller
from vexpert_runtime.node.slots import sequence
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
    fail_at_copy: layer sequence → index of the copy that writes half a row and then raises. The
    faults key on the layer sequence of the fill in progress and the copies it made so far.
    """

    def __init__(self, *args: Any, publish_delays: dict[int, float] | None = None,
                 delays: dict[int, float] | None = None, kill_at: int | None = None,
                 fail_at_copy: dict[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.publish_delays = dict(publish_delays or {})
        self.delays = dict(delays or {})
        self.kill_at = kill_at
        self.fail_at_copy = dict(fail_at_copy or {})
        self._seq = -1  # layer sequence of the fill in progress
        self._copies = 0  # copies it made so far

    def publish(self, iteration: int, plan_id: int, k: int, stop: bool) -> list[bool] | None:
        delay = self.publish_delays.get(iteration, 0.0)
        if delay and _once("publish", iteration) and self.abort.wait(delay):
            return None
        return super().publish(iteration, plan_id, k, stop)

    def fill_layer(self, iteration: int, layer: int, assignment: Assignment, filling: list[bool]) -> None:
        seq = sequence(iteration, layer, self.num_layers)
        if seq == self.kill_at and _once("kill", seq):
            raise FillLoopKilled(f"fill loop killed at sequence {seq}")
        delay = self.delays.get(seq, 0.0)
        if delay and _once("delay", seq) and self.abort.wait(delay):
            raise FillAborted
        self._seq, self._copies = seq, 0
        super().fill_layer(iteration, layer, assignment, filling)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        seq, index = self._seq, self._copies
        self._copies += 1
        if index == self.fail_at_copy.get(seq, -1) and _once("fail", seq):
            half = dst.shape[0] // 2
            dst[:half].copy_(src[:half])
            raise SlotFillError(f"injected failure half way through a copy of sequence {seq}")
        super().copy(dst, src)


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
