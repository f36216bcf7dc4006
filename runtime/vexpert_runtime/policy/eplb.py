"""DeepSeek's Expert Parallelism Load Balancer (EPLB) as small pure functions over tensors.

A reimplementation of the algorithm published in github.com/deepseek-ai/EPLB (``eplb.py``), the
baseline vExpert is compared against. ``phy2log`` and ``logcnt`` are identical to DeepSeek's code,
ties included (``log2phy`` holds the same values but is padded to the largest replica count, not to
``num_replicas − num_logical + 1``):

* items are ordered with the same (unstable) ``torch.sort`` call, so equal weights keep
  DeepSeek's order;
* the greedy packing sends each item to the lightest pack that still has room, lowest pack index on
  ties (what Python's ``min`` does in DeepSeek's loop), and adds loads one item at a time in the
  same dtype (float32 from :func:`rebalance_experts`), so rounding is the same;
* replication takes the first expert with the largest ``weight / count``, as ``torch.max`` does.

What changed is speed. DeepSeek loops in Python over layers × items × packs and indexes one
tensor element at a time (on a 2-core CPU, 58 layers × 256 experts on 8 nodes × 8 GPUs: about
0.2 s per hierarchical plan and 0.8–1.1 s per global one). Here the greedy loops run once per item
(or per redundant replica) over numpy arrays that hold every layer, and each step picks the packs
of all layers with one ``argmin``: 1–4 ms per plan for the same inputs.

Two forms of the policy (both used by :mod:`.registry`): :func:`rearranged_share` is EPLB as
DeepSeek and SGLang run it, every expert's weights moved to where EPLB packs them (a stop-the-world
rearrangement; the simulator's ``eplb`` and ``eplb-redundant`` rows). :func:`slot_plan` is what a
vExpert node can run live, where resident experts never move: EPLB's redundant experts streamed into
the node's vExpert slots, as a :class:`~vexpert_runtime.policy.allocator.Plan`.

Shapes: ``L`` layers, ``E`` logical experts, ``P`` physical experts (replicas), ``X`` independent
rows (layers, or layers × nodes), ``N`` GPUs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.allocator import (
    AllocatorConfig,
    Plan,
    plan_from_copies,
    replica_counts,
    validate_counts,
)
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, validate_base_placement
from vexpert_runtime.policy.profile import PerformanceProfile

POLICIES = ("hierarchical", "global", "auto")


# --------------------------------------------------------------------------------------------
# Greedy primitives
# --------------------------------------------------------------------------------------------


def balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    """Pack the ``n`` items of each row into ``num_packs`` packs of exactly ``n / num_packs`` items.

    Greedy, heaviest item first: each item goes to the lightest pack that still has room (lowest
    pack index on ties).

    Args: weight [X, n] item weights; num_packs must divide n.
    Returns: pack_index [X, n] int64, the pack of each item; rank_in_pack [X, n] int64, its
    position in that pack (the order in which items were placed into it).
    """
    _require_2d(weight, "weight")
    num_rows, num_items = weight.shape
    if num_packs <= 0 or num_items % num_packs != 0:
        raise VExpertInputError(
            "num_packs", f"{num_items} items cannot be split evenly into {num_packs} packs", "use a divisor"
        )
    capacity = num_items // num_packs
    if capacity == 1:
        identity = torch.arange(num_items, dtype=torch.int64, device=weight.device).expand(num_rows, -1)
        return identity.contiguous(), torch.zeros_like(identity)

    # DeepSeek orders items with torch's default (unstable) sort; calling the very same sort is the
    # only way to get its order among equal weights.
    order = weight.detach().float().sort(-1, descending=True).indices.cpu().numpy()  # [X, n]
    loads = _accumulator(weight)
    sorted_items = np.take_along_axis(loads, order, axis=1).T.copy()  # [n, X], placement order
    pack_sorted, rank_sorted = _greedy_fill(sorted_items, num_packs, capacity)

    pack_index = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    np.put_along_axis(pack_index, order, pack_sorted.T, axis=1)
    np.put_along_axis(rank_in_pack, order, rank_sorted.T, axis=1)
    return _to_torch(pack_index, weight.device), _to_torch(rank_in_pack, weight.device)


def replicate_experts(weight: Tensor, num_phy: int) -> tuple[Tensor, Tensor, Tensor]:
    """Give ``num_phy - num_log`` extra replicas, one at a time, to the expert with the highest
    per-replica load ``weight / count`` (first such expert on ties), minimising the peak replica load.

    Args: weight [X, num_log]; num_phy ≥ num_log physical experts per row.
    Returns: phy2log [X, num_phy] int64 (slot i < num_log holds expert i, later slots hold the
    extra replicas in the order they were added); phy_rank [X, num_phy] int64, the replica index of
    each slot within its expert; logcnt [X, num_log] int64, replicas per expert.
    """
    _require_2d(weight, "weight")
    num_rows, num_log = weight.shape
    if num_phy < num_log:
        raise VExpertInputError(
            "num_phy", f"{num_phy} physical experts cannot hold {num_log} logical ones", f"use ≥ {num_log}"
        )
    # torch divides float weights in their own dtype and integer weights in the default float dtype.
    ratio_dtype = weight.dtype if weight.dtype.is_floating_point else torch.get_default_dtype()
    w = _accumulator(weight.detach().to(ratio_dtype))  # [X, num_log]
    per_replica = w.copy()  # weight / 1
    logcnt = np.ones((num_rows, num_log), dtype=np.int64)
    phy2log = np.empty((num_rows, num_phy), dtype=np.int64)
    phy_rank = np.zeros((num_rows, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log)
    rows = np.arange(num_rows)
    for slot in range(num_log, num_phy):
        expert = per_replica.argmax(axis=1)  # [X], first maximum like torch.max
        count = logcnt[rows, expert]
        phy2log[:, slot] = expert
        phy_rank[:, slot] = count
        count += 1
        logcnt[rows, expert] = count
        # Only the chosen entries change; recompute them exactly as weight / logcnt would.
        per_replica[rows, expert] = w[rows, expert] / count.astype(w.dtype)
    device = weight.device
    return _to_torch(phy2log, device), _to_torch(phy_rank, device), _to_torch(logcnt, device)


# --------------------------------------------------------------------------------------------
# Placement policies
# --------------------------------------------------------------------------------------------


def rebalance_experts_hierarchical(
    weight: Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek's hierarchical policy: groups → nodes, replicate within nodes, replicas → GPUs.

    1. Pack the ``num_groups`` expert groups (contiguous blocks of E / num_groups experts) onto
       nodes, balancing group loads; a group never spans nodes.
    2. Inside each node, replicate its experts into P / num_nodes physical slots.
    3. Pack each node's replicas (load = expert load / replica count) onto its GPUs.

    With ``num_groups = num_nodes = 1`` this is DeepSeek's global policy.

    Args: weight [L, E] expert loads; P = num_physical_experts.
    Returns: phy2log [L, P] int64, the logical expert of each physical slot (GPU g holds slots
    g·P/num_gpus …); phy_rank [L, P] int64, replica index of each slot; logcnt [L, E] int64.
    """
    _require_2d(weight, "weight")
    num_layers, num_logical = weight.shape
    _check_layout(num_logical, num_physical_experts, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes != 0:
        raise VExpertInputError(
            "num_groups",
            f"{num_groups} expert groups cannot be split evenly over {num_nodes} nodes",
            "use the global policy or a group count divisible by the node count",
        )
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical_experts // num_nodes
    slots_per_gpu = num_physical_experts // num_gpus
    device = weight.device

    # Step 1: groups → nodes. "mlog" numbers experts node-major: node n owns mlog ids
    # [n·E/num_nodes, (n+1)·E/num_nodes), each of its groups a contiguous block in packing order.
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, num_groups]
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    group_start = (group_node * groups_per_node + group_rank) * group_size  # [L, num_groups]
    log2mlog = (group_start.unsqueeze(-1) + torch.arange(group_size, device=device)).flatten(-2)  # [L, E]
    mlog2log = _inverse_permutation(log2mlog)

    # Step 2: replicate within each node. Rows are (layer, node) pairs.
    mlog_load = weight.gather(-1, mlog2log).view(num_layers * num_nodes, logical_per_node)
    phy2mlog, phy_rank, mlogcnt = replicate_experts(mlog_load, physical_per_node)

    # Step 3: replicas → GPUs of their node; "pphy" is the final slot order within the node.
    replica_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)  # [L·num_nodes, P/num_nodes]
    gpu, rank_on_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    pphy2phy = _inverse_permutation(gpu * slots_per_gpu + rank_on_gpu)

    node_offset = torch.arange(num_nodes, device=device).view(1, num_nodes, 1) * logical_per_node
    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(num_layers, num_nodes, physical_per_node) + node_offset
    phy2log = mlog2log.gather(-1, pphy2mlog.flatten(-2))
    phy_rank = phy_rank.gather(-1, pphy2phy).view(num_layers, num_physical_experts)
    logcnt = mlogcnt.view(num_layers, num_logical).gather(-1, log2mlog)
    return phy2log, phy_rank, logcnt


def rebalance_experts(
    weight: Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """EPLB entry point: replicate and place experts so that GPU loads are balanced.

    Policies: ``"hierarchical"`` (group-limited: every group's experts stay on one node),
    ``"global"`` (groups and nodes ignored: the hierarchical policy with one group on one node,
    as in DeepSeek's code), ``"auto"`` (hierarchical when num_groups % num_nodes == 0, as SGLang
    and DeepSeek choose, else global). Weights are converted to float32 on the CPU first, as
    DeepSeek does.

    Args: weight [L, E] non-negative expert loads; num_replicas P physical experts per layer
    (a multiple of num_gpus, ≥ E); num_gpus a multiple of num_nodes; E a multiple of num_groups.
    Returns: phy2log [L, P] int64, the logical expert of each physical slot (GPU g holds slots
    g·P/num_gpus … (g+1)·P/num_gpus − 1); log2phy [L, E, R] int64, the physical slots of each
    expert in replica order, padded with −1 (R = the largest replica count); logcnt [L, E] int64.
    """
    if policy not in POLICIES:
        raise VExpertInputError("policy", f"unknown policy {policy!r}", f"use one of {', '.join(POLICIES)}")
    _require_2d(weight, "weight")
    num_layers, num_logical = weight.shape
    if num_layers == 0 or num_logical == 0:
        raise VExpertInputError(
            "weight", f"needs at least one layer and one expert, got shape {tuple(weight.shape)}"
        )
    _check_layout(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    weight = weight.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(weight).all()):
        raise VExpertInputError("weight", "contains NaN or infinite loads", "pass finite token counts")
    if bool((weight < 0).any()):
        raise VExpertInputError("weight", "contains negative loads", "pass token counts ≥ 0")
    if policy == "hierarchical" and num_groups % num_nodes != 0:
        raise VExpertInputError(
            "num_groups",
            f"hierarchical policy needs num_groups ({num_groups}) divisible by num_nodes ({num_nodes})",
            "use policy 'global' or 'auto'",
        )

    hierarchical = policy == "hierarchical" or (policy == "auto" and num_groups % num_nodes == 0)
    if hierarchical:
        phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return phy2log, _logical_to_physical(phy2log, phy_rank, logcnt), logcnt


def expert_gpu_share(phy2log: Tensor, logcnt: Tensor, num_logical: int, num_gpus: int) -> Tensor:
    """Fraction of each logical expert's tokens that each GPU computes, tokens split evenly over
    the expert's replicas. Physical slots are contiguous per GPU: GPU g holds slots
    g·P/num_gpus … (g+1)·P/num_gpus − 1.

    Args: phy2log [L, P] int64; logcnt [L, E] replicas per expert (must match phy2log, ≥ 1 each).
    Returns: share [L, E, num_gpus] float32; every [l, e, :] row sums to 1.
    """
    _require_2d(phy2log, "phy2log")
    num_layers, num_physical = phy2log.shape
    if num_gpus <= 0 or num_physical % num_gpus != 0:
        raise VExpertInputError(
            "num_gpus", f"{num_physical} physical experts cannot be split evenly over {num_gpus} GPUs"
        )
    if tuple(logcnt.shape) != (num_layers, num_logical):
        raise VExpertInputError(
            "logcnt", f"must have shape {(num_layers, num_logical)}, got {tuple(logcnt.shape)}"
        )
    if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical):
        raise VExpertInputError("phy2log", f"logical expert ids must be in [0, {num_logical})")
    slots_per_gpu = num_physical // num_gpus
    gpu_of_slot = torch.arange(num_physical, device=phy2log.device) // slots_per_gpu  # [P]
    replicas = torch.zeros(num_layers, num_logical * num_gpus, dtype=torch.int64, device=phy2log.device)
    replicas.scatter_add_(
        1, phy2log.long() * num_gpus + gpu_of_slot, torch.ones_like(phy2log, dtype=torch.int64)
    )
    replicas = replicas.view(num_layers, num_logical, num_gpus)  # [L, E, num_gpus]
    if not torch.equal(replicas.sum(-1), logcnt.to(torch.int64)):
        raise VExpertInputError("logcnt", "does not match the replica counts in phy2log")
    if bool((logcnt <= 0).any()):
        raise VExpertInputError("phy2log", "some logical expert has no replica", "give every expert ≥ 1 slot")
    return replicas.to(torch.float32) / logcnt.to(torch.float32).unsqueeze(-1)


def rearranged_share(
    counts: Tensor, num_redundant: int, num_groups: int, num_nodes: int, num_gpus: int, policy: str = "auto"
) -> Tensor:
    """EPLB as DeepSeek runs it: every expert placed anew (:func:`rebalance_experts` with
    ``E + num_redundant`` physical experts), tokens split evenly over an expert's replicas.

    Args: counts [L, E] expert loads of the window EPLB plans from. Returns share [L, E, N] float32.
    """
    num_experts = counts.shape[-1]
    phy2log, _, logcnt = rebalance_experts(counts, num_experts + num_redundant, num_groups, num_nodes, num_gpus, policy)
    return expert_gpu_share(phy2log, logcnt, num_experts, num_gpus)


def redundant_per_gpu(config: AllocatorConfig) -> int:
    """EPLB's redundant experts per GPU in every layer, within a node's slots.

    EPLB gives every layer the same number of redundant experts. A node streams a layer's copies
    while the layer before it computes, into one set of ``S = G·vmax`` slots per GPU, so two
    adjacent layers' copies must fit together (V_l + V_{l+1} ≤ S), and a group of G layers streams
    at most G·vmax copies per GPU: every layer gets min(vmax, S // 2) (vmax without the adjacency
    bound). G = 2, vmax = 1 gives one per GPU per layer, the paper's EPLB-redundant (B2).
    """
    if not config.adjacency_bound:
        return config.vmax
    return min(config.vmax, config.slots_per_gpu // 2)


def slot_plan(
    counts: Tensor,
    base_gpu: Tensor,
    num_gpus: int,
    config: AllocatorConfig | None = None,
    profile: PerformanceProfile | None = None,
    consts: InferenceConstants | None = None,
    pooled: Tensor | None = None,
) -> Plan:
    """EPLB's redundant experts as a :class:`Plan` a node runs live: resident experts stay where
    ``base_gpu`` has them, and :func:`redundant_per_gpu` copies per GPU in every layer go into the
    node's vExpert slots.

    It gets exactly what vExpert's allocator gets (``allocate``'s signature): the window's counts,
    the base placement, N, the slot knobs in ``config`` (G, vmax, adjacency bound, copies cap) and the
    host pool mask. It uses none of vExpert's decisions: ``profile``/``consts`` (EPLB has no cost
    model), τ and the per-layer vExpert counts are ignored. EPLB's rules, under the node's limits:

    1. every layer gets ``V = redundant_per_gpu(config)`` copies per GPU (N·V in all);
    2. each next copy goes to the expert with the highest load per copy (:func:`replicate_experts`'s
       rule, computed by :func:`~vexpert_runtime.policy.allocator.replica_counts`), only experts in
       the host pool, at most one copy per GPU;
    3. heaviest copy first onto the least-loaded GPU with a free slot that does not hold the expert
       (:func:`balanced_packing`'s rule, starting from the resident experts' loads);
    4. an expert's tokens split evenly over its copies (SGLang's dispatch of EPLB replicas).

    Args: counts [L, E] ≥ 0; base_gpu [L, E] int64 (E/N per GPU); pooled [L, E] bool or None (all).
    """
    del profile, consts  # same inputs as vExpert's allocator; EPLB has no cost model
    config = config or AllocatorConfig()
    config.validate()
    validate_counts(counts, base_gpu)
    validate_base_placement(base_gpu, num_gpus)
    w = counts.to(torch.float32)
    num_layers = w.shape[0]
    vexperts = torch.full((num_layers,), redundant_per_gpu(config), dtype=torch.int64, device=w.device)
    copies = replica_counts(w, vexperts * num_gpus, num_gpus, pooled, min(num_gpus, config.max_copies_per_expert))
    even = replace(config, share_refinement_sweeps=0)  # no water-filling: the even split
    balance_before = balance_ratio(base_gpu_loads(w, base_gpu, num_gpus))
    return plan_from_copies(w, base_gpu, copies, vexperts, num_gpus, even, balance_before)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _greedy_fill(sorted_items: np.ndarray, num_packs: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy core of :func:`balanced_packing`, one step per item, all rows at once.

    Args: sorted_items [n, X], item j of every row in placement order (heaviest first), already
    in the dtype loads accumulate in. Returns pack [n, X] and rank [n, X] of each placed item.
    """
    pack, rank = _greedy_fill_pass(sorted_items, num_packs, capacity, exact=False)
    if rank.size and int(rank.max()) >= capacity:
        # The fast pass put an item into a full pack, which only happens when an open pack's own
        # load equals the `closed` sentinel (overflow to inf). Redo it with an explicit mask.
        pack, rank = _greedy_fill_pass(sorted_items, num_packs, capacity, exact=True)
    return pack, rank


def _greedy_fill_pass(
    sorted_items: np.ndarray, num_packs: int, capacity: int, *, exact: bool
) -> tuple[np.ndarray, np.ndarray]:
    num_items, num_rows = sorted_items.shape
    dtype = sorted_items.dtype
    closed = np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).max
    # key = the pack's load while it has room, `closed` once full: argmin then skips full packs.
    key = np.zeros(num_rows * num_packs, dtype=dtype)
    key_2d = key.reshape(num_rows, num_packs)  # view
    fill = np.zeros(num_rows * num_packs, dtype=np.int64)
    row_base = np.arange(num_rows, dtype=np.int64) * num_packs
    pack = np.empty((num_items, num_rows), dtype=np.int64)
    rank = np.empty((num_items, num_rows), dtype=np.int64)
    for j in range(num_items):
        if exact:
            is_open = fill.reshape(num_rows, num_packs) < capacity
            candidate = np.where(is_open, key_2d, closed)
            lightest = is_open & (candidate == candidate.min(axis=1, keepdims=True))
            choice = lightest.argmax(axis=1)  # first lightest open pack
        else:
            choice = key_2d.argmin(axis=1)  # first lightest pack; full packs hold `closed`
        flat = row_base + choice
        filled = fill[flat]
        pack[j] = choice
        rank[j] = filled
        with np.errstate(over="ignore"):  # float16 loads may overflow to inf, as in DeepSeek's torch code
            key[flat] += sorted_items[j]
        filled += 1
        fill[flat] = filled
        key[flat[filled == capacity]] = closed
    return pack, rank


def _accumulator(weight: Tensor) -> np.ndarray:
    """weight [X, n] as a numpy array in the dtype DeepSeek's loop adds loads in: float16/32/64
    unchanged, integers and bools as int64 (bfloat16, which numpy lacks, becomes float32)."""
    w = weight.detach().cpu()
    if w.dtype == torch.bfloat16:
        w = w.to(torch.float32)
    elif not w.dtype.is_floating_point:
        w = w.to(torch.int64)
    return np.ascontiguousarray(w.numpy())


def _to_torch(array: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(array).to(device)


def _inverse_permutation(perm: Tensor) -> Tensor:
    """Row-wise inverse of permutations [X, n]: inv[x, perm[x, i]] = i."""
    inv = torch.empty_like(perm)
    positions = torch.arange(perm.size(1), dtype=perm.dtype, device=perm.device).expand_as(perm)
    return inv.scatter_(1, perm, positions)


def _logical_to_physical(phy2log: Tensor, phy_rank: Tensor, logcnt: Tensor) -> Tensor:
    """log2phy [L, E, R]: physical slot of replica r of expert e, −1 past logcnt. R = max logcnt."""
    num_layers, num_physical = phy2log.shape
    num_logical = logcnt.shape[1]
    max_replicas = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    slots = torch.arange(num_physical, dtype=torch.int64).expand(num_layers, -1)
    log2phy.scatter_(1, phy2log * max_replicas + phy_rank, slots)
    return log2phy.view(num_layers, num_logical, max_replicas)


def _require_2d(tensor: Tensor, field: str) -> None:
    if tensor.dim() != 2:
        raise VExpertInputError(field, f"must be 2-D [rows, columns], got shape {tuple(tensor.shape)}")


def _check_layout(
    num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Divisibility rules shared by every policy (see :func:`rebalance_experts`)."""
    for name, value in (
        ("num_replicas", num_physical),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        if value <= 0:
            raise VExpertInputError(name, f"must be positive, got {value}")
    if num_physical % num_gpus != 0:
        raise VExpertInputError(
            "num_replicas",
            f"{num_physical} physical experts cannot be split evenly over {num_gpus} GPUs",
            "use a multiple of the GPU count",
        )
    if num_gpus % num_nodes != 0:
        raise VExpertInputError(
            "num_gpus",
            f"{num_gpus} GPUs cannot be split evenly over {num_nodes} nodes",
            "use a multiple of the node count",
        )
    if num_logical % num_groups != 0:
        raise VExpertInputError(
            "num_groups",
            f"{num_logical} logical experts cannot be split into {num_groups} equal groups",
            "use a divisor of the expert count",
        )
    if num_physical < num_logical:
        raise VExpertInputError(
            "num_replicas",
            f"{num_physical} physical experts cannot hold {num_logical} logical experts",
            f"use at least {num_logical}",
        )
