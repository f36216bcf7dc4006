"""Trace-driven simulator: replays per-iteration expert counts online for every placement policy.

Every policy sees only the past (except ``vexpert-future`` and ``bound``), turns it into a token
*share* ``[L, E, N]`` (which fraction of each expert's tokens each GPU computes), and is scored on
the *current* iteration's counts. Balance is SGLang's (mean/max GPU load per layer); predicted
throughput comes from the performance model (Eq. 1–2) with the H2D penalty of streamed vExperts,
EPLB's stop-the-world stalls, allocation and per-iteration dispatch costs from the profile, and
the decode batch that the HBM left for the KV cache allows.

Policies:
    static           contiguous placement, no replicas (B0)
    eplb             EPLB placement recomputed every ``eplb_interval`` iterations from the counts
                     since the last one, no redundant experts (B1)
    eplb-redundant   the same with one redundant expert per GPU, resident in every layer (B2)
    eplb-slots       the placement registry's ``eplb-redundant`` as a node runs it live: residents stay,
                     EPLB's redundant experts streamed into vExpert's slots, replanned every ``k``
                     (not run unless asked for)
    any other name of the placement registry: as a node runs it, replanned every ``k`` (not by default)
    b3-offload       the paper's B3: static placement, one resident expert per GPU evicted to host
                     and streamed back for every layer (frees HBM, gains no balance)
    vexpert-k1       vExpert's allocator every iteration on the previous one, no cost model
                     (ES-MoE-style streaming; was ``offload``), its allocations charged
    vexpert          the allocator every ``k`` iterations on the last ``k`` iterations' counts, with
                     per-iteration replica dispatch (``dispatch``, default chosen by the model)
    vexpert-future   the same heuristic fed each iteration's own counts (was ``oracle``; not a bound)
    bound            an upper bound on balance for the slot budget (static base, ≤ S copies per GPU
                     in any one layer, any split): a relaxation, see :func:`slot_budget_bound`

Every policy comes from the placement registry (:mod:`vexpert_runtime.policy.registry`): static,
EPLB (its stop-the-world ``rearrange`` form for eplb/eplb-redundant, its node ``plan`` for eplb-slots)
and vExpert's allocator for the vexpert rows.

Warm start: every policy starts from the same state. ``warmup = 0``: static for all. ``warmup = W``:
the first W iterations are prior traffic, not scored; every policy's first plan is made from them
(EPLB's offline plan, vExpert's first allocation), with no stall or allocation charged for it.

Per-iteration dispatch (``plan`` | ``local`` | ``allreduce`` | ``auto``): the placement stays for
k iterations, but each replicated expert's tokens are split over its existing copies from *that*
iteration's counts: ``local``, each rank water-fills its own tokens from its own counts (scaled by
the rank count, its estimate of the layer's load); ``allreduce``, the layer's counts are summed
over ranks first (one small all-reduce per layer) and water-filled
(:func:`allocator.water_fill_shares`); ``auto``, the performance model picks the faster one on the
last iteration before the first plan and keeps it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy import eplb
from vexpert_runtime.policy.allocator import AllocatorConfig, slots_overlap, water_fill_shares
from vexpert_runtime.policy.perf_model import (
    InferenceConstants,
    allocation_time,
    batch_for_hbm,
    dispatch_time,
    h2d_time,
    layer_time,
    streamed_copy_cost,
)
from vexpert_runtime.policy.placement import (
    balance_ratio,
    base_gpu_loads,
    gpu_loads,
    share_from_base,
    static_placement,
)
from vexpert_runtime.policy.profile import PerformanceProfile
from vexpert_runtime.policy.registry import (
    PLACEMENT_POLICIES,
    PlacementFunction,
    PlacementPolicy,
    placement_policy,
)

DEFAULT_POLICIES = ("static", "eplb", "eplb-redundant", "b3-offload", "vexpert-k1", "vexpert", "vexpert-future", "bound")
# every registry policy is a row: those without one of their own above run as a node runs them
POLICIES = (*DEFAULT_POLICIES, "eplb-slots", *(name for name in PLACEMENT_POLICIES if name not in DEFAULT_POLICIES))
RENAMED = {"oracle": "vexpert-future", "offload": "vexpert-k1"}
EPLB_VARIANTS = ("hierarchical", "global")
DISPATCH_MODES = ("plan", "local", "allreduce", "auto")
EPLB_SWEEP = (10, 20, 50, 100, 200, 500)


@dataclass(frozen=True)
class SimulationConfig:
    """What to simulate. ``num_nodes`` and ``expert_groups`` matter to EPLB's hierarchical policy."""

    num_gpus: int
    num_nodes: int = 1
    allocation_interval: int = 10  # k
    group_size: int = 2  # G
    vmax: int = 1
    balance_threshold: float = 0.7  # τ
    eplb_interval: int = 200
    eplb_policy: str = "auto"
    expert_groups: int = 0  # 0 = DeepSeek's 8 groups when E = 256, else 1
    policies: tuple[str, ...] = DEFAULT_POLICIES
    compare_eplb_policies: bool = False  # add eplb[-redundant]:hierarchical/global rows
    adjacency_bound: bool = True  # allocator keeps V_l + V_{l+1} ≤ G·vmax (False: group budget only)
    dispatch: str = "auto"  # vexpert's per-iteration replica dispatch
    eplb_dispatch: str = "plan"  # EPLB's replicas: SGLang splits evenly (plan); others for fairness
    compare_dispatch: bool = False  # add vexpert+plan/local/allreduce rows
    eplb_sweep: tuple[int, ...] = ()  # add eplb-redundant rows for these intervals (+ allreduce dispatch)
    warmup: int = 0  # iterations of prior traffic every policy's first plan is made from (not scored)
    seed: int = 0  # splits of each iteration's tokens over ranks (local dispatch)

    def validate(self, num_experts: int, iterations: int | None = None) -> None:
        if self.num_gpus <= 0:
            raise VExpertInputError("--gpus", f"must be positive, got {self.num_gpus}")
        if num_experts % self.num_gpus:
            raise VExpertInputError(
                "--gpus", f"{num_experts} experts cannot be split evenly over {self.num_gpus} GPUs",
                "use a GPU count that divides the expert count",
            )
        if self.num_nodes <= 0 or self.num_gpus % self.num_nodes:
            raise VExpertInputError("--nodes", f"{self.num_gpus} GPUs cannot be split evenly over {self.num_nodes} nodes")
        if self.allocation_interval <= 0:
            raise VExpertInputError("--k", f"must be ≥ 1, got {self.allocation_interval}")
        if self.eplb_interval <= 0 or any(i <= 0 for i in self.eplb_sweep):
            raise VExpertInputError("--eplb-interval", "EPLB intervals must be ≥ 1")
        if self.eplb_policy not in eplb.POLICIES:
            raise VExpertInputError("--eplb-policy", f"unknown policy {self.eplb_policy!r}", f"use one of {', '.join(eplb.POLICIES)}")
        for flag, mode in (("--dispatch", self.dispatch), ("--eplb-dispatch", self.eplb_dispatch)):
            if mode not in DISPATCH_MODES:
                raise VExpertInputError(flag, f"unknown dispatch {mode!r}", f"use one of {', '.join(DISPATCH_MODES)}")
        for p in self.policies:
            if p in RENAMED:
                raise VExpertInputError("--policies", f"policy {p!r} was renamed", f"use {RENAMED[p]!r}")
            if p not in POLICIES:
                raise VExpertInputError("--policies", f"unknown policy {p!r}", f"use any of {', '.join(POLICIES)}")
        if self.warmup < 0 or (iterations is not None and self.warmup >= iterations):
            raise VExpertInputError("--warmup", f"must be in [0, {iterations}), got {self.warmup}", "leave iterations to score")
        if self.groups(num_experts) <= 0 or num_experts % self.groups(num_experts):
            raise VExpertInputError("--expert-groups", f"{num_experts} experts cannot form {self.expert_groups} equal groups")
        self.allocator_config().validate()

    def allocator_config(self) -> AllocatorConfig:
        return AllocatorConfig(
            self.group_size, self.vmax, self.balance_threshold, adjacency_bound=self.adjacency_bound
        )

    def groups(self, num_experts: int) -> int:
        if self.expert_groups:
            return self.expert_groups
        return 8 if num_experts == 256 else 1


@dataclass
class PolicyResult:
    """Per-policy outcome over the scored iterations. ``balance`` is [T, L] (per iteration and layer)."""

    name: str
    balance: np.ndarray
    vexperts: np.ndarray  # [T, L] vExperts per GPU streamed for each layer
    stalls: int = 0
    plan_seconds: list[float] = field(default_factory=list)
    allocations: int = 0  # allocator runs charged to decode time (vexpert-future is charged none)
    slots: int = 0  # S: vExpert slots per GPU, alternating layout (0 = copies never wait for slots)
    dispatch: str = "plan"  # per-iteration dispatch used (auto resolved)
    resident_bytes: float = 0.0  # expert weights resident per GPU beyond the static placement
    scored: bool = True  # False: a bound, not a policy (no throughput)

    def summary(
        self, consts: InferenceConstants, profile: PerformanceProfile, static_tps: float | None, num_gpus: int,
        num_experts: int = 256,
    ) -> dict[str, Any]:
        """Stable keys: balance_mean, balance_p10 (over iterations), worst_layer(_balance), vExperts
        streamed per iteration (cluster total and per GPU), stalls, predicted throughput, dispatch,
        HBM (resident expert bytes, KV cache, batch)."""
        per_iter = self.balance.mean(axis=1)
        per_layer = self.balance.mean(axis=0)
        tps = predicted_tokens_per_s(self, consts, profile, num_experts)
        batch = batch_for_hbm(self.resident_bytes, consts, profile.hardware)
        return {
            "balance_mean": float(self.balance.mean()),
            "balance_p10": float(np.percentile(per_iter, 10)),
            "worst_layer": int(per_layer.argmin()),
            "worst_layer_balance": float(per_layer.min()),
            "vexperts_per_iteration": float(self.vexperts.sum(axis=1).mean() * num_gpus),
            "vexperts_per_gpu_per_iteration": float(self.vexperts.sum(axis=1).mean()),
            "rebalance_stalls": self.stalls,
            "allocations": self.allocations,
            "dispatch": self.dispatch,
            "resident_expert_gb_per_gpu": self.resident_bytes / 1e9,
            "batch_per_gpu": batch,
            "predicted_tokens_per_s_per_gpu": tps if self.scored else None,
            "predicted_relative_throughput": (tps / static_tps if static_tps else 1.0) if self.scored else None,
            "plans": len(self.plan_seconds),
            "plan_ms_median": float(np.median(self.plan_seconds) * 1e3) if self.plan_seconds else 0.0,
        }


def predicted_tokens_per_s(
    result: PolicyResult, consts: InferenceConstants, profile: PerformanceProfile, num_experts: int = 256
) -> float:
    """Decode tokens per second per GPU: the batch the policy's HBM leaves room for, over the
    predicted time of an iteration at that batch (:func:`predicted_total_time`)."""
    batch = batch_for_hbm(result.resident_bytes, consts, profile.hardware)
    at_batch = consts.model_copy(update={"tokens_per_gpu": max(batch, 1e-9)})
    total = predicted_total_time(result, at_batch, profile, num_experts)
    return float(result.balance.shape[0] * batch / total)


def predicted_total_time(
    result: PolicyResult, consts: InferenceConstants, profile: PerformanceProfile, num_experts: int = 256
) -> float:
    """Decode time of the whole trace (s): per layer T_a2a(L) + T_moe(L) (Eq. 1) + other work,
    plus every stop-the-world stall, every allocation (counts all-reduce + mapping, from the
    profile) and the per-iteration dispatch of every layer.

    Streamed vExperts go layer-ahead: layer l's copies run while layer l−1 computes (layer 0's
    behind the previous iteration's last layer, under the plan of that iteration), at Eq. 2's
    penalty η·T_H2D, any part longer than that compute exposed in full. With S slots laid out
    alternately (:func:`allocator.slots_overlap`), copies whose slots overlap the previous layer's
    wait for it to finish and cost their full time: a plan switch where the old plan's V_{L−1} and
    the new V_0 exceed S together, the same-parity wrap with L odd, or the bound turned off.
    """
    hw = profile.hardware
    balance = torch.from_numpy(result.balance).clamp(min=1e-6)
    v = torch.from_numpy(np.asarray(result.vexperts)).to(torch.int64)
    iterations, num_layers = balance.shape
    compute = layer_time(balance, consts, hw) + consts.other_time_per_layer_s  # [T, L]
    copy = h2d_time(v, consts, hw)  # [T, L]
    h2d_cost = streamed_copy_cost(copy, _previous_layer(compute), _waits_for_slots(v, result.slots), hw.contention_eta)
    dispatch = iterations * num_layers * dispatch_time(result.dispatch, num_experts, hw)
    alloc = result.allocations * allocation_time(consts, hw, num_layers, num_experts)
    return float(compute.sum() + h2d_cost.sum()) + result.stalls * consts.eplb_stall_s + alloc + dispatch


def _previous_layer(x: torch.Tensor) -> torch.Tensor:
    """[T, L] → [T, L]: the value of the layer run just before each one (layer L−1 of the previous
    iteration for layer 0; the first iteration's layer 0 follows its own layer L−1, steady state)."""
    flat = x.flatten()
    return torch.cat([x[0, -1:], flat[:-1]]).view_as(x)


def _waits_for_slots(v: torch.Tensor, slots: int) -> torch.Tensor:
    """[T, L] bool: layer l's slots overlap those of the layer before it (alternating layout)."""
    if slots <= 0:
        return torch.zeros_like(v, dtype=torch.bool)
    layer = torch.arange(v.shape[1]).expand_as(v)
    return slots_overlap(_previous_layer(layer), _previous_layer(v), layer, v, slots)


# --------------------------------------------------------------------------------------------
# Per-iteration replica dispatch
# --------------------------------------------------------------------------------------------


def holders_from_share(share: torch.Tensor) -> torch.Tensor:
    """GPUs holding a copy of each expert, from a share [L, E, N] (holder ⇔ share > 0).

    Returns replica_gpu [L, E, R] int64, ascending GPU ids, −1 padded; R = most holders of any
    expert (two copies of one expert on one GPU count once: dispatch can give that GPU both shares).
    """
    held = share > 0
    width = max(int(held.sum(-1).max()), 1)
    gpu = torch.arange(share.shape[-1]).expand_as(held)
    ranked = torch.where(held, gpu, share.shape[-1]).sort(-1).values[..., :width]
    return torch.where(ranked < share.shape[-1], ranked, -1)


def split_over_ranks(counts: torch.Tensor, num_ranks: int, generator: torch.Generator) -> torch.Tensor:
    """Which rank each of an iteration's routed tokens came from: every rank holds an equal share
    of the batch, so each expert's count is split multinomially (uniform) over the ranks.

    Args: counts [L, E] integer-valued. Returns [num_ranks, L, E] float32 summing to ``counts``.
    """
    left = counts.to(torch.float64)
    out = torch.empty(num_ranks, *counts.shape, dtype=torch.float32)
    for r in range(num_ranks - 1):  # binomial chain: rank r takes 1/(ranks left) of what is left
        take = torch.binomial(left, torch.full_like(left, 1.0 / (num_ranks - r)), generator=generator)
        out[r] = take.to(torch.float32)
        left = left - take
    out[-1] = left.to(torch.float32)
    return out


def dispatch_loads(
    counts: torch.Tensor, share: torch.Tensor, holders: torch.Tensor, mode: str, sweeps: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """GPU loads [T, L, N] of iterations ``counts`` [T, L, E] served by one placement.

    ``plan``: the plan's fixed ``share`` [L, E, N]. ``allreduce``: each iteration's counts
    water-filled over ``holders`` [L, E, R]. ``local``: each of N ranks water-fills its own tokens
    (:func:`split_over_ranks`) using its own counts × N as the layer's load.
    """
    num_gpus = share.shape[-1]
    holders = holders[..., : max(int((holders >= 0).sum(-1).max()), 1)]  # drop all-padding columns
    if mode == "plan" or holders.shape[-1] < 2:
        return gpu_loads(counts, share)
    iterations, num_layers, num_experts = counts.shape
    if mode == "allreduce":
        chunk = 16  # iterations per water-fill call: bounds the [chunk·L, E, R] tables
        parts = []
        for lo in range(0, iterations, chunk):
            flat = counts[lo : lo + chunk].reshape(-1, num_experts)
            table = holders.repeat(flat.shape[0] // num_layers, 1, 1)
            shares = water_fill_shares(flat, table, num_gpus, sweeps)
            parts.append(_table_loads(flat, table, shares, num_gpus).view(-1, num_layers, num_gpus))
        return torch.cat(parts)
    if mode == "local":
        table = holders.repeat(num_gpus, 1, 1)
        out = torch.empty(iterations, num_layers, num_gpus)
        for t in range(iterations):
            mine = split_over_ranks(counts[t], num_gpus, generator).view(num_gpus * num_layers, num_experts)
            shares = water_fill_shares(mine * num_gpus, table, num_gpus, sweeps)
            out[t] = _table_loads(mine, table, shares, num_gpus).view(num_gpus, num_layers, num_gpus).sum(0)
        return out
    raise ValueError(f"unknown dispatch mode {mode!r}")


def _table_loads(counts: torch.Tensor, replica_gpu: torch.Tensor, share: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Tokens per GPU [X, N] from counts [X, E] and a replica table [X, E, R] with shares."""
    loads = torch.zeros(counts.shape[0], num_gpus + 1)
    index = torch.where(replica_gpu >= 0, replica_gpu, num_gpus).flatten(1)
    loads.scatter_add_(1, index, (counts.unsqueeze(-1) * share).flatten(1))
    return loads[:, :num_gpus]


def choose_dispatch(
    counts: torch.Tensor, share: torch.Tensor, holders: torch.Tensor, sweeps: int, consts: InferenceConstants,
    profile: PerformanceProfile, generator: torch.Generator,
) -> str:
    """The performance model's pick between rank-local and all-reduced dispatch: predicted time of
    the iteration ``counts`` [1, L, E] (the last one before the plan, i.e. the past) under each,
    Eq. 1 at the resulting balance plus each mode's cost per layer (:func:`dispatch_time`)."""
    hw = profile.hardware
    times = {}
    for mode in ("local", "allreduce"):
        balance = balance_ratio(dispatch_loads(counts, share, holders, mode, sweeps, generator))
        per_layer = layer_time(balance.clamp(min=1e-6), consts, hw) + dispatch_time(mode, counts.shape[-1], hw)
        times[mode] = float(per_layer.sum())
    return min(times, key=lambda m: times[m])


# --------------------------------------------------------------------------------------------
# Policies: each yields a Step whenever its plan changes
# --------------------------------------------------------------------------------------------


class Step(NamedTuple):
    start: int  # first iteration the plan serves
    share: torch.Tensor  # [L, E, N]
    vexperts: torch.Tensor  # [L] vExperts per GPU streamed for each layer
    stall: bool  # a stop-the-world rearrangement is charged
    charged: bool  # an allocation is charged
    holders: torch.Tensor | None = None  # [L, E, R] GPUs holding each expert (None: from share)


Schedule = Iterator[Step]


def _static_schedule(counts: torch.Tensor, cfg: SimulationConfig) -> Schedule:
    """The registry's static plan, planned once (it is the same for any counts)."""
    _, num_layers, num_experts = counts.shape
    base = static_placement(num_layers, num_experts, cfg.num_gpus)
    plan = PLACEMENT_POLICIES["static"].plan(torch.zeros(num_layers, num_experts), base, cfg.num_gpus)
    yield Step(0, plan.expert_gpu_share(), plan.vexperts, False, False)


def _b3_schedule(counts: torch.Tensor, cfg: SimulationConfig) -> Schedule:
    """B3: the static placement with one of each GPU's experts streamed back for every layer."""
    _, num_layers, num_experts = counts.shape
    base = static_placement(num_layers, num_experts, cfg.num_gpus)
    yield Step(0, share_from_base(base, cfg.num_gpus), torch.ones(num_layers, dtype=torch.int64), False, False)


def _plan_starts(iterations: int, warmup: int, interval: int) -> list[int]:
    """Iterations at which a periodic policy replans: at the warm start (W > 0), then every
    ``interval`` (from ``interval`` when there is no warm-up: nothing to plan from at 0)."""
    first = warmup if warmup > 0 else interval
    return list(range(first, iterations, interval))


def _eplb_schedule(
    counts: torch.Tensor, cfg: SimulationConfig, redundant: bool, policy: str, interval: int, timings: list[float]
) -> Schedule:
    """EPLB as DeepSeek runs it (the registry's ``rearrange`` form): every ``interval`` iterations
    all experts placed anew from the counts since the last plan, a stall charged for each move."""
    iterations, num_layers, num_experts = counts.shape
    yield from _static_schedule(counts, cfg)
    rearrange = PLACEMENT_POLICIES["eplb-redundant"].rearrange
    assert rearrange is not None  # the registry's EPLB has its stop-the-world form
    zero_v = torch.zeros(num_layers, dtype=torch.int64)
    for start in _plan_starts(iterations, cfg.warmup, interval):
        warm = start == cfg.warmup and cfg.warmup > 0
        window = counts[: cfg.warmup].sum(0) if warm else counts[max(0, start - interval) : start].sum(0)
        t0 = time.perf_counter()
        redundant_count = cfg.num_gpus if redundant else 0
        share = rearrange(window, redundant_count, cfg.groups(num_experts), cfg.num_nodes, cfg.num_gpus, policy)
        timings.append(time.perf_counter() - t0)
        yield Step(start, share, zero_v, not warm, False)


def _allocator_schedule(
    counts: torch.Tensor,
    cfg: SimulationConfig,
    alloc_cfg: AllocatorConfig,
    profile: PerformanceProfile,
    consts: InferenceConstants,
    interval: int,
    lookahead: bool,
    timings: list[float],
    plan_with: PlacementFunction,
) -> Schedule:
    """A registry policy's ``plan_with`` (the allocator for the vexpert rows) every ``interval``
    iterations on the last ``interval`` iterations' counts (the whole warm-up for the first plan),
    or (``lookahead``) on the iterations it is about to serve."""
    iterations, num_layers, num_experts = counts.shape
    base = static_placement(num_layers, num_experts, cfg.num_gpus)
    if lookahead:
        starts = list(range(0, iterations, interval))
    else:
        yield from _static_schedule(counts, cfg)
        starts = _plan_starts(iterations, cfg.warmup, interval)
    for start in starts:
        warm = not lookahead and start == cfg.warmup and cfg.warmup > 0
        if lookahead:
            window = counts[start : start + interval]
        else:
            window = counts[: cfg.warmup] if warm else counts[start - interval : start]
        t0 = time.perf_counter()
        plan = plan_with(window.sum(0), base, cfg.num_gpus, alloc_cfg, profile, consts)
        timings.append(time.perf_counter() - t0)
        yield Step(start, plan.expert_gpu_share(), plan.vexperts, False, not (lookahead or warm), plan.replica_gpu)


def _replay(
    name: str, counts: torch.Tensor, schedule: Schedule, timings: list[float], dispatch: str, warmup: int,
    choose: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], str], sweeps: int, generator: torch.Generator,
) -> PolicyResult:
    """Serve ``counts`` with the schedule's plans, each iteration dispatched by ``dispatch``
    (``auto``: ``choose(past_counts [1, L, E], share, holders)`` at the first plan with a past);
    score iterations ≥ ``warmup``."""
    iterations, num_layers, _ = counts.shape
    balance = np.zeros((iterations, num_layers), dtype=np.float64)
    vexperts = np.zeros((iterations, num_layers), dtype=np.int64)
    stalls = allocations = 0
    mode = dispatch
    pending: Step | None = next(schedule)
    while pending is not None:
        nxt = next(schedule, None)
        end = nxt.start if nxt is not None else iterations
        holders = pending.holders if pending.holders is not None else holders_from_share(pending.share)
        if mode == "auto" and pending.start > 0 and holders.shape[-1] > 1:
            mode = choose(counts[pending.start - 1 : pending.start], pending.share, holders)
        used = "allreduce" if mode == "auto" else mode  # no past yet: the cheap-to-evaluate one
        # warm-up iterations are not scored: serve them with the plan's shares
        lo = max(pending.start, min(warmup, end))
        if lo > pending.start:
            balance[pending.start : lo] = balance_ratio(gpu_loads(counts[pending.start : lo], pending.share)).numpy()
        if end > lo:
            loads = dispatch_loads(counts[lo:end], pending.share, holders, used, sweeps, generator)
            balance[lo:end] = balance_ratio(loads).numpy()
        vexperts[pending.start : end] = pending.vexperts.numpy()
        stalls += int(pending.stall and pending.start >= warmup)
        allocations += int(pending.charged and pending.start >= warmup)
        pending = nxt
    resolved = mode if mode != "auto" else "plan"  # never a plan with copies: nothing to dispatch
    return PolicyResult(name, balance[warmup:], vexperts[warmup:], stalls, timings, allocations, dispatch=resolved)


def _checked_trace(counts: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The trace as float32 [T, L, E]; a wrong shape, an empty trace or a negative count is a
    one-line error naming ``counts``."""
    counts_t = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    if counts_t.dim() != 3:
        raise VExpertInputError("counts", f"trace must be [iterations, layers, experts], got shape {tuple(counts_t.shape)}")
    if counts_t.numel() == 0:
        raise VExpertInputError("counts", "trace is empty")
    if bool((counts_t < 0).any()):
        raise VExpertInputError("counts", "trace has negative expert counts", "rebuild it with `vexpert trace build`")
    return counts_t


def simulate(
    counts: np.ndarray | torch.Tensor,
    cfg: SimulationConfig,
    profile: PerformanceProfile | None = None,
    consts: InferenceConstants | None = None,
    progress: Callable[[str], None] | None = None,
    allocator_profile: PerformanceProfile | None = None,
) -> dict[str, PolicyResult]:
    """Replay ``counts`` [T, L, E] for every policy in ``cfg.policies``. Deterministic.

    ``allocator_profile`` is what the allocator *believes* (default: ``profile``); scoring always
    uses the measured balance and ``profile``'s hardware. Giving a wrong one measures how
    sensitive decisions are to calibration error (:func:`sensitivity`)."""
    counts_t = _checked_trace(counts)
    iterations, num_layers, num_experts = counts_t.shape
    cfg.validate(num_experts, iterations)
    profile = profile or PerformanceProfile()
    believed = allocator_profile or profile
    consts = consts or InferenceConstants(experts_per_gpu=num_experts // cfg.num_gpus)
    alloc_cfg = cfg.allocator_config()
    sweeps = alloc_cfg.share_refinement_sweeps
    # vexpert-k1 streams one copy into every layer: two alternating slots hold layers l and l+1,
    # so its one-slot plans are not bounded by adjacency (that would halve every other layer).
    k1_cfg = AllocatorConfig(group_size=1, vmax=1, balance_threshold=1.0, use_cost_model=False, adjacency_bound=False)
    expert_bytes = float(consts.expert_bytes)
    results: dict[str, PolicyResult] = {}

    def choose(past: torch.Tensor, share: torch.Tensor, holders: torch.Tensor) -> str:
        return choose_dispatch(past, share, holders, sweeps, consts, profile, torch.Generator().manual_seed(cfg.seed + 1))

    def run(name: str, make: Callable[[list[float]], Schedule], dispatch: str = "plan", slots: int = 0,
            resident: float = 0.0) -> None:
        if progress:
            progress(name)
        timings: list[float] = []
        generator = torch.Generator().manual_seed(cfg.seed)
        result = _replay(name, counts_t, make(timings), timings, dispatch, cfg.warmup, choose, sweeps, generator)
        results[name] = replace(result, slots=slots, resident_bytes=resident)

    def run_eplb(name: str, redundant: bool, variant: str, interval: int, dispatch: str) -> None:
        resident = num_layers * expert_bytes if redundant else 0.0  # one redundant expert per GPU per layer
        dispatch = dispatch if redundant else "plan"  # no copies: nothing to split, nothing to charge
        run(name, lambda t: _eplb_schedule(counts_t, cfg, redundant, variant, interval, t), dispatch, resident=resident)

    vexpert = PLACEMENT_POLICIES["vexpert"].plan

    def run_live(name: str, entry: PlacementPolicy, dispatch: str) -> None:
        """A registry policy as a node runs it: replanned every k iterations from the last k."""
        run(name, lambda t: _allocator_schedule(counts_t, cfg, alloc_cfg, believed, consts, cfg.allocation_interval,
                                                False, t, entry.plan),
            dispatch, alloc_cfg.slots_per_gpu, alloc_cfg.slots_per_gpu * expert_bytes)

    def run_vexpert(name: str, dispatch: str) -> None:
        run(name, lambda t: _allocator_schedule(counts_t, cfg, alloc_cfg, believed, consts, cfg.allocation_interval, False, t,
                                                vexpert),
            dispatch, alloc_cfg.slots_per_gpu, alloc_cfg.slots_per_gpu * expert_bytes)

    # static is the throughput reference, so it always runs.
    policies = cfg.policies if "static" in cfg.policies else ("static", *cfg.policies)
    for policy in policies:
        if policy == "static":
            run(policy, lambda t: _static_schedule(counts_t, cfg))
        elif policy in ("eplb", "eplb-redundant"):
            redundant = policy == "eplb-redundant"
            suffix = "" if cfg.eplb_dispatch == "plan" or not redundant else f"+{cfg.eplb_dispatch}"
            run_eplb(policy + suffix, redundant, cfg.eplb_policy, cfg.eplb_interval, cfg.eplb_dispatch)
            if cfg.compare_eplb_policies:
                for variant in _eplb_variants(cfg, num_experts):
                    run_eplb(f"{policy}:{variant}{suffix}", redundant, variant, cfg.eplb_interval, cfg.eplb_dispatch)
        elif policy == "eplb-slots":
            run_live(policy, PLACEMENT_POLICIES["eplb-redundant"], cfg.eplb_dispatch)
        elif policy == "b3-offload":
            # one expert per GPU per layer lives on the host: L experts' HBM freed, 2 slots stream them
            run(policy, lambda t: _b3_schedule(counts_t, cfg), slots=2, resident=(2 - num_layers) * expert_bytes)
        elif policy == "vexpert-k1":
            run(policy, lambda t: _allocator_schedule(counts_t, cfg, k1_cfg, believed, consts, 1, False, t, vexpert),
                slots=2, resident=2 * expert_bytes)
        elif policy == "vexpert":
            run_vexpert(policy, cfg.dispatch)
            if cfg.compare_dispatch:
                for mode in ("plan", "local", "allreduce"):
                    run_vexpert(f"vexpert+{mode}", mode)
        elif policy == "vexpert-future":
            run(policy, lambda t: _allocator_schedule(counts_t, cfg, alloc_cfg, believed, consts, 1, True, t, vexpert),
                slots=alloc_cfg.slots_per_gpu, resident=alloc_cfg.slots_per_gpu * expert_bytes)
        elif policy == "bound":
            base = static_placement(num_layers, num_experts, cfg.num_gpus)
            bound = budget_bound(counts_t[cfg.warmup :], base, cfg.num_gpus, alloc_cfg.slots_per_gpu)
            results[policy] = PolicyResult(policy, bound.numpy().astype(np.float64),
                                           np.zeros(bound.shape, dtype=np.int64), scored=False)
        else:  # a registry policy without a row of its own (validate() admits no other name)
            entry = placement_policy(policy, "--policies")
            run_live(policy, entry, "plan" if entry.even_split else cfg.dispatch)
    for interval in cfg.eplb_sweep:
        for variant in _eplb_variants(cfg, num_experts):
            for mode in dict.fromkeys(("plan", "allreduce" if cfg.eplb_dispatch == "plan" else cfg.eplb_dispatch)):
                suffix = "" if mode == "plan" else f"+{mode}"
                run_eplb(f"eplb-redundant:{variant}@{interval}{suffix}", True, variant, interval, mode)
    return results


def _eplb_variants(cfg: SimulationConfig, num_experts: int) -> list[str]:
    """EPLB variants that apply: hierarchical needs the groups to split evenly over the nodes."""
    if cfg.eplb_policy != "auto" and not cfg.compare_eplb_policies:
        return [cfg.eplb_policy]
    if cfg.num_nodes == 1 and cfg.groups(num_experts) == 1:
        return ["global"]  # one group on one node: hierarchical is the global policy
    return [v for v in EPLB_VARIANTS if v != "hierarchical" or cfg.groups(num_experts) % cfg.num_nodes == 0]


# --------------------------------------------------------------------------------------------
# An upper bound on balance for the slot budget
# --------------------------------------------------------------------------------------------


def budget_bound(counts: torch.Tensor, base_gpu: torch.Tensor, num_gpus: int, slots: int) -> torch.Tensor:
    """Upper bound on each iteration's layer-mean balance for S = ``slots`` slots per GPU with
    layer-ahead streaming (V_l + V_{l+1} ≤ S, cyclic, which also holds every group budget of
    G = 2): per layer the relaxation :func:`slot_budget_bound` for V = 0..S copies, then the best
    V_l per iteration by a cyclic dynamic programme over layers.

    Args: counts [T, L, E]; base_gpu [L, E]. Returns [T, L] float32: each layer's bound under the
    best budget split; their mean bounds the iteration's mean balance (not each layer's).
    """
    per_v = torch.stack([slot_budget_bound(counts, base_gpu, num_gpus, v) for v in range(slots + 1)], -1)  # [T, L, S+1]
    _, num_layers, width = per_v.shape
    allowed = torch.arange(width).view(-1, 1) + torch.arange(width).view(1, -1) <= slots  # [prev, cur]
    best_total = torch.full(per_v.shape[:1], -1.0)
    best_choice = torch.zeros(per_v.shape[:2], dtype=torch.int64)
    neg = torch.tensor(-1e9)
    for first in range(width):  # fix V_0, close the cycle at the end
        value = torch.where(torch.arange(width) == first, per_v[:, 0], neg)  # [T, S+1]
        back = []
        for layer in range(1, num_layers):
            cand = torch.where(allowed, value.unsqueeze(-1), neg)  # [T, prev, cur]
            value, arg = cand.max(1)
            value = value + per_v[:, layer]
            back.append(arg)
        value = torch.where(allowed[:, first].unsqueeze(0), value, neg)  # V_{L−1} + V_0 ≤ S
        total, last = value.max(-1)
        choice = torch.empty_like(best_choice)
        choice[:, -1] = last
        for layer in range(num_layers - 1, 0, -1):
            choice[:, layer - 1] = back[layer - 1].gather(1, choice[:, layer : layer + 1]).squeeze(1)
        better = total > best_total
        best_total = torch.where(better, total, best_total)
        best_choice = torch.where(better.unsqueeze(-1), choice, best_choice)
    return per_v.gather(-1, best_choice.unsqueeze(-1)).squeeze(-1)


def slot_budget_bound(counts: torch.Tensor, base_gpu: torch.Tensor, num_gpus: int, copies: int, steps: int = 40) -> torch.Tensor:
    """Upper bound on the balance ratio of any plan that keeps the base placement ``base_gpu``
    [L, E] and puts at most ``copies`` extra expert copies on each GPU in a layer, with any split
    of tokens over copies, planned with the iteration's own counts.

    Relaxation: GPU g can take in at most the tokens of the ``copies`` heaviest experts it does not
    hold (cap_g), and only up to the peak M. A peak M is reachable only if (1) the load above M,
    Σ_g max(0, base_g − M), fits into Σ_g min(max(0, M − base_g), cap_g), and (2) the copies it
    needs fit the budget: a copy of one of g's experts carries at most min(g's heaviest expert,
    M − the lightest GPU's load), so g needs ≥ max(0, base_g − M) / that many of the N·copies.
    Both are necessary, so the smallest such M (bisection) bounds the peak from below and mean / M
    bounds balance from above. Args: counts [T, L, E]. Returns [T, L] float32 in (0, 1].
    """
    counts = counts.to(torch.float32)
    base = base_gpu_loads(counts, base_gpu, num_gpus)  # [T, L, N]
    per_gpu = counts.shape[-1] // num_gpus
    top = min(copies + per_gpu, counts.shape[-1])
    heavy, idx = counts.topk(top, dim=-1)  # [T, L, K]
    owner = torch.gather(base_gpu.expand(counts.shape[0], -1, -1), -1, idx)  # [T, L, K]
    foreign = owner.unsqueeze(-2) != torch.arange(num_gpus).view(1, 1, num_gpus, 1)  # [T, L, N, K]
    # the first `copies` foreign experts in descending order, per GPU
    rank = foreign.to(torch.int64).cumsum(-1)
    take = foreign & (rank <= copies)
    cap = (heavy.unsqueeze(-2) * take).sum(-1)  # [T, L, N]
    own_max = torch.zeros_like(base).scatter_reduce_(-1, base_gpu.expand(counts.shape), counts, "amax")  # [T, L, N]
    mean = base.mean(-1, keepdim=True)
    lo, hi = mean.clone(), base.amax(-1, keepdim=True)
    for _ in range(steps):
        mid = (lo + hi) / 2
        excess = (base - mid).clamp(min=0).sum(-1, keepdim=True)
        room = torch.minimum((mid - base).clamp(min=0), cap).sum(-1, keepdim=True)
        # each copy of one of g's experts carries at most min(its load, M − the lightest GPU)
        carry = torch.minimum(own_max, (mid - base.amin(-1, keepdim=True)).clamp(min=1e-9))
        needed = ((base - mid).clamp(min=0) / carry).sum(-1, keepdim=True)
        ok = (room >= excess) & (needed <= copies * num_gpus)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    peak = hi.squeeze(-1)
    return torch.where(peak > 0, mean.squeeze(-1) / peak.clamp(min=1e-12), torch.ones_like(peak))


def summarize(
    results: dict[str, PolicyResult], profile: PerformanceProfile | None = None, consts: InferenceConstants | None = None,
    num_experts: int = 256, num_gpus: int = 64,
) -> dict[str, dict[str, Any]]:
    """Per-policy summary dict (stable key names; see ``PolicyResult.summary``)."""
    profile = profile or PerformanceProfile()
    consts = consts or InferenceConstants(experts_per_gpu=max(1, num_experts // num_gpus))
    static_tps = predicted_tokens_per_s(results["static"], consts, profile, num_experts) if "static" in results else None
    return {name: r.summary(consts, profile, static_tps, num_gpus, num_experts) for name, r in results.items()}


SENSITIVITY_PARAMETERS = {
    "alpha": ("load_balance", "alpha"),
    "beta": ("load_balance", "beta"),
    "intercept": ("load_balance", "intercept"),
    "h2d_bandwidth": ("hardware", "h2d_bandwidth_gb_per_s"),
    "eta": ("hardware", "contention_eta"),
}


def perturbed(profile: PerformanceProfile, parameter: str, factor: float) -> PerformanceProfile:
    """A copy of ``profile`` with one parameter (a key of SENSITIVITY_PARAMETERS) scaled."""
    section, field_name = SENSITIVITY_PARAMETERS[parameter]
    part = getattr(profile, section)
    return profile.model_copy(update={section: part.model_copy(update={field_name: getattr(part, field_name) * factor})})


def sensitivity(
    counts: np.ndarray | torch.Tensor,
    cfg: SimulationConfig,
    profile: PerformanceProfile | None = None,
    consts: InferenceConstants | None = None,
    error: float = 0.2,
) -> dict[str, dict[str, float]]:
    """Paper Table 2: throughput change of ``vexpert`` when the allocator uses a profile with one
    parameter off by ±``error``, scored with the true one. Returns {param: {"-20%": Δ, "+20%": Δ}}
    as relative changes (−0.012 = 1.2 % slower)."""
    profile = profile or PerformanceProfile()
    only = replace(cfg, policies=("static", "vexpert"), eplb_sweep=(), compare_dispatch=False, compare_eplb_policies=False)
    num_experts = int(np.asarray(counts).shape[-1])
    consts = consts or InferenceConstants(experts_per_gpu=num_experts // cfg.num_gpus)

    def throughput(believed: PerformanceProfile) -> float:
        res = simulate(counts, only, profile, consts, allocator_profile=believed)
        return predicted_tokens_per_s(res["vexpert"], consts, profile, num_experts)

    reference = throughput(profile)
    table: dict[str, dict[str, float]] = {}
    for name in SENSITIVITY_PARAMETERS:
        table[name] = {
            f"{sign}{round(error * 100)}%": throughput(perturbed(profile, name, 1 + s * error)) / reference - 1.0
            for sign, s in (("-", -1), ("+", 1))
        }
    return table
