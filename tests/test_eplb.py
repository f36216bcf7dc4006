"""Tests for vexpert_runtime.policy.eplb: DeepSeek's README example, equality with a plain reference port
of DeepSeek's algorithm (ties included), placement invariants and input validation."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.eplb import (
    balanced_packing,
    expert_gpu_share,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)

# ----------------------------------------------------------------------------------------------
# Reference port: DeepSeek's EPLB written as plainly as possible (Python loops over layers, items
# and packs; loads added one tensor element at a time), the oracle the fast version must equal.
# ----------------------------------------------------------------------------------------------


def ref_balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        index = torch.arange(n, dtype=torch.int64).expand(rows, n)
        return index, torch.zeros(rows, n, dtype=torch.int64)
    order = weight.float().sort(-1, descending=True).indices
    pack_index = torch.full((rows, n), -1, dtype=torch.int64)
    rank_in_pack = torch.full((rows, n), -1, dtype=torch.int64)
    for row in range(rows):
        loads: list = [0] * num_packs
        sizes = [0] * num_packs
        for item in order[row].tolist():
            best = -1
            for p in range(num_packs):
                if sizes[p] < per_pack and (best < 0 or loads[p] < loads[best]):
                    best = p
            pack_index[row, item] = best
            rank_in_pack[row, item] = sizes[best]
            loads[best] = loads[best] + weight[row, item]  # 0-d tensor: weight's dtype
            sizes[best] += 1
    return pack_index, rank_in_pack


def ref_replicate_experts(weight: Tensor, num_phy: int) -> tuple[Tensor, Tensor, Tensor]:
    rows, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    all_rows = torch.arange(rows)
    for slot in range(num_log, num_phy):
        chosen = (weight / logcnt).max(dim=-1).indices
        phy2log[:, slot] = chosen
        rank[:, slot] = logcnt[all_rows, chosen]
        logcnt[all_rows, chosen] += 1
    return phy2log, rank, logcnt


def _ref_inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    for row in range(perm.shape[0]):
        inv[row, perm[row]] = torch.arange(perm.shape[1])
    return inv


def ref_hierarchical(
    weight: Tensor, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus

    group_tokens = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    g_pack, g_rank = ref_balanced_packing(group_tokens, num_nodes)
    log2mlog = (
        ((g_pack * groups_per_node + g_rank) * group_size).unsqueeze(-1) + torch.arange(group_size)
    ).flatten(-2)
    mlog2log = _ref_inverse(log2mlog)

    mlog_tokens = weight.gather(-1, mlog2log).view(-1, num_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = ref_replicate_experts(mlog_tokens, num_phy // num_nodes)

    phy_tokens = (mlog_tokens / mlogcnt).gather(-1, phy2mlog)
    pack, rank = ref_balanced_packing(phy_tokens, num_gpus // num_nodes)
    pphy2phy = _ref_inverse(pack * per_gpu + rank)

    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + torch.arange(num_nodes).view(1, -1, 1) * (num_log // num_nodes)).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    phyrank = phyrank.gather(-1, pphy2phy).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return phy2log, phyrank, logcnt


def ref_rebalance(
    weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, policy: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    layers, num_log = weight.shape
    weight = weight.float().cpu()
    hierarchical = policy == "hierarchical" or (policy == "auto" and num_groups % num_nodes == 0)
    if hierarchical:
        phy2log, phyrank, logcnt = ref_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = ref_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    width = int(logcnt.max())
    log2phy = torch.full((layers, num_log * width), -1, dtype=torch.int64)
    log2phy.scatter_(-1, phy2log * width + phyrank, torch.arange(num_replicas).expand(layers, -1))
    return phy2log, log2phy.view(layers, num_log, width), logcnt


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------

README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def _weights(kind: str, layers: int, experts: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct integer values: lots of equal loads, zeros included
        return torch.randint(0, 4, (layers, experts), generator=gen).float()
    if kind == "int":
        return torch.randint(0, 1000, (layers, experts), generator=gen).float()
    if kind == "skewed":  # heavy-tailed like real routing statistics
        return (torch.rand(layers, experts, generator=gen) ** 4 * 5000).round()
    return torch.rand(layers, experts, generator=gen) * 100


def _assert_same_plan(
    weight: Tensor, replicas: int, groups: int, nodes: int, gpus: int, policy: str = "auto"
) -> None:
    got = rebalance_experts(weight, replicas, groups, nodes, gpus, policy=policy)
    want = ref_rebalance(weight, replicas, groups, nodes, gpus, policy=policy)
    for name, g, w in zip(("phy2log", "log2phy", "logcnt"), got, want, strict=True):
        assert torch.equal(g, w), f"{name} differs from the reference port"


def _gpu_loads(weight: Tensor, share: Tensor) -> Tensor:
    return torch.einsum("le,len->ln", weight.float(), share)


def _balance(loads: Tensor) -> Tensor:
    return loads.mean(-1) / loads.amax(-1)


# ----------------------------------------------------------------------------------------------
# DeepSeek's README example
# ----------------------------------------------------------------------------------------------


def test_readme_example_matches_deepseek_output() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    assert torch.equal(logcnt, torch.stack([torch.bincount(row, minlength=12) for row in README_PHY2LOG]))
    assert log2phy.shape == (2, 12, 2)
    # Expert 5 of layer 0 is replicated into slots 0 and 2, i.e. GPUs 0 and 1.
    assert log2phy[0, 5].tolist() == [0, 2]
    share = expert_gpu_share(phy2log, logcnt, 12, 8)
    assert share[0, 5].tolist() == [0.5, 0.5, 0, 0, 0, 0, 0, 0]
    assert share[0, 6].tolist() == [1.0, 0, 0, 0, 0, 0, 0, 0]


def test_readme_example_hierarchical_is_auto_and_global_differs() -> None:
    hier = rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="hierarchical")[0]
    glob = rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="global")[0]
    assert torch.equal(hier, README_PHY2LOG)
    assert torch.equal(glob, ref_rebalance(README_WEIGHT, 16, 4, 2, 8, policy="global")[0])
    assert not torch.equal(glob, hier)


# ----------------------------------------------------------------------------------------------
# Fast version == reference port
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ties", "int", "float"])
@pytest.mark.parametrize(
    ("rows", "items", "packs"), [(1, 4, 2), (5, 12, 3), (7, 32, 8), (3, 40, 4), (2, 6, 6)]
)
def test_balanced_packing_matches_reference(kind: str, rows: int, items: int, packs: int) -> None:
    weight = _weights(kind, rows, items, seed=rows * 100 + items)
    got = balanced_packing(weight, packs)
    want = ref_balanced_packing(weight, packs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_balanced_packing_keeps_the_input_dtype_like_deepseek(dtype: torch.dtype) -> None:
    weight = _weights("ties", 6, 24, seed=3).to(dtype) * 7
    got = balanced_packing(weight, 4)
    want = ref_balanced_packing(weight, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_balanced_packing_overflowing_half_loads_match_reference() -> None:
    """float16 loads overflow to inf, so open and full packs look alike; DeepSeek still only
    considers packs with room."""
    weight = torch.tensor([[40000.0] * 8, [30000.0, 60000.0, 1.0, 50000.0, 0.0, 2.0, 40000.0, 3.0]]).half()
    got = balanced_packing(weight, 2)
    want = ref_balanced_packing(weight, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(torch.bincount(got[0][0], minlength=2), torch.tensor([4, 4]))


def test_balanced_packing_all_equal_and_all_zero() -> None:
    for weight in (torch.zeros(3, 8), torch.full((3, 8), 5.0)):
        got = balanced_packing(weight, 2)
        want = ref_balanced_packing(weight, 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kind", ["ties", "int", "float"])
@pytest.mark.parametrize(("rows", "log", "phy"), [(1, 4, 4), (4, 12, 16), (6, 32, 40), (3, 8, 30)])
def test_replicate_experts_matches_reference(kind: str, rows: int, log: int, phy: int) -> None:
    weight = _weights(kind, rows, log, seed=rows + log + phy)
    for g, w in zip(replicate_experts(weight, phy), ref_replicate_experts(weight, phy), strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kind", ["ties", "int", "skewed", "float"])
@pytest.mark.parametrize("policy", ["hierarchical", "global"])
@pytest.mark.parametrize(
    ("layers", "experts", "replicas", "groups", "nodes", "gpus"),
    [
        (2, 12, 16, 4, 2, 8),
        (3, 16, 16, 4, 2, 4),
        (4, 32, 48, 8, 4, 8),
        (2, 64, 80, 8, 2, 16),
        (3, 24, 24, 6, 3, 6),
    ],
)
def test_rebalance_matches_reference(
    kind: str, policy: str, layers: int, experts: int, replicas: int, groups: int, nodes: int, gpus: int
) -> None:
    weight = _weights(kind, layers, experts, seed=experts * 7 + replicas)
    _assert_same_plan(weight, replicas, groups, nodes, gpus, policy=policy)


@pytest.mark.parametrize("policy", ["hierarchical", "global"])
@pytest.mark.parametrize("replicas", [256, 320])
def test_rebalance_matches_reference_deepseek_v3_scale(policy: str, replicas: int) -> None:
    """58 MoE layers × 256 experts, 8 groups, 8 nodes × 8 GPUs, with and without 64 redundant."""
    weight = _weights("ties" if replicas == 256 else "int", 58, 256, seed=replicas)
    _assert_same_plan(weight, replicas, 8, 8, 64, policy=policy)


def test_auto_policy_picks_hierarchical_only_when_groups_divide_nodes() -> None:
    weight = _weights("int", 3, 24, seed=11)
    auto_hier = rebalance_experts(weight, 32, 4, 2, 8)  # 4 % 2 == 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(auto_hier, rebalance_experts(weight, 32, 4, 2, 8, "hierarchical"), strict=True)
    )
    auto_glob = rebalance_experts(weight, 32, 3, 2, 8)  # 3 % 2 != 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(auto_glob, rebalance_experts(weight, 32, 3, 2, 8, "global"), strict=True)
    )
    _assert_same_plan(weight, 32, 3, 2, 8)


# ----------------------------------------------------------------------------------------------
# Placement invariants
# ----------------------------------------------------------------------------------------------

LAYOUTS = [(4, 64, 64, 8, 2, 16), (4, 64, 80, 8, 2, 16), (3, 32, 48, 4, 4, 8), (2, 256, 320, 8, 8, 64)]


@pytest.mark.parametrize("policy", ["hierarchical", "global"])
@pytest.mark.parametrize(("layers", "experts", "replicas", "groups", "nodes", "gpus"), LAYOUTS)
def test_plan_invariants(
    policy: str, layers: int, experts: int, replicas: int, groups: int, nodes: int, gpus: int
) -> None:
    weight = _weights("skewed", layers, experts, seed=replicas + gpus)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus, policy=policy)
    assert phy2log.shape == (layers, replicas) and logcnt.shape == (layers, experts)
    assert bool((logcnt >= 1).all()), "every logical expert needs a replica"
    assert torch.equal(logcnt.sum(-1), torch.full((layers,), replicas))
    for layer in range(layers):
        assert torch.equal(torch.bincount(phy2log[layer], minlength=experts), logcnt[layer])
    # log2phy lists exactly the slots of each expert, then -1 padding.
    assert log2phy.shape == (layers, experts, int(logcnt.max()))
    valid = torch.arange(log2phy.shape[-1]) < logcnt.unsqueeze(-1)
    assert bool((log2phy[~valid] == -1).all())
    slots = log2phy.clamp(min=0)
    expert_of_listed_slot = phy2log.gather(1, slots.flatten(1)).view_as(slots)
    owner = torch.arange(experts).view(1, -1, 1).expand_as(slots)
    assert torch.equal(expert_of_listed_slot[valid], owner[valid])
    for layer in range(layers):  # each slot is listed exactly once
        assert torch.equal(log2phy[layer][valid[layer]].sort().values, torch.arange(replicas))
    # Every GPU holds exactly replicas / gpus slots; the share tensor is a distribution per expert.
    share = expert_gpu_share(phy2log, logcnt, experts, gpus)
    assert share.shape == (layers, experts, gpus)
    slots_per_gpu = (share * logcnt.unsqueeze(-1)).sum(1)
    assert torch.allclose(slots_per_gpu, torch.full((layers, gpus), replicas / gpus))
    assert torch.allclose(share.sum(-1), torch.ones(layers, experts))


@pytest.mark.parametrize(("layers", "experts", "replicas", "groups", "nodes", "gpus"), LAYOUTS)
def test_hierarchical_keeps_each_group_on_one_node(
    layers: int, experts: int, replicas: int, groups: int, nodes: int, gpus: int
) -> None:
    weight = _weights("skewed", layers, experts, seed=experts + nodes)
    phy2log, _, _ = rebalance_experts(weight, replicas, groups, nodes, gpus, policy="hierarchical")
    node_of_slot = torch.arange(replicas) // (replicas // nodes)
    group_of_slot = phy2log // (experts // groups)
    for layer in range(layers):
        for group in range(groups):
            nodes_used = node_of_slot[group_of_slot[layer] == group].unique()
            assert nodes_used.numel() == 1, f"layer {layer} group {group} spans nodes {nodes_used.tolist()}"
        # and every node holds groups / nodes whole groups
        for node in range(nodes):
            assert group_of_slot[layer][node_of_slot == node].unique().numel() == groups // nodes


@pytest.mark.parametrize("policy", ["hierarchical", "global"])
@pytest.mark.parametrize("replicas", [64, 80])
def test_balance_beats_contiguous_placement_on_skewed_loads(policy: str, replicas: int) -> None:
    layers, experts, gpus = 6, 64, 16
    weight = _weights("skewed", layers, experts, seed=5)
    contiguous = torch.nn.functional.one_hot(torch.arange(experts) // (experts // gpus), gpus).float()
    before = _balance(_gpu_loads(weight, contiguous.expand(layers, -1, -1)))
    phy2log, _, logcnt = rebalance_experts(weight, replicas, 8, 2, gpus, policy=policy)
    after = _balance(_gpu_loads(weight, expert_gpu_share(phy2log, logcnt, experts, gpus)))
    assert bool((after > before).all()), (before, after)
    if replicas > experts:  # redundancy helps on top of packing
        assert float(after.mean()) > 0.9
        no_redundancy = rebalance_experts(weight, experts, 8, 2, gpus, policy=policy)
        base = _balance(
            _gpu_loads(weight, expert_gpu_share(no_redundancy[0], no_redundancy[2], experts, gpus))
        )
        assert float(after.mean()) > float(base.mean())


def test_hierarchical_function_returns_replica_ranks() -> None:
    weight = _weights("int", 3, 16, seed=2).float()
    phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(weight, 24, 4, 2, 8)
    want = ref_hierarchical(weight, 24, 4, 2, 8)
    for g, w in zip((phy2log, phy_rank, logcnt), want, strict=True):
        assert torch.equal(g, w)
    for layer in range(3):
        for expert in range(16):
            ranks = phy_rank[layer][phy2log[layer] == expert]
            assert sorted(ranks.tolist()) == list(range(int(logcnt[layer, expert])))


# ----------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "policy", "field"),
    [
        ((18, 4, 2, 8), "auto", "num_replicas"),  # 18 replicas over 8 GPUs
        ((16, 4, 3, 8), "auto", "num_gpus"),  # 8 GPUs over 3 nodes
        ((16, 5, 1, 8), "auto", "num_groups"),  # 12 experts in 5 groups
        ((8, 4, 2, 8), "auto", "num_replicas"),  # fewer replicas than experts
        ((16, 4, 2, 8), "round-robin", "policy"),
        ((24, 3, 2, 8), "hierarchical", "num_groups"),  # 3 groups over 2 nodes
        ((16, 4, 0, 8), "auto", "num_nodes"),
    ],
)
def test_invalid_layouts_raise(args: tuple[int, int, int, int], policy: str, field: str) -> None:
    with pytest.raises(VExpertInputError) as info:
        rebalance_experts(README_WEIGHT, *args, policy=policy)
    assert info.value.field == field


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_weights_raise(bad: float) -> None:
    weight = README_WEIGHT.float().clone()
    weight[1, 3] = bad
    with pytest.raises(VExpertInputError) as info:
        rebalance_experts(weight, 16, 4, 2, 8)
    assert info.value.field == "weight"


def test_weight_must_be_two_dimensional() -> None:
    with pytest.raises(VExpertInputError):
        rebalance_experts(README_WEIGHT[0], 16, 4, 2, 8)


def test_expert_gpu_share_validates_inputs() -> None:
    phy2log, _, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    with pytest.raises(VExpertInputError):
        expert_gpu_share(phy2log, logcnt, 12, 5)  # 16 slots over 5 GPUs
    with pytest.raises(VExpertInputError):
        expert_gpu_share(phy2log, logcnt + 1, 12, 8)  # counts disagree with phy2log
    with pytest.raises(VExpertInputError):
        expert_gpu_share(phy2log, logcnt[:, :11], 12, 8)
