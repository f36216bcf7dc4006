"""Placement policies by name: what a node runs every k iterations and what the simulator replays.

Every policy turns the same inputs into a :class:`~vexpert_runtime.policy.allocator.Plan` whose copies
live in the node's ``S = G·vmax`` vExpert slots (resident experts never move): a window's expert
counts [L, E], the base placement [L, E], the GPU count N, the slot knobs
(:class:`~vexpert_runtime.policy.allocator.AllocatorConfig`), the performance profile and constants,
and the host pool mask [L, E] — :func:`~vexpert_runtime.policy.allocator.allocate`'s signature,
what ``NodeOptions.allocator`` takes. The names are :data:`.names.PlacementPolicyName` (torch-free,
for the runtime config and the operator's CRD); a test keeps them equal to this table's keys.

Adding a policy: a function with ``allocate``'s signature returning a ``Plan`` (build it with
:func:`~vexpert_runtime.policy.allocator.plan_from_copies` to get the slot limits for free), its name
in :data:`.names.PlacementPolicyName`, an entry here, and ``python -m vexpert_operator.crdgen``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy import eplb
from vexpert_runtime.policy.allocator import (
    AllocatorConfig,
    Plan,
    allocate,
    plan_from_copies,
    validate_counts,
)
from vexpert_runtime.policy.names import PLACEMENT_POLICY_NAMES, PlacementPolicyName
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, validate_base_placement
from vexpert_runtime.policy.profile import PerformanceProfile


class PlacementFunction(Protocol):
    """``allocate``'s signature: counts [L, E], base_gpu [L, E] int64, N, slot knobs, profile,
    constants, pool mask [L, E] bool (None = every expert) → a Plan."""

    def __call__(
        self,
        counts: Tensor,
        base_gpu: Tensor,
        num_gpus: int,
        config: AllocatorConfig | None = None,
        profile: PerformanceProfile | None = None,
        consts: InferenceConstants | None = None,
        pooled: Tensor | None = None,
    ) -> Plan: ...


# The policy as its authors run it where resident experts may move (a stop-the-world weight
# rearrangement): window counts [L, E], redundant experts per layer, expert groups, nodes, GPUs,
# variant → share [L, E, N]. Only the simulator scores it; a node cannot run it.
RearrangeFunction = Callable[[Tensor, int, int, int, int, str], Tensor]


@dataclass(frozen=True)
class PlacementPolicy:
    """One entry of :data:`PLACEMENT_POLICIES` (what each name means for users:
    :data:`.names.PLACEMENT_POLICY_HELP`)."""

    name: PlacementPolicyName
    plan: PlacementFunction
    even_split: bool  # copies take equal token shares: a node's ``dispatch: auto`` keeps the plan's shares
    rearrange: RearrangeFunction | None = None


def static_plan(
    counts: Tensor,
    base_gpu: Tensor,
    num_gpus: int,
    config: AllocatorConfig | None = None,
    profile: PerformanceProfile | None = None,
    consts: InferenceConstants | None = None,
    pooled: Tensor | None = None,
) -> Plan:
    """No copies: every expert only on its base GPU, every slot empty (the counts only fill the
    plan's balance fields). Same inputs as :func:`allocate`; ``profile``, ``consts`` and
    ``pooled`` are not needed."""
    del profile, consts, pooled  # nothing to decide
    config = config or AllocatorConfig()
    config.validate()
    validate_counts(counts, base_gpu)
    validate_base_placement(base_gpu, num_gpus)
    w = counts.to(torch.float32)
    none = torch.zeros(w.shape[0], dtype=torch.int64, device=w.device)
    balance = balance_ratio(base_gpu_loads(w, base_gpu, num_gpus))
    return plan_from_copies(w, base_gpu, torch.ones_like(base_gpu), none, num_gpus, config, balance)


PLACEMENT_POLICIES: Mapping[PlacementPolicyName, PlacementPolicy] = MappingProxyType({
    # per-layer vExpert counts from the cost model, copies water-filled
    "vexpert": PlacementPolicy("vexpert", allocate, even_split=False),
    # EPLB's redundant experts in the slots (the same count every layer, split evenly); DeepSeek's own
    # stop-the-world form for the simulator
    "eplb-redundant": PlacementPolicy("eplb-redundant", eplb.slot_plan, even_split=True, rearrange=eplb.rearranged_share),
    "static": PlacementPolicy("static", static_plan, even_split=True),  # the base placement, no copies
})


def placement_policy(name: str, field: str = "vexpert.placement_policy") -> PlacementPolicy:
    """The registry entry called ``name``; an unknown name is a one-line error naming ``field``."""
    for policy in PLACEMENT_POLICIES.values():
        if policy.name == name:
            return policy
    raise VExpertInputError(field, f"unknown placement policy {name!r}", f"use one of {', '.join(PLACEMENT_POLICY_NAMES)}")
