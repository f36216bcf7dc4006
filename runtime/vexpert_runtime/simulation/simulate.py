"""Trace-driven simulator: replays per-iteration expert counts online for every placement policy.

Every policy sees only the past (except ``oracle``, the upper bound for vExpert's slot budget),
turns it into a token *share* ``[L, E, N]`` (which fraction of each expert's tokens each GPU
computes), and is scored on the *current* iteration's counts. Balance is SGLang's (mean/max GPU
load per layer); predicted throughput comes from the performance model (Eq. 1–2) with the H2D
penalty of streamed vExperts and EPLB's stop-the-world rearrangement stalls.

Policies:
    static           contiguous placement, no replicas (B0)
    eplb             EPLB placement recomputed every ``eplb_interval`` iterations from the counts
                     since the last one, no redundant experts (B1)
    eplb-redundant   the same with one redundant expert per GPU (B2)
    offload          one streamed vExpert per GPU in every layer, hottest experts of the previous
                     iteration, no performance model (ES-MoE style), in 2 alternating slots per GPU
                     (the HBM of vExpert at G = 2, Vmax = 1)
    vexpert          the allocator every ``k`` iterations on the last ``k`` iterations' counts
    oracle           the allocator fed each iteration's own counts
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy import eplb
from vexpert_runtime.policy.allocator import AllocatorConfig, Plan, allocate, slots_overlap
from vexpert_runtime.policy.perf_model import InferenceConstants, h2d_time, layer_time, streamed_copy_cost
from vexpert_runtime.policy.placement import balance_ratio, gpu_loads, share_from_base, static_placement
from vexpert_runtime.policy.profile import PerformanceProfile

POLICIES = ("static", "eplb", "eplb-redundant", "offload", "vexpert", "oracle")
EPLB_VARIANTS = ("hierarchical", "global")


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
    policies: tuple[str, ...] = POLICIES
    compare_eplb_policies: bool = False  # add eplb[-redundant]:hierarchical/global rows
    adjacency_bound: bool = True  # allocator keeps V_l + V_{l+1} ≤ G·vmax (False: group budget only)

    def validate(self, num_experts: int) -> None:
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
        if self.eplb_interval <= 0:
            raise VExpertInputError("--eplb-interval", f"must be ≥ 1, got {self.eplb_interval}")
        if self.eplb_policy not in eplb.POLICIES:
            raise VExpertInputError("--eplb-policy", f"unknown policy {self.eplb_policy!r}", f"use one of {', '.join(eplb.POLICIES)}")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise VExpertInputError("--policies", f"unknown policy {unknown[0]!r}", f"use any of {', '.join(POLICIES)}")
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
    """Per-policy outcome. ``balance`` is [T, L] (per iteration and layer)."""

    name: str
    balance: np.ndarray
    vexperts: np.ndarray  # [T, L] vExperts per GPU streamed for each layer
    stalls: int = 0
    plan_seconds: list[float] = field(default_factory=list)
    allocations: int = 0  # allocator runs charged to decode time (the oracle is charged none)
    slots: int = 0  # S: vExpert slots per GPU, alternating layout (0 = copies never wait for slots)

    def summary(
        self, consts: InferenceConstants, profile: PerformanceProfile, static_time: float | None, num_gpus: int
    ) -> dict[str, Any]:
        """Stable keys: balance_mean, balance_p10 (over iterations), worst_layer(_balance), vExperts
        streamed per iteration (cluster total and per GPU), stalls, predicted throughput."""
        per_iter = self.balance.mean(axis=1)
        per_layer = self.balance.mean(axis=0)
        total_time = predicted_total_time(self, consts, profile)
        tokens = self.balance.shape[0] * consts.tokens_per_gpu
        return {
            "balance_mean": float(self.balance.mean()),
            "balance_p10": float(np.percentile(per_iter, 10)),
            "worst_layer": int(per_layer.argmin()),
            "worst_layer_balance": float(per_layer.min()),
            "vexperts_per_iteration": float(self.vexperts.sum(axis=1).mean() * num_gpus),
            "vexperts_per_gpu_per_iteration": float(self.vexperts.sum(axis=1).mean()),
            "rebalance_stalls": self.stalls,
            "allocations": self.allocations,
            "predicted_tokens_per_s_per_gpu": float(tokens / total_time),
            "predicted_relative_throughput": float(static_time / total_time) if static_time else 1.0,
            "plans": len(self.plan_seconds),
            "plan_ms_median": float(np.median(self.plan_seconds) * 1e3) if self.plan_seconds else 0.0,
        }


def predicted_total_time(result: PolicyResult, consts: InferenceConstants, profile: PerformanceProfile) -> float:
    """Decode time of the whole trace (s): per layer T_a2a(L) + T_moe(L) (Eq. 1) + other work,
    plus every stop-the-world stall and every allocation (count all-reduce + mapping, paper App. F).

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
    compute = layer_time(balance, consts, hw) + consts.other_time_per_layer_s  # [T, L]
    copy = h2d_time(v, consts, hw)  # [T, L]
    h2d_cost = streamed_copy_cost(copy, _previous_layer(compute), _waits_for_slots(v, result.slots), hw.contention_eta)
    return float(compute.sum() + h2d_cost.sum()) + result.stalls * consts.eplb_stall_s + (
        result.allocations * consts.allocation_time_s
    )


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
# Policies: each yields (first_iteration, share [L, E, N], vexperts [L]) whenever its plan changes
# --------------------------------------------------------------------------------------------

Schedule = Iterator[tuple[int, torch.Tensor, torch.Tensor, bool]]  # (start, share, V per layer, stalls)


def _static_schedule(counts: torch.Tensor, cfg: SimulationConfig) -> Schedule:
    _, num_layers, num_experts = counts.shape
    base = static_placement(num_layers, num_experts, cfg.num_gpus)
    yield 0, share_from_base(base, cfg.num_gpus), torch.zeros(num_layers, dtype=torch.int64), False


def _eplb_schedule(counts: torch.Tensor, cfg: SimulationConfig, redundant: bool, policy: str, timings: list[float]) -> Schedule:
    iterations, num_layers, num_experts = counts.shape
    yield from _static_schedule(counts, cfg)
    replicas = num_experts + (cfg.num_gpus if redundant else 0)
    zero_v = torch.zeros(num_layers, dtype=torch.int64)
    for start in range(cfg.eplb_interval, iterations, cfg.eplb_interval):
        window = counts[start - cfg.eplb_interval : start].sum(0)
        t0 = time.perf_counter()
        phy2log, _, logcnt = eplb.rebalance_experts(
            window, replicas, cfg.groups(num_experts), cfg.num_nodes, cfg.num_gpus, policy
        )
        share = eplb.expert_gpu_share(phy2log, logcnt, num_experts, cfg.num_gpus)
        timings.append(time.perf_counter() - t0)
        yield start, share, zero_v, True


def _allocator_schedule(
    counts: torch.Tensor,
    cfg: SimulationConfig,
    alloc_cfg: AllocatorConfig,
    profile: PerformanceProfile,
    consts: InferenceConstants,
    interval: int,
    lookahead: bool,
    timings: list[float],
) -> Schedule:
    """Allocator every ``interval`` iterations on the last ``interval`` iterations' counts, or
    (``lookahead``) on the iterations it is about to serve."""
    iterations, num_layers, num_experts = counts.shape
    base = static_placement(num_layers, num_experts, cfg.num_gpus)
    if not lookahead:
        yield from _static_schedule(counts, cfg)
    first = 0 if lookahead else interval
    for start in range(first, iterations, interval):
        window = counts[start : start + interval] if lookahead else counts[start - interval : start]
        t0 = time.perf_counter()
        plan: Plan = allocate(window.sum(0), base, cfg.num_gpus, alloc_cfg, profile, consts)
        timings.append(time.perf_counter() - t0)
        yield start, plan.expert_gpu_share(), plan.vexperts, False


def _replay(name: str, counts: torch.Tensor, schedule: Schedule, timings: list[float]) -> PolicyResult:
    iterations, num_layers, _ = counts.shape
    balance = np.zeros((iterations, num_layers), dtype=np.float64)
    vexperts = np.zeros((iterations, num_layers), dtype=np.int64)
    stalls = 0
    pending: tuple[int, torch.Tensor, torch.Tensor, bool] | None = next(schedule)
    while pending is not None:
        start, share, v, stall = pending
        nxt = next(schedule, None)
        end = nxt[0] if nxt is not None else iterations
        block = counts[start:end]
        balance[start:end] = balance_ratio(gpu_loads(block, share)).numpy()
        vexperts[start:end] = v.numpy()
        stalls += int(stall)
        pending = nxt
    return PolicyResult(name, balance, vexperts, stalls, timings)


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
    counts_t = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    if counts_t.dim() != 3:
        raise VExpertInputError("counts", f"trace must be [iterations, layers, experts], got shape {tuple(counts_t.shape)}")
    if counts_t.numel() == 0:
        raise VExpertInputError("counts", "trace is empty")
    if bool((counts_t < 0).any()):
        raise VExpertInputError("counts", "trace has negative expert counts", "rebuild it with `vexpert trace build`")
    _, _num_layers, num_experts = counts_t.shape
    cfg.validate(num_experts)
    profile = profile or PerformanceProfile()
    believed = allocator_profile or profile
    consts = consts or InferenceConstants(experts_per_gpu=num_experts // cfg.num_gpus)
    alloc_cfg = cfg.allocator_config()
    # Offload streams one copy into every layer: two alternating slots hold layers l and l+1, so
    # its one-slot plans are not bounded by adjacency (that would halve every other layer).
    offload_cfg = AllocatorConfig(group_size=1, vmax=1, balance_threshold=1.0, use_cost_model=False, adjacency_bound=False)
    offload_slots = 2
    results: dict[str, PolicyResult] = {}

    def run(name: str, make: Callable[[list[float]], Schedule]) -> None:
        if progress:
            progress(name)
        timings: list[float] = []
        results[name] = _replay(name, counts_t, make(timings), timings)
        if name in ("offload", "vexpert"):
            results[name].allocations = len(timings)
        results[name].slots = offload_slots if name == "offload" else alloc_cfg.slots_per_gpu

    # static is the throughput reference, so it always runs.
    policies = cfg.policies if "static" in cfg.policies else ("static", *cfg.policies)
    for policy in policies:
        if policy == "static":
            run(policy, lambda t: _static_schedule(counts_t, cfg))
        elif policy in ("eplb", "eplb-redundant"):
            redundant = policy == "eplb-redundant"
            run(policy, partial(_eplb_schedule, counts_t, cfg, redundant, cfg.eplb_policy))
            if cfg.compare_eplb_policies:
                for variant in EPLB_VARIANTS:
                    if variant == "hierarchical" and cfg.groups(num_experts) % cfg.num_nodes:
                        continue
                    run(f"{policy}:{variant}", partial(_eplb_schedule, counts_t, cfg, redundant, variant))
        elif policy == "offload":
            run(policy, lambda t: _allocator_schedule(counts_t, cfg, offload_cfg, believed, consts, 1, False, t))
        elif policy == "vexpert":
            run(policy, lambda t: _allocator_schedule(counts_t, cfg, alloc_cfg, believed, consts, cfg.allocation_interval, False, t))
        elif policy == "oracle":
            run(policy, lambda t: _allocator_schedule(counts_t, cfg, alloc_cfg, believed, consts, 1, True, t))
    return results


def summarize(
    results: dict[str, PolicyResult], profile: PerformanceProfile | None = None, consts: InferenceConstants | None = None,
    num_experts: int = 256, num_gpus: int = 64,
) -> dict[str, dict[str, Any]]:
    """Per-policy summary dict (stable key names; see ``PolicyResult.summary``)."""
    profile = profile or PerformanceProfile()
    consts = consts or InferenceConstants(experts_per_gpu=max(1, num_experts // num_gpus))
    static_time = predicted_total_time(results["static"], consts, profile) if "static" in results else None
    return {name: r.summary(consts, profile, static_time, num_gpus) for name, r in results.items()}


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
    only = SimulationConfig(**{**cfg.__dict__, "policies": ("static", "vexpert")})
    num_experts = int(np.asarray(counts).shape[-1])
    consts = consts or InferenceConstants(experts_per_gpu=num_experts // cfg.num_gpus)

    def throughput(believed: PerformanceProfile) -> float:
        res = simulate(counts, only, profile, consts, allocator_profile=believed)
        return 1.0 / predicted_total_time(res["vexpert"], consts, profile)

    reference = throughput(profile)
    table: dict[str, dict[str, float]] = {}
    for name in SENSITIVITY_PARAMETERS:
        table[name] = {
            f"{sign}{round(error * 100)}%": throughput(perturbed(profile, name, 1 + s * error)) / reference - 1.0
            for sign, s in (("-", -1), ("+", 1))
        }
    return table
