"""A test double for the supervisor's balance state: the node serves fixed plans from fixed
iterations and makes none of its own (``NodeRuntime(..., balance=scripted_plans({...}))``), so a test
fixes the iterations of the plan switches. It lives here, not in the production types."""

from __future__ import annotations

import torch

from vexpert_runtime.node.balance import BalanceState, PlanMade
from vexpert_runtime.node.plans import ScheduledPlan
from vexpert_runtime.node.report import NodeOptions
from vexpert_runtime.node.setup import NodeSetup
from vexpert_runtime.node.supervisor import BalanceFactory
from vexpert_runtime.policy.allocator import Plan


class ScriptedBalance(BalanceState):
    """A balance state that replays ``plans`` (iteration → allocator :class:`Plan` served from that
    iteration on, under plan ids 1, 2, … in iteration order) and makes no plan of its own."""

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
