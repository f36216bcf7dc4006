"""Plans as the node serves them, and the coordinator's schedule of them.

A :class:`NodePlan` is what the supervisor hands the coordinator: the routing table the workers read
and the experts the coordinator's pool holds for it. A :class:`ScheduledPlan` adds the first
iteration it may serve; the coordinator serves, at each iteration boundary, the newest plan already
in effect (:func:`in_effect`). Plans the node makes as it runs take effect at once (iteration 0);
a plan scheduled for later lets a caller fix the iteration of a switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from vexpert_runtime.model.ep_moe import RoutingTable


@dataclass(frozen=True)
class NodePlan:
    """A routing table and the experts [L, Np] the coordinator's L2 pool holds for it."""

    table: RoutingTable
    pooled: torch.Tensor

    @property
    def plan_id(self) -> int:
        return self.table.plan_id


@dataclass(frozen=True)
class ScheduledPlan:
    """A plan and the first iteration it may serve (0: from the next boundary the fill loop reaches)."""

    plan: NodePlan
    first_iteration: int = 0


class PlanSwitch(NamedTuple):
    """The fill loop took plan ``plan_id`` at ``iteration``."""

    iteration: int
    plan_id: int


def add_to_schedule(schedule: list[ScheduledPlan], new: ScheduledPlan) -> list[ScheduledPlan]:
    """``schedule`` with ``new`` as its newest plan. A plan in effect from the start supersedes
    every older one (none of them can be the newest in effect again); a plan already scheduled for
    the same iteration is not added twice."""
    if new.first_iteration <= 0:
        return [new]
    if any(s.plan.plan_id == new.plan.plan_id and s.first_iteration == new.first_iteration for s in schedule):
        return list(schedule)
    return [*schedule, new]


def in_effect(schedule: list[ScheduledPlan], iteration: int) -> ScheduledPlan:
    """The newest plan of ``schedule`` whose first iteration is at most ``iteration`` (else the oldest)."""
    due = [s for s in schedule if s.first_iteration <= iteration]
    return due[-1] if due else schedule[0]
