"""The placement-policy registry: one table of names for the runtime config, the CRD, the node and the
simulator; every policy's plan within the node's slot limits from the same inputs; EPLB's live form
(redundant experts in the slots) following EPLB's own replication rule."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import numpy as np
import pytest
import torch

from test_allocator import check_plan_invariants, skewed_counts
from vexpert_runtime.config import RuntimeConfig, VExpertKnobs
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.ep_moe import table_from_plan
from vexpert_runtime.policy import eplb
from vexpert_runtime.policy.allocator import AllocatorConfig
from vexpert_runtime.policy.names import PLACEMENT_POLICY_NAMES, PlacementPolicyName
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, gpu_loads, static_placement
from vexpert_runtime.policy.registry import PLACEMENT_POLICIES, placement_policy
from vexpert_runtime.simulation.simulate import POLICIES as SIMULATED


def test_the_config_and_the_crd_offer_exactly_the_registry_policies() -> None:
    from vexpert_operator.api import VExpertSpec

    assert tuple(PLACEMENT_POLICIES) == PLACEMENT_POLICY_NAMES == get_args(PlacementPolicyName)
    assert get_args(VExpertKnobs.model_fields["placement_policy"].annotation) == PLACEMENT_POLICY_NAMES
    assert get_args(VExpertSpec.model_fields["placement_policy"].annotation) == PLACEMENT_POLICY_NAMES
    assert all(PLACEMENT_POLICIES[name].name == name for name in PLACEMENT_POLICY_NAMES)
    assert set(PLACEMENT_POLICY_NAMES) <= set(SIMULATED)  # every policy a node runs, the simulator replays


def test_an_unknown_policy_is_one_line_naming_the_field() -> None:
    with pytest.raises(VExpertInputError, match=r"vexpert\.placement_policy.*unknown placement policy 'eplb'.*static"):
        placement_policy("eplb")
    with pytest.raises(VExpertInputError, match=r"vexpert\.placement_policy"):
        from vexpert_runtime.config import parse_runtime_config

        parse_runtime_config({"vexpert": {"placement_policy": "round-robin"}})
    assert RuntimeConfig().vexpert.placement_policy == "vexpert"


@pytest.mark.parametrize("name", PLACEMENT_POLICY_NAMES)
@pytest.mark.parametrize(("layers", "experts", "gpus", "group", "vmax", "seed"),
                         [(6, 64, 8, 2, 1, 0), (5, 32, 4, 2, 2, 1), (4, 48, 6, 3, 1, 2)])
def test_every_policy_plans_within_the_slots_from_the_same_inputs(
        name: str, layers: int, experts: int, gpus: int, group: int, vmax: int, seed: int) -> None:
    counts = skewed_counts(layers, experts, seed)
    base = static_placement(layers, experts, gpus)
    cfg = AllocatorConfig(group_size=group, vmax=vmax)
    pooled = torch.rand(layers, experts, generator=torch.Generator().manual_seed(seed)) < 0.7
    plan = PLACEMENT_POLICIES[name].plan(counts, base, gpus, cfg, pooled=pooled)
    # EPLB has no τ: checked against a threshold no layer exceeds
    check_plan_invariants(plan, counts, replace(cfg, balance_threshold=1.0) if name != "vexpert" else cfg, gpus)
    in_slots = plan.slot_expert >= 0
    layer = torch.arange(layers).view(-1, 1, 1).expand_as(plan.slot_expert)
    assert bool(pooled[layer[in_slots], plan.slot_expert[in_slots]].all()), "a copy of an expert the pool lacks"
    assert torch.equal(plan.base_gpu, base)  # residents never move
    table = table_from_plan(plan, 1)  # what the node routes with
    assert table.slot_expert.shape == (layers, gpus, cfg.slots_per_gpu)


def test_static_plans_no_copies() -> None:
    counts = skewed_counts(4, 32, 3)
    base = static_placement(4, 32, 4)
    plan = PLACEMENT_POLICIES["static"].plan(counts, base, 4)
    assert plan.streamed_experts() == 0 and int(plan.vexperts.sum()) == 0
    assert torch.equal(plan.balance_predicted, balance_ratio(base_gpu_loads(counts, base, 4)))


@pytest.mark.parametrize(("group", "vmax", "bound", "per_layer"),
                         [(2, 1, True, 1), (2, 2, True, 2), (4, 1, True, 1), (1, 2, True, 1), (1, 1, True, 0), (1, 1, False, 1)])
def test_eplb_gives_every_layer_the_same_copies_within_the_slots(group: int, vmax: int, bound: bool, per_layer: int) -> None:
    counts = skewed_counts(6, 64, 5, alpha=0.5)
    cfg = AllocatorConfig(group_size=group, vmax=vmax, adjacency_bound=bound)
    plan = eplb.slot_plan(counts, static_placement(6, 64, 8), 8, cfg)
    assert eplb.redundant_per_gpu(cfg) == per_layer
    assert plan.vexperts.tolist() == [per_layer] * 6
    assert bool(((plan.slot_expert >= 0).sum(-1) == per_layer).all())  # every GPU fills its V slots


def test_eplb_copies_follow_eplb_replication_and_split_evenly() -> None:
    """Where the node's limits do not bind (an expert needs fewer copies than GPUs, all pooled), the
    copies are exactly EPLB's (``replicate_experts``: the next copy to the highest load per copy)."""
    layers, experts, gpus = 5, 32, 8
    counts = skewed_counts(layers, experts, 7, alpha=1.0)
    plan = eplb.slot_plan(counts, static_placement(layers, experts, gpus), gpus, AllocatorConfig(group_size=2, vmax=2))
    _, _, logcnt = eplb.replicate_experts(counts, experts + 2 * gpus)
    assert int(logcnt.max()) < gpus  # the cap did not bind
    assert torch.equal(plan.logcnt(), logcnt)
    copies = plan.logcnt().unsqueeze(-1)
    expected = torch.where(plan.replica_gpu >= 0, 1.0 / copies, 0.0)
    assert torch.allclose(plan.replica_share, expected)  # SGLang's even split, no water-filling


def test_eplb_balances_better_than_static_and_vexpert_levels_further() -> None:
    counts = skewed_counts(6, 64, 11, alpha=0.3)
    base = static_placement(6, 64, 8)
    cfg = AllocatorConfig(group_size=2, vmax=1, balance_threshold=1.0)
    balance = {name: float(balance_ratio(gpu_loads(counts, PLACEMENT_POLICIES[name].plan(counts, base, 8, cfg)
                                                   .expert_gpu_share())).mean())
               for name in PLACEMENT_POLICY_NAMES}
    print("balance on one skewed window:", {k: round(v, 3) for k, v in balance.items()})
    assert balance["static"] < balance["eplb-redundant"] - 0.05
    # same copies budget (one per GPU per layer here, τ = 1): water-filled shares level further
    assert balance["eplb-redundant"] < balance["vexpert"]


def test_the_simulator_replays_registry_policies_as_a_node_runs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``eplb-slots`` is the registry's EPLB plan replanned every k; a policy added to the registry
    (here a copy of EPLB's entry under a new name) becomes a simulator row with no simulator edit."""
    from types import MappingProxyType

    from vexpert_runtime.policy import registry
    from vexpert_runtime.simulation import simulate as sim

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(32, 0.4), size=4)  # a skew that persists, as in real traces
    trace = torch.from_numpy(np.stack([rng.multinomial(4096, probs) for _ in range(30)])).to(torch.float32)
    added = replace(PLACEMENT_POLICIES["eplb-redundant"], name="eplb-again")  # type: ignore[arg-type]
    monkeypatch.setattr(registry, "PLACEMENT_POLICIES", MappingProxyType({**PLACEMENT_POLICIES, "eplb-again": added}))
    monkeypatch.setattr(sim, "POLICIES", (*sim.POLICIES, "eplb-again"))
    cfg = sim.SimulationConfig(num_gpus=8, allocation_interval=5, policies=("static", "eplb-slots", "eplb-again"))
    results = sim.simulate(trace, cfg)
    assert results["eplb-slots"].allocations == len(range(5, 30, 5))
    assert (results["eplb-slots"].balance == results["eplb-again"].balance).all()
    assert results["eplb-slots"].balance.mean() > results["static"].balance.mean() + 0.02
