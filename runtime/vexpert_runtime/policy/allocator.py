"""The vExpert allocator: physical-to-virtual rebalancing (paper Algorithms 1 and 2, Appendix E).

Given recent per-layer expert counts it decides, for every layer,

1. how many vExperts per GPU ``V_i`` to stream (group-wise budget over ``G`` consecutive layers,
   adjacent layers fit the ``S = G·vmax`` slots together, layers already balanced above ``τ`` get
   none; Eq. 5 solved exactly over all layers by dynamic programming with the performance model),
2. which experts get how many extra replicas (greedy on load per replica, so the hottest expert
   may get several),
3. on which GPU each replica lives (largest replica first onto the least-loaded GPU that has a free
   slot and does not already hold that expert: never two copies of one expert on one GPU),
4. which share of each replicated expert's tokens each copy takes (water-filling, so the GPUs that
   hold copies end up level).

Everything is batched over layers with tensor ops; the same code runs on CPU and CUDA. The loops
that remain are over the group's layers (G), the slot rounds (≤ G·Vmax), conflict-repair passes
refinement sweeps and the log₂(groups) levels of the vExpert-count search — never over layers,
experts or GPUs. ``static=True`` fixes every shape by
the configuration so that :class:`GraphedAllocator` can capture the whole allocation in one CUDA
graph (0.5–0.65 ms on an H200 for DeepSeek-V3 at EP64).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.gc_heap import collector_paused
from vexpert_runtime.policy.perf_model import InferenceConstants, h2d_time, predicted_layer_time
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, validate_base_placement
from vexpert_runtime.policy.profile import PerformanceProfile


@dataclass(frozen=True)
class AllocatorConfig:
    """Knobs of the allocator (paper defaults)."""

    group_size: int = 2  # G: consecutive layers sharing one slot budget
    vmax: int = 1  # per-layer vExpert budget per GPU; a group has G·vmax slots per GPU
    balance_threshold: float = 0.7  # τ: layers with L_i above it get no vExperts
    max_copies_per_expert: int = 16  # cap on copies of one expert (resident + slots); bounds the replica table
    share_refinement_sweeps: int = 6  # water-filling sweeps for replica token shares
    use_cost_model: bool = True  # False: fill the budget on every imbalanced layer (no Eq. 5 search)
    # V_l + V_{l+1} ≤ S for adjacent layers (and the wrap to layer 0): what layer-ahead streaming
    # into one set of S slots needs. False = the paper's group budget only (for comparison).
    adjacency_bound: bool = True

    def validate(self) -> None:
        if self.group_size < 1:
            raise VExpertInputError("group_size", f"must be ≥ 1, got {self.group_size}")
        if self.vmax < 0:
            raise VExpertInputError("vmax", f"must be ≥ 0, got {self.vmax}")
        if self.max_copies_per_expert < 1:
            raise VExpertInputError("max_copies_per_expert", f"must be ≥ 1, got {self.max_copies_per_expert}")
        if not 0.0 <= self.balance_threshold <= 1.0:
            raise VExpertInputError("balance_threshold", f"must be in [0, 1], got {self.balance_threshold}")

    @property
    def slots_per_gpu(self) -> int:
        """S = G·vmax: vExpert slots per GPU in all (the HBM cost is S · M_expert)."""
        return self.group_size * self.vmax


@dataclass(frozen=True)
class Plan:
    """The allocator's output for one allocation step. ``L`` layers, ``E`` experts, ``N`` GPUs,
    ``S = G·vmax`` slots per GPU per group, ``R`` = most copies any expert has.

    Attributes:
        vexperts: [L] int64, V_i — vExperts per GPU streamed for layer i.
        slot_expert: [L, N, S] int64 — logical expert held by slot s of GPU g while layer i runs,
            −1 if unused. One set of S slots per GPU serves every layer, alternating: even layers
            fill [0, V_i) from the bottom, odd layers [S − V_i, S) from the top, so the two layers
            streamed at once (layer i computing, layer i + 1 filling) are disjoint whenever
            V_i + V_{i+1} ≤ S (see :func:`layer_slots`).
        base_gpu: [L, E] int64 — GPU holding the resident copy of each expert.
        replica_gpu: [L, E, R] int64 — GPU of each copy (copy 0 is the resident one), −1 padded.
        replica_slot: [L, E, R] int64 — slot index of each copy, −1 for the resident copy/padding.
        replica_share: [L, E, R] float32 — fraction of the expert's tokens sent to each copy; rows
            sum to 1 (0 on padding).
        balance_before: [L] float32 — balance ratio of the base placement on the input counts.
        balance_predicted: [L] float32 — balance ratio of this plan on the input counts.
    """

    vexperts: torch.Tensor
    slot_expert: torch.Tensor
    base_gpu: torch.Tensor
    replica_gpu: torch.Tensor
    replica_slot: torch.Tensor
    replica_share: torch.Tensor
    balance_before: torch.Tensor
    balance_predicted: torch.Tensor

    @property
    def num_gpus(self) -> int:
        return int(self.slot_expert.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        return int(self.slot_expert.shape[2])

    def logcnt(self) -> torch.Tensor:
        """[L, E] int64: copies of each logical expert (EPLB's logcnt)."""
        return (self.replica_gpu >= 0).sum(-1)

    def expert_gpu_share(self) -> torch.Tensor:
        """[L, E, N] float32: fraction of each expert's tokens computed on each GPU."""
        num_layers, num_experts, _ = self.replica_gpu.shape
        out = torch.zeros(num_layers, num_experts, self.num_gpus + 1, device=self.replica_gpu.device)
        index = torch.where(self.replica_gpu >= 0, self.replica_gpu, self.num_gpus)
        out.scatter_add_(-1, index, self.replica_share)
        return out[..., : self.num_gpus]

    def physical_ids(self) -> torch.Tensor:
        """[L, E, R] int64: physical expert id of each copy, −1 padded.

        GPU g owns physical ids ``g·(E/N + S) + j``: ``j < E/N`` are its resident experts in
        ascending logical order, ``j = E/N + s`` is slot s.
        """
        _num_layers, num_experts, _ = self.replica_gpu.shape
        per_gpu = num_experts // self.num_gpus
        stride = per_gpu + self.slots_per_gpu
        # rank of each expert among the resident experts of its GPU (ascending logical id)
        order = torch.argsort(self.base_gpu * num_experts + torch.arange(num_experts, device=self.base_gpu.device), dim=1)
        local = torch.empty_like(order)
        local.scatter_(1, order, torch.arange(num_experts, device=order.device).remainder(per_gpu).expand_as(order).contiguous())
        local_index = torch.where(
            self.replica_slot >= 0,
            per_gpu + self.replica_slot,
            local.unsqueeze(-1).expand_as(self.replica_slot),
        )
        phys = self.replica_gpu * stride + local_index
        return torch.where(self.replica_gpu >= 0, phys, -1)

    def phy2log(self) -> torch.Tensor:
        """[L, N·(E/N + S)] int64: logical expert of every physical expert, −1 for an empty slot."""
        num_layers, num_experts, _ = self.replica_gpu.shape
        total = self.num_gpus * (num_experts // self.num_gpus + self.slots_per_gpu)
        out = torch.full((num_layers, total + 1), -1, dtype=torch.int64, device=self.replica_gpu.device)
        phys = self.physical_ids()
        logical = torch.arange(num_experts, device=phys.device).view(1, -1, 1).expand_as(phys)
        out.scatter_(1, torch.where(phys >= 0, phys, total).reshape(num_layers, -1), logical.reshape(num_layers, -1))
        return out[:, :total]

    def streamed_experts(self) -> int:
        """vExpert copies streamed per decode iteration (over all layers and GPUs)."""
        return int((self.slot_expert >= 0).sum())

    def to(self, device: str | torch.device) -> Plan:
        return Plan(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


# --------------------------------------------------------------------------------------------
# Step 1: group-wise vExpert number assignment (Algorithm 2, Eq. 5)
# --------------------------------------------------------------------------------------------


def assign_vexpert_counts(
    balance: torch.Tensor,
    config: AllocatorConfig,
    profile: PerformanceProfile,
    consts: InferenceConstants,
) -> torch.Tensor:
    """V_i per layer: minimise Σ_i T*_i(L_i, V_i) (Eq. 2) subject to Σ_group V_i ≤ G·vmax and,
    with ``config.adjacency_bound``, V_l + V_{l+1} ≤ S for every pair of adjacent layers.

    Layers with L_i > τ are fixed at 0 and donate their budget to the rest of their group. Inside
    a group the budget already bounds every pair, so the adjacency bound only adds the pairs
    across group boundaries and the wrap from the last layer to layer 0 of the next iteration.
    With L odd, layers L−1 and 0 are both even (both fill from the bottom), so their slots meet
    whenever both stream: that pair is allowed but charged (layer 0's copies cannot start before
    layer L−1 ends: (1−η)·T_H2D(V_0) more than Eq. 2 assumes; nothing without the cost model).

    The search is exact: a per-group DP gives each group's best cost for every (V of the previous
    group's last layer, V of its own last layer) — a (S+1)² "transfer" matrix — and the cyclic
    chain of groups is solved by min-plus products in log₂(groups) levels, then walked back.
    Fixed shapes, no host reads (CUDA-graph safe).

    Args: balance [L] float. Returns [L] int64.
    """
    num_layers = balance.shape[0]
    group, budget = config.group_size, config.slots_per_gpu
    dev = balance.device
    if budget == 0 or num_layers == 0:
        return torch.zeros(num_layers, dtype=torch.int64, device=dev)
    num_groups = -(-num_layers // group)
    padded = num_groups * group
    bal = torch.ones(padded, device=dev)
    bal[:num_layers] = balance.to(torch.float32)
    candidates = torch.arange(budget + 1, device=dev)
    if config.use_cost_model:
        cost = predicted_layer_time(bal.unsqueeze(1), candidates.unsqueeze(0), profile, consts)  # [P, V+1]
    else:
        # Without the model every imbalanced layer wants vExperts; the small convex term makes
        # the search spread the group budget evenly instead of piling it on one layer.
        v = candidates.to(torch.float32)
        cost = (-v + 0.01 * v * v).unsqueeze(0).expand(padded, -1).clone()
    # Padding layers are masked explicitly: with τ = 1 their balance 1.0 would pass the τ filter.
    padding = torch.arange(padded, device=dev) >= num_layers
    filtered = (bal > config.balance_threshold) | padding
    cost = torch.where(filtered.unsqueeze(1) & (candidates.unsqueeze(0) > 0), float("inf"), cost)
    # Index in its group of each group's last real layer (the final group may end in padding).
    last = torch.full((num_groups,), group - 1, dtype=torch.int64, device=dev)
    last[-1] = (num_layers - 1) - (num_groups - 1) * group
    wrap_charge = torch.zeros(budget + 1, device=dev)
    if config.use_cost_model:
        hw = profile.hardware
        wrap_charge = (1.0 - hw.contention_eta) * h2d_time(candidates, consts, hw)
    boundary = _boundary_cost(num_groups, num_layers, budget, config.adjacency_bound, wrap_charge)
    v = _cyclic_group_argmin(cost.view(num_groups, group, budget + 1), last, boundary)
    return v.reshape(padded)[:num_layers]


def _boundary_cost(
    num_groups: int, num_layers: int, budget: int, bound: bool, wrap_charge: torch.Tensor
) -> torch.Tensor:
    """Cost of entering group g with V = f on its first layer after V = p on the layer before it.

    0 where the two layers' slots are disjoint, inf where the adjacency bound forbids the pair,
    and for the wrap into group 0 with L odd (same parity: overlap iff both stream) the charge
    ``wrap_charge[f]``.

    Args: wrap_charge [S+1]. Returns [groups, p = S+1, f = S+1] float32.
    """
    dev = wrap_charge.device
    width = budget + 1
    out = torch.zeros(num_groups, width, width, device=dev)
    if not bound:
        return out
    v = torch.arange(width, device=dev)
    pair = v.view(-1, 1) + v.view(1, -1)  # [p, f]
    out[:] = torch.where(pair > budget, float("inf"), 0.0)
    if num_layers % 2:
        both = (v.view(-1, 1) > 0) & (v.view(1, -1) > 0)
        out[0] = torch.where(both, wrap_charge.view(1, -1), 0.0)
    return out


def _budget_dp(cost: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """min Σ_j cost[g, j, v_j] subject to Σ_j v_j ≤ b, for every group g and every budget b.

    G steps of a (budget+1)² min-plus product, so the work grows as G·budget², not as the
    (budget+1)^G combinations. Ties go to the smaller v.

    Args: cost [groups, G, W] (inf = not allowed, W = budget + 1).
    Returns best [groups, W] and the choices of each step [groups, W] (for :func:`_budget_walk_back`).
    """
    groups, group, width = cost.shape
    b = torch.arange(width, device=cost.device)
    take = b.view(1, -1) - b.view(-1, 1)  # [v, b]: budget left before this layer = b − v
    allowed = take >= 0
    best = torch.zeros(groups, width, device=cost.device)  # best[b]: min cost of the layers so far within b
    choices = []
    for j in range(group):
        prev = best[:, take.clamp(min=0)]  # [groups, v, b]
        total = torch.where(allowed, prev + cost[:, j, :].unsqueeze(-1), float("inf"))
        best, choice = total.min(dim=1)  # over v; the first (smallest) v wins ties
        choices.append(choice)  # [groups, b]
    return best, choices


def _budget_walk_back(choices: list[torch.Tensor], left: torch.Tensor) -> torch.Tensor:
    """The v of each step of :func:`_budget_dp` for a budget ``left`` [groups]. Returns [groups, G]."""
    left = left.view(-1, 1)
    picked = []
    for j in reversed(range(len(choices))):
        v = torch.gather(choices[j], 1, left)
        picked.append(v)
        left = left - v
    return torch.cat(picked[::-1], dim=1)


def _cyclic_group_argmin(cost: torch.Tensor, last: torch.Tensor, boundary: torch.Tensor) -> torch.Tensor:
    """Exact min over all layers of Σ cost[g, j, v] + Σ_g boundary[g, p_g, f_g] subject to each
    group's budget, where f_g is group g's first V and p_g the V of the previous group's last real
    layer (cyclically: group 0 follows the last group).

    Per group, :func:`_budget_dp` over the layers other than the first and the last real one gives
    the group's cost for every (first f, last q): ``inner[g, f, q]``. Folding in the boundary,
    ``transfer[g, p, q] = min_f boundary[g, p, f] + inner[g, f, q]`` is a (S+1)² matrix per group, and
    the cycle's optimum is the smallest diagonal entry of their min-plus product, computed as a
    balanced tree (log₂ groups levels) whose argmins are walked back top-down.

    Args: cost [groups, G, W] (W = S + 1); last [groups] int64 index of the last real layer in
        each group; boundary [groups, W, W]. Returns v [groups, G] int64.
    """
    groups, group, width = cost.shape
    dev = cost.device
    budget = width - 1
    vals = torch.arange(width, device=dev)
    gidx = torch.arange(groups, device=dev)
    # The inner layers: everything but the first and the last real layer, those forced to 0 at no cost.
    ends = (torch.arange(group, device=dev).view(1, -1) == 0) | (torch.arange(group, device=dev).view(1, -1) == last.view(-1, 1))
    forced_zero = torch.where(vals == 0, 0.0, float("inf")).view(1, 1, -1)
    best_inner, choices = _budget_dp(torch.where(ends.unsqueeze(-1), forced_zero, cost))
    first_cost = cost[:, 0, :]  # [groups, f]
    last_cost = cost[gidx, last, :]  # [groups, q]
    single = (last == 0).view(-1, 1, 1)  # the first layer is also the last real one: f = q
    f, q = vals.view(1, -1, 1), vals.view(1, 1, -1)
    q_used = torch.where(single, 0, q)  # budget the last layer takes beyond the first
    left = budget - f - q_used  # [groups, f, q]
    inner = first_cost.unsqueeze(2) + torch.where(single, 0.0, last_cost.unsqueeze(1))
    inner = inner + torch.gather(best_inner, 1, left.clamp(min=0).reshape(groups, -1)).view(groups, width, width)
    feasible = (left >= 0) & (~single | (f == q))
    inner = torch.where(feasible, inner, float("inf"))
    transfer, first = (boundary.unsqueeze(-1) + inner.unsqueeze(1)).min(dim=2)  # [groups, p, q] over f
    start, end = _cyclic_chain(transfer)
    f_pick = first[gidx, start, end]
    v = _budget_walk_back(choices, budget - f_pick - torch.where(last == 0, 0, end))
    v[:, 0] = f_pick
    v.scatter_(1, last.view(-1, 1), end.view(-1, 1))
    return v


def _cyclic_chain(transfer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal closed walk through ``transfer`` [n, W, W] (state → state costs): the states before
    and after each step, start [n] and end [n] int64, with end[g] = start[g+1] and end[n−1] = start[0].

    Min-plus products in a balanced tree (n padded to a power of two with the min-plus identity),
    keeping each product's argmin middle state; the walk back splits each (start, end) pair at its
    middle state level by level. Ties go to the smaller state.
    """
    n, width, _ = transfer.shape
    dev = transfer.device
    size = 1 << max(0, (n - 1).bit_length())
    identity = torch.full((width, width), float("inf"), device=dev)
    identity.diagonal().zero_()
    mats = torch.cat([transfer, identity.expand(size - n, width, width)])
    middles = []
    while mats.shape[0] > 1:
        mats, middle = (mats[0::2].unsqueeze(-1) + mats[1::2].unsqueeze(1)).min(dim=2)  # [k, a, c] over b
        middles.append(middle)
    state = mats[0].diagonal().argmin().view(1)
    start, end = state, state
    for middle in reversed(middles):
        mid = middle[torch.arange(middle.shape[0], device=dev), start, end]
        start = torch.stack([start, mid], dim=1).flatten()
        end = torch.stack([mid, end], dim=1).flatten()
    return start[:n], end[:n]


# --------------------------------------------------------------------------------------------
# Step 2: candidate selection — how many copies each expert gets
# --------------------------------------------------------------------------------------------
#
# Every step below has a "static" mode (``static=True``): tensor shapes depend only on the
# configuration and the input shape, never on values, and no result is read back to the host.
# That is what lets :class:`GraphedAllocator` capture the whole allocation in one CUDA graph.
# On the CPU, reading values back is free, so the default mode sizes tensors to the data.


def replica_counts(
    counts: torch.Tensor,
    extra: torch.Tensor,
    num_gpus: int,
    eligible: torch.Tensor | None = None,
    max_copies: int | None = None,
    max_extra: int | None = None,
) -> torch.Tensor:
    """Copies per expert: greedily give the next copy to the expert with the largest load per copy.

    The greedy's picks are exactly the ``extra_i`` largest values of ``w_e / c`` over c = 1, 2, …
    (each expert's sequence is decreasing), so one top-k replaces the loop. Experts with no load
    or not ``eligible`` (not in the host pool) get no extra copy; no expert gets more than
    ``max_copies`` copies (default N) or more than one per GPU.

    Args: counts [L, E] float; extra [L] int64 (V_i·N); eligible [L, E] bool or None;
        max_extra: a static upper bound of ``extra`` (static mode), None = read it from ``extra``.
    Returns copies [L, E] int64, 1 ≤ copies ≤ min(N, max_copies).
    """
    num_layers, num_experts = counts.shape
    copies = torch.ones(num_layers, num_experts, dtype=torch.int64, device=counts.device)
    static = max_extra is not None
    bound_extra: int = max_extra if max_extra is not None else (int(extra.max()) if extra.numel() else 0)
    cap = min(num_gpus, max_copies or num_gpus)
    depth = min(cap - 1, bound_extra)
    if depth <= 0 or bound_extra <= 0:
        return copies
    w = counts.to(torch.float32)
    if eligible is not None:
        w = torch.where(eligible, w, torch.zeros_like(w))
    # Only experts among the bound_extra heaviest can win a copy (w_e ≥ w_e / c), so rank those.
    top = min(bound_extra, num_experts)
    cand_load, cand_expert = w.topk(top, dim=1)  # [L, top], descending
    if not static and top == bound_extra:
        # The first copies of those `top` experts are all ≥ cand_load[:, -1], so the bound_extra
        # largest values (all the greedy takes) are too: no expert gets more than
        # w_max / cand_load[:, -1] extra copies. (With top = E < bound_extra the greedy goes below
        # the lightest expert's load, and the bound does not hold.)
        floor = cand_load[:, -1]
        if bool((floor > 0).all()):
            depth = max(1, min(depth, int(torch.ceil(cand_load[:, 0] / floor).max())))
    divisors = torch.arange(1, depth + 1, device=counts.device, dtype=torch.float32)
    value = cand_load.unsqueeze(-1) / divisors  # [L, top, depth]
    k = min(bound_extra, top * depth)
    top_value, top_index = value.view(num_layers, -1).topk(k, dim=1)
    take = (torch.arange(k, device=counts.device).unsqueeze(0) < extra.unsqueeze(1)) & (top_value > 0)
    expert = torch.gather(cand_expert, 1, top_index // depth)
    copies.scatter_add_(1, expert, take.to(torch.int64))
    return copies


# --------------------------------------------------------------------------------------------
# Step 3: greedy physical rebalancing — place copies on GPUs
# --------------------------------------------------------------------------------------------


def _replica_items(copies: torch.Tensor, counts: torch.Tensor, max_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Extra copies as a list per layer, heaviest (load per copy) first; an expert with c copies
    appears c − 1 times in a row.

    Returns item_expert [L, K] int64 (−1 padded) and item_load [L, K] float32 (0 padded), K = max_items.
    """
    num_layers, _ = copies.shape
    extra = copies - 1
    per_copy = torch.where(extra > 0, counts.to(torch.float32) / copies, -1.0)
    # At most max_items experts have extra copies, so the top max_items by load per copy suffice.
    # top-k is not stable, so ties are broken by expert id explicitly (the perturbation, < 1/4096,
    # is below the gap between distinct values w/c of integer counts with c ≤ 64).
    tie_break = torch.arange(per_copy.shape[1], device=per_copy.device, dtype=torch.float64) * 1e-7
    _, order = (per_copy.to(torch.float64) - tie_break).topk(min(max_items, per_copy.shape[1]), dim=1)
    order_load = torch.gather(per_copy, 1, order)
    repeats = torch.gather(extra, 1, order)
    ends = repeats.cumsum(1)  # item positions [ends − repeats, ends) belong to order[:, j]
    position = torch.arange(max_items, device=copies.device).unsqueeze(0).expand(num_layers, -1).contiguous()
    j = torch.searchsorted(ends, position, right=True).clamp(max=order.shape[1] - 1)
    real = position < ends[:, -1:]
    item_expert = torch.where(real, torch.gather(order, 1, j), -1)
    item_load = torch.where(real, torch.gather(order_load, 1, j), torch.zeros_like(order_load[:, :1]).expand_as(j))
    return item_expert, item_load


def place_replicas(
    counts: torch.Tensor,
    base_gpu: torch.Tensor,
    copies: torch.Tensor,
    vexperts: torch.Tensor,
    num_gpus: int,
    rounds: int | None = None,
) -> torch.Tensor:
    """Assign every extra copy to a GPU slot, heaviest first onto the least-loaded GPU.

    Each GPU has ``V_i`` slots in layer i. Round r (r < V_i) hands the next N copies to the N GPUs
    in ascending order of current load (with one free slot per GPU per round this is exactly the
    sequential greedy). A copy that would land on a GPU already holding its expert swaps GPUs with
    a neighbour in that order (:func:`_fix_conflicts`); one that still conflicts is dropped (its
    slot stays empty): an expert is never placed twice on one GPU.

    Args: counts [L, E]; base_gpu [L, E]; copies [L, E]; vexperts [L];
        rounds: static number of rounds (≥ max V_i), None = read max V_i.
    Returns slot_expert_local [L, N, rounds] int64 (−1 empty): expert in the layer's r-th slot of GPU g.
    """
    num_layers, num_experts = counts.shape
    dev = counts.device
    static = rounds is not None
    if rounds is None:
        rounds = int(vexperts.max()) if vexperts.numel() else 0
    slots = torch.full((num_layers, num_gpus, rounds), -1, dtype=torch.int64, device=dev)
    if rounds == 0:
        return slots
    item_expert, item_load = _replica_items(copies, counts, rounds * num_gpus)
    per_copy = counts.to(torch.float32) / copies
    load = base_gpu_loads(per_copy, base_gpu, num_gpus)  # [L, N]
    sentinel = num_experts  # "no expert": never resident anywhere, never in a slot
    holds = _Holdings(torch.cat([base_gpu, base_gpu.new_full((num_layers, 1), -1)], dim=1), slots)
    for r in range(rounds):
        expert = item_expert[:, r * num_gpus : (r + 1) * num_gpus]  # [L, N] heaviest first
        weight = item_load[:, r * num_gpus : (r + 1) * num_gpus]
        active = (r < vexperts).unsqueeze(1) & (expert >= 0)
        expert_index = torch.where(active, expert, sentinel)
        gpu = torch.argsort(load, dim=1, stable=True)  # [L, N] least loaded first
        holds.rounds = r  # rounds before r are placed
        gpu, conflict = _fix_conflicts(gpu, expert_index, holds, sentinel, static=static)
        placed = ~conflict & (expert_index != sentinel)
        weight = torch.where(placed, weight, torch.zeros_like(weight))
        slots[:, :, r] = torch.full_like(gpu, -1).scatter(1, gpu, torch.where(placed, expert_index, -1))
        load.scatter_add_(1, gpu, weight)
    return slots


@dataclass
class _Holdings:
    """Does GPU g hold expert e in layer l (resident, or in a slot of an earlier round)?

    Computed from the placement itself instead of an [L, N, E] table: base_ext [L, E+1] (the
    sentinel column is −1, on no GPU) and slots [L, N, rounds] (rounds < ``rounds`` are final).
    """

    base_ext: torch.Tensor
    slots: torch.Tensor
    rounds: int = 0

    def __call__(self, layer: torch.Tensor, gpu: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Broadcastable index tensors → bool of their broadcast shape."""
        held = self.base_ext[layer, expert] == gpu
        for q in range(self.rounds):
            held = held | (self.slots[:, :, q][layer, gpu] == expert)
        return held


def _fix_conflicts(
    gpu: torch.Tensor, expert: torch.Tensor, holds: _Holdings, sentinel: int, passes: int = 3, static: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-pair copies with GPUs so that no copy lands where its expert already is.

    Each pass lets every conflicting copy (position p in load order) pick the nearest position q
    whose swap leaves both sides conflict-free and whose copy is not itself in conflict; when
    several pick the same q, the lowest p wins. Swaps in one pass are disjoint, so they apply at
    once; then conflicting copies that fix each other swap (:func:`_swap_conflicting_pairs`).
    Conflicts are rare (tens among thousands of copies) and go in the first pass.

    Args: gpu [L, N] GPU paired with each position; expert [L, N] (sentinel = none);
        holds: which GPU already holds which expert; static: examine every position in every pass (no host read-back)
        instead of only the conflicting ones.
    Returns the new gpu [L, N] and the still-conflicting mask [L, N].
    """
    num_layers, n = gpu.shape
    dev = gpu.device
    layer2 = torch.arange(num_layers, device=dev).view(-1, 1)
    pos = torch.arange(n, device=dev)
    far = n + 1
    for _ in range(passes):
        conflict = holds(layer2, gpu, expert) & (expert != sentinel)
        if static:  # one row per (layer, position); rows without a conflict are switched off
            row_l = torch.arange(num_layers, device=dev).repeat_interleave(n)
            row_p = pos.repeat(num_layers)
            row_on = conflict.flatten()
        else:
            if not bool(conflict.any()):
                break
            row_l, row_p = torch.nonzero(conflict, as_tuple=True)
            row_on = torch.ones_like(row_l, dtype=torch.bool)
        their_gpu, their_expert = gpu[row_l], expert[row_l]  # [R, N]: every position of the row's layer
        my_gpu, my_expert = gpu[row_l, row_p], expert[row_l, row_p]  # [R]
        mine_fits = ~holds(row_l.unsqueeze(1), their_gpu, my_expert.unsqueeze(1))  # my expert on q's GPU
        theirs_fits = ~holds(row_l.unsqueeze(1), my_gpu.unsqueeze(1), their_expert) | (their_expert == sentinel)
        ok = mine_fits & theirs_fits & ~conflict[row_l] & row_on.unsqueeze(1)
        distance = (pos.unsqueeze(0) - row_p.unsqueeze(1)).abs()
        best, partner = torch.where(ok, distance, far).min(dim=1)  # [R]
        wants = row_on & (best < far)
        flat_partner = row_l * n + partner
        claim = torch.where(wants, row_p, n)
        winner = torch.full((num_layers * n,), n, dtype=torch.int64, device=dev)
        winner.scatter_reduce_(0, flat_partner, claim, reduce="amin")
        won = wants & (winner[flat_partner] == row_p)
        # Claimed partners q take their winner's GPU; winners p take their partner's GPU. The
        # scatter below writes each winner once (losers go to a spare cell that is cut off).
        src = torch.where(winner < n, winner, pos.repeat(num_layers))
        src = torch.cat([src, src.new_zeros(1)])
        src.scatter_(0, torch.where(won, row_l * n + row_p, num_layers * n), torch.where(won, partner, 0))
        gpu = torch.gather(gpu, 1, src[:-1].view(num_layers, n))
        gpu = _swap_conflicting_pairs(gpu, expert, holds, sentinel, static)
    conflict = holds(layer2, gpu, expert) & (expert != sentinel)
    return gpu, conflict


def _swap_conflicting_pairs(
    gpu: torch.Tensor, expert: torch.Tensor, holds: _Holdings, sentinel: int, static: bool
) -> torch.Tensor:
    """Swap two conflicting copies with each other where that fixes both (each may sit on the
    other's free GPU: with N = 2 there is no third position to swap with). A copy pairs with its
    nearest such partner and only mutual choices swap, so the swaps are disjoint.

    Args: gpu, expert [L, N] as in :func:`_fix_conflicts`. Returns the new gpu [L, N].
    """
    num_layers, n = gpu.shape
    dev = gpu.device
    layer3 = torch.arange(num_layers, device=dev).view(-1, 1, 1)
    conflict = holds(layer3[:, :, 0], gpu, expert) & (expert != sentinel)  # [L, N]
    if not static and not bool(conflict.any()):
        return gpu
    # [L, p, q]: p's expert fits on q's GPU and q's expert on p's, both in conflict now
    mine_fits = ~holds(layer3, gpu.unsqueeze(1), expert.unsqueeze(2))
    theirs_fits = ~holds(layer3, gpu.unsqueeze(2), expert.unsqueeze(1))
    ok = conflict.unsqueeze(2) & conflict.unsqueeze(1) & mine_fits & theirs_fits
    pos = torch.arange(n, device=dev)
    distance = (pos.view(1, -1) - pos.view(-1, 1)).abs().expand(num_layers, -1, -1)
    best, partner = torch.where(ok, distance, n + 1).min(dim=2)  # [L, N]
    mutual = (best <= n) & (torch.gather(partner, 1, partner) == pos.unsqueeze(0))
    src = torch.where(mutual, partner, pos.unsqueeze(0))
    return torch.gather(gpu, 1, src)


# --------------------------------------------------------------------------------------------
# Step 4: token shares — water-filling over the GPUs holding each expert
# --------------------------------------------------------------------------------------------


def water_fill_shares(
    counts: torch.Tensor, replica_gpu: torch.Tensor, num_gpus: int, sweeps: int, max_replicated: int | None = None
) -> torch.Tensor:
    """Split each replicated expert's tokens over its copies so that their GPUs end up level.

    Starts from an even split. Each sweep recomputes GPU loads and moves every replicated expert
    toward the water-filling split of its load over its holders given everyone else's shares.
    Experts sharing a GPU move at the same time, so each step is scaled by 1 / (most replicated
    experts on any of its GPUs, see below); that keeps the parallel update from overshooting.
    This is block-coordinate descent on Σ load², whose minimiser also levels the maximum.

    Most replicated experts have exactly two copies, so they are handled as a narrow [P, 2] block
    and the few with more as a [P', R] block: the same arithmetic on a quarter of the elements.

    Args: counts [L, E]; replica_gpu [L, E, R] (−1 padded);
        max_replicated: static mode: extra copies per layer at most (S·N slots), so at most
            min(E, that) experts are replicated and at most min(E, that // 2) have > 2 copies.
    Returns share [L, E, R] float32.
    """
    num_layers, num_experts, width = replica_gpu.shape
    dev = counts.device
    valid = replica_gpu >= 0
    copies = valid.sum(-1)
    share = valid.to(torch.float32) / copies.clamp(min=1).unsqueeze(-1)
    w = counts.to(torch.float32)
    replicated = (copies > 1) & (w > 0)
    if sweeps <= 0 or width < 2:
        return share
    bins = num_gpus + 1  # last bin per layer swallows padding
    fixed = torch.zeros(num_layers, bins, device=dev)
    fixed.scatter_add_(1, replica_gpu[:, :, 0], torch.where(replicated, 0.0, w))
    fixed = fixed.flatten()
    pair = replicated & (copies == 2)
    many = replicated & (copies > 2)
    blocks = []
    for mask, cols, bound in ((pair, 2, max_replicated), (many, width, None if max_replicated is None else max_replicated // 2)):
        if cols > width:
            continue
        blk = _ShareBlock.gather(mask, replica_gpu[:, :, :cols], w, share[:, :, :cols], None if bound is None else min(bound, num_experts), num_gpus)
        if blk is not None:
            blocks.append(blk)
    if not blocks:
        return share
    degree = torch.zeros_like(fixed)
    for blk in blocks:
        degree.scatter_add_(0, blk.flat_bin, blk.valid.to(torch.float32).flatten())
    for blk in blocks:
        holder_degree = torch.where(blk.valid, degree[blk.bin], torch.ones_like(blk.share))
        # 0.6 rather than 1: not every co-located expert pushes the same way; measured on DeepSeek-V3
        # loads this converges fastest without overshoot.
        blk.step = 1.0 / (0.6 * holder_degree.amax(-1, keepdim=True)).clamp(min=1.0)
    for _ in range(sweeps):
        load = fixed
        for blk in blocks:
            blk.mine = blk.w * blk.share
            load = load.scatter_add(0, blk.flat_bin, blk.mine.flatten())
        for blk in blocks:
            other = load[blk.bin] - blk.mine + blk.pad_floor
            target = _water_fill(other, blk.w.squeeze(-1)) * blk.inv_w
            # Heavy-ball momentum (0.3) speeds the damped update up: 6 sweeps level DeepSeek-V3
            # loads as well as 8 plain ones (0.899 vs 0.897) at no loss on random skews. Padding
            # copies and inactive rows have target 0 and start at 0 (inactive rows are discarded).
            stepped = (blk.share + blk.step * (target - blk.share) + MOMENTUM * (blk.share - blk.previous)).clamp(min=0)
            blk.previous, blk.share = blk.share, stepped
    for blk in blocks:
        rows = blk.share / blk.share.sum(-1, keepdim=True).clamp(min=1e-12)
        cols = rows.shape[-1]
        old = share[blk.layer, blk.expert]  # [P, R]
        if blk.active is not None:
            rows = torch.where(blk.active.unsqueeze(-1), rows, old[:, :cols])
        if cols < width:
            rows = torch.cat([rows, old[:, cols:]], dim=-1)
        share = share.index_put((blk.layer, blk.expert), rows)
    return share


@dataclass
class _ShareBlock:
    """Replicated experts of one width, flattened to rows [P, C] for the water-filling sweeps."""

    layer: torch.Tensor  # [P] layer of each row
    expert: torch.Tensor  # [P] expert of each row
    active: torch.Tensor | None  # [P] bool; None = every row is real (dynamic selection)
    bin: torch.Tensor  # [P, C] global load bin (layer·(N+1) + GPU; padding → the layer's spare bin)
    flat_bin: torch.Tensor  # [P·C]
    valid: torch.Tensor  # [P, C] bool
    w: torch.Tensor  # [P, 1] tokens of the expert
    inv_w: torch.Tensor  # [P, 1]
    share: torch.Tensor  # [P, C]
    previous: torch.Tensor  # [P, C] (momentum)
    pad_floor: torch.Tensor  # [P, C] 0, or 1e30 on padding so it never gets water
    step: torch.Tensor  # [P, 1] damping of this row's update (set from GPU degrees)
    mine: torch.Tensor  # [P, C] this row's tokens on each copy during a sweep

    @staticmethod
    def gather(
        mask: torch.Tensor, replica_gpu: torch.Tensor, w: torch.Tensor, share: torch.Tensor, k: int | None, num_gpus: int
    ) -> _ShareBlock | None:
        """Rows for the experts in ``mask`` [L, E]: exactly those (``k`` None), or a fixed ``k``
        per layer with the unused ones marked inactive (static shapes, for CUDA graphs)."""
        num_layers = mask.shape[0]
        if k is None:
            layer, expert = torch.nonzero(mask, as_tuple=True)
            if layer.numel() == 0:
                return None
            active = None
            real = torch.ones_like(layer, dtype=torch.bool)
        else:
            if k == 0:
                return None
            flags, chosen = mask.to(torch.int8).topk(k, dim=1)
            layer = torch.arange(num_layers, device=mask.device).repeat_interleave(k)
            expert = chosen.flatten()
            active = real = flags.flatten().bool()
        gpu = replica_gpu[layer, expert]  # [P, C]
        valid = (gpu >= 0) & real.unsqueeze(-1)
        bins = torch.where(valid, gpu, num_gpus) + (layer * (num_gpus + 1)).unsqueeze(-1)
        weight = w[layer, expert].unsqueeze(1).clamp(min=1e-12)
        rows = share[layer, expert]
        pad_floor = torch.where(valid, 0.0, 1.0e30).to(rows.dtype)
        return _ShareBlock(
            layer, expert, active, bins, bins.flatten(), valid, weight, 1.0 / weight, rows, rows, pad_floor,
            step=torch.ones_like(weight), mine=weight * rows,
        )


MOMENTUM = 0.3


def _water_fill(other: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """Pour ``amount`` onto bins whose floors are ``other``: returns max(0, λ − other) with
    Σ = amount. other [..., R] (huge values mark missing bins), amount [...]. Returns [..., R]."""
    if other.shape[-1] == 2:  # two bins: λ = (amount + o1 + o2) / 2 unless one bin stays dry
        lo, hi = other[..., 0], other[..., 1]
        first = ((amount + hi - lo) * 0.5).clamp(min=0).minimum(amount)
        return torch.stack([first, amount - first], dim=-1)
    sorted_other, _ = other.sort(dim=-1)
    k = torch.arange(1, other.shape[-1] + 1, device=other.device, dtype=other.dtype)
    level = (amount.unsqueeze(-1) + sorted_other.cumsum(-1)) / k  # λ if the k lowest bins are wet
    wet = level > sorted_other
    # The wet bins form a prefix; the true level is the one of the largest wet k.
    last = (wet.sum(-1, keepdim=True) - 1).clamp(min=0)
    lam = torch.gather(level, -1, last)
    return (lam - other).clamp(min=0)


# --------------------------------------------------------------------------------------------
# Algorithm 1: the whole mapping
# --------------------------------------------------------------------------------------------


def allocate(
    counts: torch.Tensor,
    base_gpu: torch.Tensor,
    num_gpus: int,
    config: AllocatorConfig | None = None,
    profile: PerformanceProfile | None = None,
    consts: InferenceConstants | None = None,
    pooled: torch.Tensor | None = None,
    static: bool = False,
) -> Plan:
    """Physical-to-virtual rebalancing for all layers at once (Algorithm 1).

    Args:
        counts: [L, E] tokens routed to each logical expert over the recent window (≥ 0).
        base_gpu: [L, E] int64 resident GPU of each expert (E / N per GPU).
        num_gpus: N.
        config: allocator knobs (G, vmax, τ).
        profile: performance-model coefficients (paper defaults if None).
        consts: inference constants C (DeepSeek-V3 decode defaults if None).
        pooled: [L, E] bool, experts present in the host pool (Np < E); None = all.
        static: shapes fixed by the configuration and no value read back to the host (what a CUDA
            graph needs; inputs are not validated — validate once before capturing).
    Returns: a :class:`Plan`.
    """
    config = config or AllocatorConfig()
    profile = profile or PerformanceProfile()
    consts = consts or InferenceConstants(experts_per_gpu=max(1, counts.shape[-1] // max(1, num_gpus)))
    if not static:
        config.validate()
        validate_counts(counts, base_gpu)
        validate_base_placement(base_gpu, num_gpus)
    slots_total = config.slots_per_gpu
    w = counts.to(torch.float32)
    balance_before = balance_ratio(base_gpu_loads(w, base_gpu, num_gpus))
    vexperts = assign_vexpert_counts(balance_before, config, profile, consts)
    max_copies = min(num_gpus, config.max_copies_per_expert)
    copies = replica_counts(
        w, vexperts * num_gpus, num_gpus, pooled, max_copies, max_extra=slots_total * num_gpus if static else None
    )
    return plan_from_copies(w, base_gpu, copies, vexperts, num_gpus, config, balance_before, static)


def plan_from_copies(
    counts: torch.Tensor,
    base_gpu: torch.Tensor,
    copies: torch.Tensor,
    vexperts: torch.Tensor,
    num_gpus: int,
    config: AllocatorConfig,
    balance_before: torch.Tensor,
    static: bool = False,
) -> Plan:
    """Steps 3 and 4 for chosen copy counts: the extra copies placed into ``V_i`` slots per GPU of
    each layer (:func:`place_replicas`), laid out alternately in the ``S = G·vmax`` slots, and each
    replicated expert's tokens split over its copies by ``config.share_refinement_sweeps``
    water-filling sweeps (0 = an even split). Every placement policy that streams copies into the
    node's slots (vExpert, EPLB's redundant experts) ends here, so their plans obey the same limits.

    Args: counts [L, E] float32; base_gpu [L, E] int64; copies [L, E] int64 (≥ 1, ≤ min(N,
        max_copies_per_expert)); vexperts [L] int64 slots per GPU each layer may fill;
        balance_before [L] float32 (recorded in the plan); static: as in :func:`allocate`.
    """
    slots_total = config.slots_per_gpu
    max_copies = min(num_gpus, config.max_copies_per_expert)
    local_slots = place_replicas(counts, base_gpu, copies, vexperts, num_gpus, rounds=slots_total if static else None)
    # Placement may drop a copy (conflict), leaving a hole in an earlier round of a GPU whose later
    # round is filled: move each GPU's filled rounds to the front (stable), so the first V_i
    # rounds hold every placed copy; the copies actually placed define the plan.
    local_slots = local_slots.gather(2, (local_slots < 0).to(torch.int32).argsort(dim=2, stable=True))
    vexperts = (local_slots >= 0).sum(2).amax(1) if local_slots.shape[2] else torch.zeros_like(vexperts)
    slot_expert = _alternating_slots(local_slots, vexperts, slots_total)
    width = max_copies if static else None
    replica_gpu, replica_slot = _replica_table(base_gpu, slot_expert, width)
    share = water_fill_shares(
        counts, replica_gpu, num_gpus, config.share_refinement_sweeps,
        max_replicated=slots_total * num_gpus if static else None,
    )
    predicted = balance_ratio(_plan_loads(counts, replica_gpu, share, num_gpus))
    return Plan(
        vexperts=vexperts,
        slot_expert=slot_expert,
        base_gpu=base_gpu,
        replica_gpu=replica_gpu,
        replica_slot=replica_slot,
        replica_share=share,
        balance_before=balance_before,
        balance_predicted=predicted,
    )


def _plan_loads(counts: torch.Tensor, replica_gpu: torch.Tensor, share: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Tokens per GPU [L, N] under a plan, straight from the replica table (no [L, E, N] tensor)."""
    loads = torch.zeros(counts.shape[0], num_gpus + 1, device=counts.device)
    index = torch.where(replica_gpu >= 0, replica_gpu, num_gpus).flatten(1)
    loads.scatter_add_(1, index, (counts.unsqueeze(-1) * share).flatten(1))
    return loads[:, :num_gpus]


def validate_counts(counts: torch.Tensor, base_gpu: torch.Tensor) -> None:
    """A placement policy's window: counts [L, E] ≥ 0 of the base placement's shape."""
    if counts.dim() != 2:
        raise VExpertInputError("counts", f"must be [layers, experts], got shape {tuple(counts.shape)}")
    if counts.shape != base_gpu.shape:
        raise VExpertInputError("base_gpu", f"shape {tuple(base_gpu.shape)} does not match counts {tuple(counts.shape)}")
    if counts.numel() and bool((counts < 0).any()):
        raise VExpertInputError("counts", "expert counts must be non-negative")


def layer_slots(layer: torch.Tensor, vexperts: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot range [lo, hi) of GPU-local slots that layer ``layer`` fills with V = ``vexperts``
    under the alternating layout: even layers from the bottom, odd layers from the top.

    Args: layer, vexperts: int tensors of one broadcast shape. Returns lo, hi of that shape.
    """
    odd = layer.remainder(2) == 1
    lo = torch.where(odd, slots - vexperts, torch.zeros_like(vexperts))
    return lo, lo + vexperts


def slots_overlap(
    prev_layer: torch.Tensor, prev_v: torch.Tensor, layer: torch.Tensor, v: torch.Tensor, slots: int
) -> torch.Tensor:
    """Do two consecutively streamed layers' slot ranges intersect (alternating layout)? Layers of
    different parity are disjoint iff V_prev + V ≤ S; layers of one parity (the wrap L−1 → 0 with
    L odd) overlap as soon as both stream. Broadcast int tensors → bool."""
    lo_a, hi_a = layer_slots(prev_layer, prev_v, slots)
    lo_b, hi_b = layer_slots(layer, v, slots)
    return (torch.maximum(lo_a, lo_b) < torch.minimum(hi_a, hi_b)) & (prev_v > 0) & (v > 0)


def _alternating_slots(local_slots: torch.Tensor, vexperts: torch.Tensor, slots_total: int) -> torch.Tensor:
    """Lay each layer's V_i filled rounds into the S slots of its GPU, alternating by parity
    (:func:`layer_slots`): streaming layer i + 1 while layer i computes then never overwrites a slot
    layer i reads as long as V_i + V_{i+1} ≤ S (the allocator's adjacency bound). [L, N, S]."""
    num_layers, num_gpus, rounds = local_slots.shape
    layer = torch.arange(num_layers, device=local_slots.device)
    offset, _ = layer_slots(layer, vexperts, slots_total)  # [L]
    # Scatter round r of layer i to slot offset_i + r; unused rounds land past S and are cut off.
    out = torch.full((num_layers, num_gpus, slots_total + rounds), -1, dtype=torch.int64, device=local_slots.device)
    r = torch.arange(rounds, device=local_slots.device)
    position = torch.where(r.unsqueeze(0) < vexperts.unsqueeze(1), offset.unsqueeze(1) + r, slots_total + r)  # [L, rounds]
    out.scatter_(2, position.unsqueeze(1).expand(-1, num_gpus, -1), local_slots)
    return out[:, :, :slots_total]


def _replica_table(
    base_gpu: torch.Tensor, slot_expert: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """replica_gpu / replica_slot [L, E, R]: copy 0 is the resident one, then every filled slot in
    (GPU, slot) order. R = ``width`` (static) or 1 + the most slots any expert fills."""
    num_layers, num_experts = base_gpu.shape
    _, _num_gpus, slots = slot_expert.shape
    dev = base_gpu.device
    flat = slot_expert.reshape(num_layers, -1)  # [L, N·S] row-major (gpu, slot)
    cells = flat.shape[1]
    expert = torch.where(flat >= 0, flat, num_experts)  # empty slots sort last, into a dropped row
    if width is None:
        per_expert = torch.zeros(num_layers, num_experts + 1, dtype=torch.int64, device=dev)
        per_expert.scatter_add_(1, expert, torch.ones_like(expert))
        width = 1 + (int(per_expert[:, :num_experts].max()) if cells else 0)
    position = torch.arange(cells, device=dev)
    key, order = (expert * max(cells, 1) + position).sort(dim=1)
    sorted_expert = key // max(cells, 1)
    start = torch.ones_like(sorted_expert, dtype=torch.bool)
    start[:, 1:] = sorted_expert[:, 1:] != sorted_expert[:, :-1]
    run_start = torch.cummax(torch.where(start, position, torch.zeros_like(position)), dim=1).values
    rank = 1 + position - run_start  # 1-based rank among the expert's slot copies
    rank = torch.where(rank < width, rank, width)  # beyond the table: dropped column (never with the cap)
    replica_gpu = torch.full((num_layers, num_experts + 1, width + 1), -1, dtype=torch.int64, device=dev)
    replica_slot = torch.full_like(replica_gpu, -1)
    slots_safe = max(slots, 1)
    replica_gpu.index_put_((torch.arange(num_layers, device=dev).unsqueeze(1).expand_as(rank), sorted_expert, rank), order // slots_safe)
    replica_slot.index_put_((torch.arange(num_layers, device=dev).unsqueeze(1).expand_as(rank), sorted_expert, rank), order % slots_safe)
    replica_gpu = replica_gpu[:, :num_experts, :width].contiguous()
    replica_slot = replica_slot[:, :num_experts, :width].contiguous()
    replica_gpu[:, :, 0] = base_gpu
    return replica_gpu, replica_slot


class GraphedAllocator:
    """:func:`allocate` for fixed shapes on a GPU: compiled and captured in one CUDA graph.

    Eager, an allocation launches a few hundred small kernels and pays Python and launch overhead
    for each (≈10 ms on an H200). Capturing the static-shape allocation in a CUDA graph pays it
    once (≈2.3 ms); compiling it first with ``torch.compile`` fuses the element-wise chains
    (≈0.5 ms, 16 s of compilation at start-up). Plans are identical to :func:`allocate`'s. Outputs
    are cloned so a returned :class:`Plan` stays valid across later calls.
    """

    _FIELDS = ("vexperts", "slot_expert", "replica_gpu", "replica_slot", "replica_share", "balance_before", "balance_predicted")

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_gpus: int,
        config: AllocatorConfig | None = None,
        profile: PerformanceProfile | None = None,
        consts: InferenceConstants | None = None,
        device: str | torch.device = "cuda",
        compile: bool = True,
    ) -> None:
        self.num_gpus = num_gpus
        self.config = config or AllocatorConfig()
        self.config.validate()
        self.profile = profile or PerformanceProfile()
        self.consts = consts or InferenceConstants(experts_per_gpu=max(1, num_experts // num_gpus))
        self.counts = torch.zeros(num_layers, num_experts, device=device)
        self.base_gpu = torch.arange(num_experts, device=device).repeat(num_layers, 1) // (num_experts // num_gpus)
        self.pooled = torch.ones(num_layers, num_experts, dtype=torch.bool, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, ...] = ()
        self._host: tuple[torch.Tensor, ...] = ()  # pinned copies of the outputs (to_host)
        self._fn = self._static_allocation
        if compile:
            try:
                import triton  # noqa: F401  (inductor's GPU backend)

                self._fn = torch.compile(self._static_allocation, dynamic=False)
            except ImportError:  # no Triton: plain capture still removes the launch overhead
                pass

    def _static_allocation(self, counts: torch.Tensor, base_gpu: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = allocate(counts, base_gpu, self.num_gpus, self.config, self.profile, self.consts, pooled=pooled, static=True)
        return tuple(getattr(plan, f) for f in self._FIELDS)

    def _replay(self, counts: torch.Tensor, base_gpu: torch.Tensor, pooled: torch.Tensor | None) -> None:
        """Load the inputs into the static buffers (asynchronously from pinned host tensors) and
        enqueue the captured allocation (capturing it on the first call)."""
        validate_counts(counts, base_gpu)
        validate_base_placement(base_gpu, self.num_gpus)
        self.counts.copy_(_staged(counts, self.counts), non_blocking=True)
        self.base_gpu.copy_(_staged(base_gpu, self.base_gpu), non_blocking=True)
        if pooled is None:
            self.pooled.fill_(True)
        else:
            self.pooled.copy_(_staged(pooled, self.pooled), non_blocking=True)
        if self.graph is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and warm caches (combinations, memory pools) outside capture
                    self._fn(self.counts, self.base_gpu, self.pooled)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with collector_paused(), torch.cuda.graph(self.graph):  # no GC inside a capture (gc_heap)
                self._out = self._fn(self.counts, self.base_gpu, self.pooled)
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._out)
        self.graph.replay()

    def __call__(self, counts: torch.Tensor, base_gpu: torch.Tensor, pooled: torch.Tensor | None = None) -> Plan:
        """Args: counts [L, E], base_gpu [L, E] int64, pooled [L, E] bool (None: every expert).
        The plan on the device."""
        self._replay(counts, base_gpu, pooled)
        values = dict(zip(self._FIELDS, (t.clone() for t in self._out), strict=True))
        return Plan(base_gpu=self.base_gpu.clone(), **values)

    def to_host(self, counts: torch.Tensor, base_gpu: torch.Tensor, pooled: torch.Tensor | None = None) -> Plan:
        """The plan on the host from host inputs: the inputs go up and the outputs come down as
        asynchronous pinned copies, and the host waits once, for the last of them (one round trip:
        what keeps an allocation in a node under a millisecond)."""
        self._replay(counts, base_gpu, pooled)
        for host, out in zip(self._host, self._out, strict=True):
            host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        values = dict(zip(self._FIELDS, (t.clone() for t in self._host), strict=True))
        return Plan(base_gpu=base_gpu.to(torch.int64).clone(), **values)


def _staged(tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``tensor`` ready for an asynchronous copy into ``target``: host tensors converted to its
    dtype on the host and pinned (a pageable source would make the copy wait)."""
    if tensor.device.type != "cpu" or not target.is_cuda:
        return tensor
    return tensor.to(target.dtype).pin_memory()


class DeviceAllocator:
    """:func:`allocate`'s signature on a GPU: a :class:`GraphedAllocator` per distinct configuration
    (built, compiled and captured on first use; :meth:`warm_up` does that ahead of time), plans
    returned on the host. This is what a node with GPUs runs every k iterations."""

    def __init__(self, device: str | torch.device = "cuda", compile: bool = True) -> None:
        self.device = torch.device(device)
        self.compile = compile
        self._graphed: dict[tuple[object, ...], GraphedAllocator] = {}
        self._lock = threading.Lock()

    def _for(self, counts: torch.Tensor, num_gpus: int, config: AllocatorConfig | None, profile: PerformanceProfile | None,
             consts: InferenceConstants | None) -> GraphedAllocator:
        config, profile = config or AllocatorConfig(), profile or PerformanceProfile()
        consts = consts or InferenceConstants(experts_per_gpu=max(1, counts.shape[-1] // max(1, num_gpus)))
        key = (tuple(counts.shape), num_gpus, config, profile.parameters_json(), consts)
        if key not in self._graphed:
            self._graphed[key] = GraphedAllocator(
                counts.shape[0], counts.shape[1], num_gpus, config, profile, consts, self.device, self.compile
            )
        return self._graphed[key]

    def __call__(
        self,
        counts: torch.Tensor,
        base_gpu: torch.Tensor,
        num_gpus: int,
        config: AllocatorConfig | None = None,
        profile: PerformanceProfile | None = None,
        consts: InferenceConstants | None = None,
        pooled: torch.Tensor | None = None,
    ) -> Plan:
        with self._lock, torch.cuda.device(self.device):
            graphed = self._for(counts, num_gpus, config, profile, consts)
            if counts.device.type == "cpu" and base_gpu.device.type == "cpu":
                return graphed.to_host(counts, base_gpu, None if pooled is None else pooled.cpu())
            plan = graphed(counts.to(self.device), base_gpu.to(self.device), None if pooled is None else pooled.to(self.device))
            return plan.to("cpu")

    def warm_up(self, counts: torch.Tensor, base_gpu: torch.Tensor, num_gpus: int, config: AllocatorConfig | None = None,
                profile: PerformanceProfile | None = None, consts: InferenceConstants | None = None) -> None:
        """Compile and capture for these shapes and knobs now (seconds), not at the first window."""
        self(counts, base_gpu, num_gpus, config, profile, consts)
