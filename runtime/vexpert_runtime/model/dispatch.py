"""Per-iteration replica dispatch: how each replicated expert's tokens are split over its copies.

Placement (which experts have copies where) changes every k iterations, with the allocator's plan.
The plan also carries token shares per copy, water-filled for the counts it was made from; those
shares are fixed for k iterations, while each iteration's batch routes differently (per-iteration
noise). Re-splitting every iteration, from that iteration's own counts, over the copies that
already exist keeps the GPUs level without moving a byte of weights (issue #14: 0.74 → 0.82 with
rank-local counts, 0.85 with counts all-reduced per layer, in the simulator).

Modes (:data:`DISPATCH_MODES`):

* ``plan``: the plan's shares (``DeviceRoutingTable.cum_share``), as before.
* ``local``: shares water-filled from this rank's own per-expert counts of the layer. Each rank
  levels its own contribution to every GPU; the sum of level contributions is level too, up to
  how differently the ranks' batches are skewed. No communication.
* ``global``: the layer's per-expert counts [E] int32 all-reduced over the EP group first (one
  1 KiB collective at DeepSeek-V3 shape), then every rank computes the same shares from the global
  counts and splits its own tokens by them, so the global load is level.

Everything runs on the layer's device with shapes fixed by (E, R, N) and no value read back to the
host, so the layer stays CUDA-graph capturable (NCCL all-reduce is capturable too). On a CUDA device
with Triton the shares come from one kernel (:mod:`dispatch_kernel`) over the layer's
:class:`ReplicaCopies`; the torch functions here are its twin (CPU, and GPUs without Triton) and
the reference it is tested against.

The water-filling here is the per-layer, fixed-shape sibling of
:func:`vexpert_runtime.policy.allocator.water_fill_shares` (which the allocator runs for all layers
with data-dependent shapes on the host side of the plan): the same block-coordinate descent on
Σ load², but over the dense [E, R] table with every expert as a row (an expert with one copy
simply keeps share 1 on it, which is exactly its contribution to its GPU's base load), so a sweep
is a dozen small kernels with no gather/scatter of the replicated subset.

Shapes: ``E`` experts, ``R`` copy slots per expert in the table (copy 0 resident, −1 padding),
``N`` EP ranks (GPUs), ``B`` tokens and ``K`` top-k of this rank.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch
import torch.distributed as dist

from vexpert_runtime.model.grouped_moe import group_counts
from vexpert_runtime.model.levelling import DAMPING, MAX_FUSED_COPIES, MOMENTUM, ReplicaCopies

DispatchMode = Literal["plan", "local", "global"]
DISPATCH_MODES: tuple[DispatchMode, ...] = ("plan", "local", "global")

# Water-filling sweeps per layer, from the plan's shares. Measured on bundled DeepSeek-V3 loads at
# EP64 (G = 2, Vmax = 1, 256 tokens per rank, per-iteration jitter σ = 0.3, global counts):
# balance 0.681 (plan) → 0.751 / 0.767 / 0.773 / 0.780 after 2 / 3 / 4 / 6 sweeps, 0.783 after 60;
# a sweep is ~15 small kernels, so 4 is the knee of cost against balance.
SWEEPS = 4
_DRY = 1.0e30  # floor of padding copies: no water ever reaches them (finite: no inf − inf = NaN)


def replica_bins(gpu: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load bin of each copy: its GPU, or the spare bin N for padding.

    Args: gpu [E, R] int64 (−1 padding). Returns [E, R] int64 in [0, N].
    """
    return torch.where(gpu >= 0, gpu, num_gpus)


def gpu_loads(counts: torch.Tensor, gpu: torch.Tensor, share: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Tokens each GPU computes when every expert's tokens split over its copies by ``share``.

    Args: counts [E] (any real dtype); gpu [E, R] int64 (−1 padding); share [E, R] (0 on padding).
    Returns [N] float32.
    """
    mine = share.to(torch.float32) * counts.to(torch.float32).unsqueeze(-1)
    out = torch.zeros(num_gpus + 1, dtype=torch.float32, device=counts.device)
    out.index_add_(0, replica_bins(gpu, num_gpus).flatten(), mine.flatten())
    return out[:num_gpus]


def water_fill(floor: torch.Tensor, amount: torch.Tensor, inv_rank: torch.Tensor) -> torch.Tensor:
    """Pour ``amount`` onto bins standing at ``floor``: max(0, λ − floor) per bin, Σ = amount.

    With the floors sorted, λ_k = (amount + Σ_{i≤k} floor_(i)) / k is the level if the k lowest bins
    are wet; the sequence falls while the next floor is below the level and rises after, so the
    true level is min_k λ_k — a min instead of finding the last wet bin (one kernel fewer).

    Args: floor [E, R] (≥ _DRY on bins that must stay dry); amount [E]; inv_rank [R] = 1/(1..R).
    Returns [E, R] float32.
    """
    ordered, _ = floor.sort(dim=-1)
    level = torch.addcmul(amount.unsqueeze(-1) * inv_rank, ordered.cumsum(-1), inv_rank).amin(-1, keepdim=True)
    return (level - floor).clamp_(min=0)


def level_shares(counts: torch.Tensor, gpu: torch.Tensor, num_gpus: int, sweeps: int = SWEEPS,
                 start: torch.Tensor | None = None) -> torch.Tensor:
    """Water-filling token shares of one layer: split each expert's tokens over its copies so that
    the GPUs holding them end level, given every other expert's load (block-coordinate descent on
    Σ load², damped Jacobi sweeps; fixed shapes, no host sync).

    Args:
        counts: [E] tokens (pairs) routed to each expert, any real or integer dtype.
        gpu: [E, R] int64 GPU of each copy (copy 0 resident), −1 padding.
        num_gpus: N.
        sweeps: Jacobi sweeps (0: the starting split).
        start: [E, R] starting shares (e.g. the plan's); default an even split over the copies.
    Returns share [E, R] float32: rows sum to 1 over the valid copies, 0 on padding.
    """
    width = gpu.shape[1]
    valid = gpu >= 0
    if start is None:
        share = valid.to(torch.float32) / valid.sum(-1, keepdim=True).clamp(min=1)
    else:
        share = torch.where(valid, start.to(torch.float32), 0.0)
    if sweeps <= 0 or width < 2:
        return share
    w = counts.to(torch.float32)
    inv_w = 1.0 / w.clamp(min=1e-6)
    bins = replica_bins(gpu, num_gpus)
    flat_bins = bins.flatten()
    # The spare bin is where padding copies gather their floor from: _DRY keeps them dry.
    empty = torch.zeros(num_gpus + 1, dtype=torch.float32, device=gpu.device)
    empty[num_gpus:].fill_(_DRY)  # a fill, not a copy from the host: capturable in a CUDA graph
    # Damping: a GPU's degree is the number of replicated experts with a copy on it.
    replicated = valid & (valid.sum(-1, keepdim=True) > 1)
    degree = torch.zeros_like(empty).index_add_(0, flat_bins, replicated.flatten().to(torch.float32))
    step = 1.0 / (DAMPING * torch.where(replicated, degree[bins], 0.0).amax(-1, keepdim=True)).clamp(min=1.0)
    inv_rank = 1.0 / torch.arange(1, width + 1, device=gpu.device, dtype=torch.float32)
    previous = share
    for _ in range(sweeps):
        mine = share * w.unsqueeze(-1)  # [E, R] this expert's tokens on each copy
        load = empty.index_add(0, flat_bins, mine.flatten())  # [N + 1]
        floor = load[bins] - mine  # every copy's GPU without this expert
        target = water_fill(floor, w, inv_rank) * inv_w.unsqueeze(-1)
        # Padding copies have target 0 and start at 0, so they stay 0.
        stepped = torch.lerp(share, target, step).add_(share - previous, alpha=MOMENTUM).clamp_(min=0)
        previous, share = share, stepped
    # Experts with no tokens end with all-zero targets: keep their rows proper splits.
    total = share.sum(-1, keepdim=True)
    even = valid.to(torch.float32) / valid.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(total > 1e-6, share / total.clamp(min=1e-12), even)


def plan_shares(cum_share: torch.Tensor) -> torch.Tensor:
    """Shares [E, R] float32 of a cumulative table [E, R] (padding inf → share 0)."""
    capped = cum_share.clamp(max=1.0)  # padding after the last valid copy (cum 1) adds nothing
    return torch.diff(capped, dim=-1, prepend=torch.zeros_like(capped[..., :1])).to(torch.float32)


def cumulative_shares(share: torch.Tensor, gpu: torch.Tensor) -> torch.Tensor:
    """``choose_replicas``' draw table from shares: cumulative share of copies 0..r, the last valid
    copy exactly 1 and padding inf (so a draw u ∈ [0, 1) never picks past the last valid copy).

    Args: share [E, R]; gpu [E, R] int64 (−1 padding). Returns [E, R] float64.
    """
    valid = gpu >= 0
    cum = share.to(torch.float64).cumsum(-1)
    last = valid.sum(-1, keepdim=True) - 1
    cum = cum.scatter(-1, last.clamp(min=0), 1.0)
    return torch.where(valid, cum, float("inf"))


def layer_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert [E] int64 from ids [B, K] (fixed shape, no host sync)."""
    return group_counts(ids.reshape(-1), num_experts)


def all_reduce_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The EP group's per-expert counts [E] int32 (sum over ranks) from this rank's [E].

    int32: half the bytes of int64, and no count reaches 2³¹ (B·K·N pairs per layer). CUDA tensors
    over a gloo group (ranks sharing one GPU) go through host memory, as the layer's all-to-all."""
    total = counts.to(torch.int32)
    if group is None:
        return total
    if total.is_cuda and dist.get_backend(group) == "gloo":
        staged = total.cpu()
        dist.all_reduce(staged, group=group)
        return staged.to(total.device, non_blocking=True)
    dist.all_reduce(total, group=group)
    return total


@functools.cache
def triton_available() -> bool:
    """Whether the fused kernel (:mod:`dispatch_kernel`) can run: Triton importable (CUDA builds of
    torch ship it) and not switched off with ``VEXPERT_DISPATCH_KERNEL=torch`` (debugging)."""
    if os.environ.get("VEXPERT_DISPATCH_KERNEL", "triton") == "torch":
        return False
    return importlib.util.find_spec("triton") is not None


def fused_dispatch_runs(copies: ReplicaCopies) -> bool:
    """Whether the dispatch runs through the fused kernel: the list on a CUDA device with Triton,
    at most :data:`MAX_FUSED_COPIES` long (else the torch code here, the kernel's twin, runs)."""
    return copies.expert.is_cuda and copies.expert.shape[0] <= MAX_FUSED_COPIES and triton_available()


def dispatch_cum_share(mode: DispatchMode, ids: torch.Tensor, gpu: torch.Tensor, plan_cum_share: torch.Tensor,
                       num_gpus: int, group: dist.ProcessGroup | None, sweeps: int = SWEEPS,
                       copies: ReplicaCopies | None = None) -> torch.Tensor:
    """The cumulative shares [E, R] float64 this rank splits its pairs of one layer with.

    Args:
        mode: ``plan`` returns ``plan_cum_share``; ``local`` water-fills this rank's counts;
            ``global`` all-reduces the counts over ``group`` first (every rank must call it).
        ids: [B, K] int64 this rank's routing of the layer. gpu: [E, R] int64 copies (−1 padding).
        plan_cum_share: [E, R] float64 the plan's (see ``RoutingTable.cum_share``).
        copies: the layer's :class:`ReplicaCopies` (the device table has them): on a CUDA device
            with Triton the shares then come from one fused kernel; else from the torch code here.
    """
    if mode == "plan" or gpu.shape[1] < 2:
        return plan_cum_share
    if not gpu.is_cuda and bool((gpu[:, 1] < 0).all()):
        # An eager (CPU) step, a layer the plan replicates nothing of: nothing to split, and every rank
        # reads the same table, so all skip the all-reduce together (a graphed GPU step keeps it: the
        # collectives in a graph are fixed at capture, whatever plan comes later).
        return plan_cum_share
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode!r} is not one of {', '.join(DISPATCH_MODES)}")
    counts = layer_counts(ids, gpu.shape[0])
    if mode == "global":
        counts = all_reduce_counts(counts, group)
    if copies is not None and fused_dispatch_runs(copies):  # one launch instead of ~140
        from vexpert_runtime.model.dispatch_kernel import fused_cum_shares

        return fused_cum_shares(counts, copies, plan_cum_share, num_gpus, sweeps)
    # From the plan's shares: they were levelled for counts like these, so few sweeps remain.
    return cumulative_shares(level_shares(counts, gpu, num_gpus, sweeps, start=plan_shares(plan_cum_share)), gpu)


# ---------------------------------------------------------------------------------------------
# Which mode a node runs (``vexpert.dispatch: auto``)
# ---------------------------------------------------------------------------------------------

# Balance each mode reached in the simulator on jittered DeepSeek-V3 traces at EP64, G = 2,
# Vmax = 1 (issue #14). Only the local → global difference enters the choice below.
EXPECTED_BALANCE: dict[str, float] = {"plan": 0.74, "local": 0.82, "global": 0.85}
# Estimates until measured on the node (override with vexpert.dispatch_allreduce_us and
# vexpert.dispatch_moe_layer_us): a 1 KiB NCCL all-reduce inside one NVLink node ≈ 10 µs, across
# nodes ≈ 25 µs (two network latencies); gloo on one host ≈ 100 µs. An MoE layer's expert compute
# plus both all-to-alls at perfect balance ≈ 300 µs at DeepSeek-V3 decode batches on H200; a CPU
# worker's layer of the demo model ≈ 5 ms.
ALLREDUCE_US = {"cuda": 10.0, "cuda-multinode": 25.0, "cpu": 100.0}
MOE_LAYER_US = {"cuda": 300.0, "cpu": 5000.0}


def dispatch_gain_us(moe_layer_us: float, balance: dict[str, float] | None = None) -> float:
    """Layer time ``global`` saves over ``local``: the layer runs as long as its busiest GPU, i.e.
    ∝ 1 / balance, so t · (1/b_local − 1/b_global) with t the layer's time at perfect balance."""
    b = EXPECTED_BALANCE if balance is None else balance
    return moe_layer_us * (1.0 / b["local"] - 1.0 / b["global"])


def choose_dispatch(requested: str, *, world: int, slots: int, nodes: int, device: str,
                    allreduce_us: float | None = None, moe_layer_us: float | None = None) -> tuple[DispatchMode, str]:
    """The dispatch mode a node runs, and why (one line for logs and the report).

    ``auto``: ``plan`` where nothing is replicated (no slots, or one rank); otherwise ``global``
    when one all-reduce of the counts costs less than the layer time its extra balance saves
    (:func:`dispatch_gain_us`), else ``local``. An explicit mode is taken as it is.
    """
    if requested in DISPATCH_MODES:
        return requested, "configured"  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"dispatch {requested!r} is not auto or one of {', '.join(DISPATCH_MODES)}")
    if slots == 0 or world == 1:
        return "plan", "auto: no replicas to split (no slots or one rank)"
    kind = "cpu" if device == "cpu" else ("cuda-multinode" if nodes > 1 else "cuda")
    cost = ALLREDUCE_US[kind] if allreduce_us is None else allreduce_us
    layer = MOE_LAYER_US["cpu" if device == "cpu" else "cuda"] if moe_layer_us is None else moe_layer_us
    gain = dispatch_gain_us(layer)
    mode: DispatchMode = "global" if cost < gain else "local"
    return mode, f"auto: counts all-reduce {cost:.0f} µs {'<' if cost < gain else '≥'} balance gain {gain:.1f} µs per layer"
