"""What a node knows about load and placement (:class:`BalanceState`): the experts' hotness, the L2
pool the coordinator should hold, the plans made so far and their routing tables, the count windows
and the balance decay — and, from a window's counts, the next plan.

It runs in the supervisor and touches no process, queue or metric: the supervisor feeds it the
workers' count windows (:meth:`BalanceState.record`), asks it for the next plan
(:meth:`BalanceState.next_plan`) and publishes what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vexpert_runtime.model.ep_moe import RoutingTable, static_table, table_from_plan
from vexpert_runtime.node.expert_pool import hottest_experts
from vexpert_runtime.node.messages import CountsWindow, WindowSpan
from vexpert_runtime.node.metrics import BalanceDecay, PoolHits
from vexpert_runtime.node.plans import NodePlan, ScheduledPlan
from vexpert_runtime.node.setup import NodeSetup
from vexpert_runtime.policy.allocator import AllocatorConfig, DeviceAllocator, Plan, allocate
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, static_placement
from vexpert_runtime.policy.registry import placement_policy

HOTNESS_DECAY = 0.8  # weight of the past in the experts' hotness, per window

Allocator = Callable[..., Plan]  # ``allocate``'s signature: the placement policy


@dataclass(frozen=True)
class WindowBalance:
    """What one count window showed: per iteration [n, L] the balance of the static placement and
    the measured (vExpert) balance, and the window's counts summed over its iterations [L, E]."""

    start: int
    static: torch.Tensor
    measured: torch.Tensor
    counts: torch.Tensor

    @property
    def end(self) -> int:
        """The first iteration after the window."""
        return self.start + int(self.static.shape[0])


@dataclass(frozen=True)
class PlanMade:
    """A plan the allocator made, how long it took and whether the pool changed for it."""

    plan: NodePlan
    vexperts: list[int]
    allocator_s: float
    pool_changed: bool


def pool_hits(slot_expert: torch.Tensor, pooled: torch.Tensor) -> tuple[int, int]:
    """(vExperts whose expert is pooled, vExperts) of a plan's ``slot_expert`` [L, N, S] (−1 = unused)
    under the pool mask ``pooled`` [L, E] bool."""
    used = slot_expert >= 0
    layer = torch.arange(slot_expert.shape[0]).view(-1, 1, 1).expand_as(slot_expert)
    hits = pooled[layer[used], slot_expert[used]]
    return int(hits.sum()), int(used.sum())


def pooled_mask(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, E] bool: the experts a pool holding ``experts`` [L, Np] has (the allocator may replicate)."""
    mask = torch.zeros(experts.shape[0], num_experts, dtype=torch.bool)
    mask.scatter_(1, experts, True)
    return mask


def window_balance(window: CountsWindow, base_gpu: torch.Tensor, world: int) -> WindowBalance:
    """The static placement's and the measured balance of every iteration of ``window``."""
    counts = torch.from_numpy(window.counts).to(torch.float32)  # [n, L, E]
    loads = torch.from_numpy(window.loads).to(torch.float32)  # [n, L, N]
    static = balance_ratio(base_gpu_loads(counts, base_gpu, world))
    return WindowBalance(window.start, static, balance_ratio(loads), counts.sum(0))


def allocation_is_idle(counts: torch.Tensor, base_gpu: torch.Tensor, world: int, threshold: float,
                       vexperts: list[int]) -> bool:
    """Whether vExpert's allocator (:func:`~vexpert_runtime.policy.allocator.allocate`) would return the
    static placement for a window's counts [L, E] while the static placement is in effect (``vexperts``
    all 0): every layer's balance on the base placement is above τ, so no layer gets a vExpert. The
    allocator then need not run — at one EP rank (balance 1) or any balanced load, it used to cost the
    serving process's interpreter a Python-heavy plan every window for a plan that changed nothing."""
    if any(vexperts):
        return False
    balance = balance_ratio(base_gpu_loads(counts.to(torch.float32), base_gpu, world))  # [L]
    return bool((balance > threshold).all())


def allocator_inputs(setup: NodeSetup, tokens_per_worker: int) -> tuple[InferenceConstants, AllocatorConfig]:
    """What the allocator is called with besides the counts: the batch and model constants and the
    configured group size, vmax and balance threshold."""
    consts = InferenceConstants(
        tokens_per_gpu=tokens_per_worker,
        top_k=setup.spec.top_k,
        experts_per_gpu=setup.spec.num_experts // setup.world,
        expert_bytes=setup.spec.expert_bytes(setup.torch_dtype),
    )
    config = AllocatorConfig(group_size=setup.group_size, vmax=setup.vmax, balance_threshold=setup.balance_threshold)
    return consts, config


def node_allocator(setup: NodeSetup, tokens_per_worker: int, log: Callable[[str], None]) -> Allocator:
    """The configured placement policy (``vexpert.placement_policy``, :mod:`~vexpert_runtime.policy.registry`).

    vExpert: on GPU nodes the graphed allocator on the first GPU, compiled and captured here, before
    any process starts: compiling beside the serving loop would starve it of the interpreter for the
    ≈20 s it takes (the supervisor uses no other CUDA: it passes the workers' IPC handles on
    unopened); ``allocate`` on CPU nodes, or when the GPU one cannot be built. Any other policy (a
    baseline): the registry's plan function, on the CPU."""
    if setup.placement_policy != "vexpert":
        return placement_policy(setup.placement_policy).plan
    if setup.device != "cuda":
        return allocate
    spec = setup.spec
    consts, config = allocator_inputs(setup, tokens_per_worker)
    import torch._inductor.config as inductor

    inductor.compile_threads = 1  # no pool of compile worker processes outliving the compile
    device = DeviceAllocator("cuda:0")
    started = time.perf_counter()
    base_gpu = static_placement(spec.num_layers, spec.num_experts, setup.world)
    try:
        device.warm_up(torch.ones(spec.num_layers, spec.num_experts), base_gpu, setup.world, config, setup.profile, consts)
    except Exception as exc:  # keep serving: allocate on the CPU instead
        log(f"graphed allocator unavailable, allocating on the CPU: {exc}")
        return allocate
    log(f"graphed allocator ready on cuda:0 ({time.perf_counter() - started:.1f} s to compile and capture)")
    return device


class BalanceState:
    """The node's load and placement: hotness [L, E], the pool's experts [L, Np], the plans made
    (ids, tables, pools), the count windows, the balance decay and the pool hits.

    ``allocator`` is the placement policy (``allocate``'s signature); ``k`` and ``pooled`` (Np) the
    running tuning (:meth:`retune` changes them)."""

    def __init__(self, setup: NodeSetup, tokens_per_worker: int, allocator: Allocator = allocate) -> None:
        spec = setup.spec
        self.setup = setup
        self.tokens_per_worker = tokens_per_worker
        self.allocator = allocator
        self.k = setup.k
        self.pooled = setup.pooled
        self.base_gpu = static_placement(spec.num_layers, spec.num_experts, setup.world)
        self.hotness = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
        self.pool_experts = hottest_experts(self.hotness, self.pooled)  # [L, Np]: what the coordinator pools
        self.plan_id = 0
        self.latest = NodePlan(static_table(spec.num_layers, spec.num_experts, setup.world, setup.slots),
                               self.pool_experts)
        self.tables: dict[int, RoutingTable] = {}  # plan id → its routing table
        self.plan_pools: dict[int, list[list[int]]] = {}  # plan id → its pooled experts [L][Np]
        self.windows: list[WindowSpan] = []
        self.allocator_s: list[float] = []
        self.allocations = 0
        self.idle_windows = 0  # windows whose allocation was skipped: every layer above τ, no vExpert placed
        self.vexperts = [0] * spec.num_layers
        self.decay = BalanceDecay()
        self.hits = PoolHits()

    # -- plans --------------------------------------------------------------------------------

    def opening_plans(self) -> list[ScheduledPlan]:
        """The schedule a run opens with: the static placement with the hottest experts pooled."""
        self.pool_experts = hottest_experts(self.hotness, self.pooled)
        self.latest = NodePlan(self.latest.table, self.pool_experts)
        return [ScheduledPlan(self.latest)]

    def adopt(self, plan: Plan) -> NodePlan:
        """``plan`` under the next plan id, pooling the current pool's experts; remembered as the latest."""
        self.plan_id += 1
        self.latest = NodePlan(table_from_plan(plan, self.plan_id), self.pool_experts)
        self.tables[self.plan_id] = self.latest.table
        self.plan_pools[self.plan_id] = self.pool_experts.tolist()
        return self.latest

    def next_plan(self, counts: torch.Tensor) -> PlanMade | None:
        """Run the allocator on a window's counts [L, E] (the pool first follows the hotness); None
        when vExpert's allocator would only repeat the plan in effect (:func:`allocation_is_idle`)."""
        setup = self.setup
        if setup.placement_policy == "vexpert" and allocation_is_idle(
                counts, self.base_gpu, setup.world, setup.balance_threshold, self.vexperts):
            self.idle_windows += 1
            if self.pool_experts.shape[1] < setup.spec.num_experts:
                self.hits.add(0, 0)  # no vExpert wanted: none missed
            return None
        pool_changed = self._refresh_pool()
        consts, config = allocator_inputs(self.setup, self.tokens_per_worker)
        mask = pooled_mask(self.pool_experts, self.setup.spec.num_experts)
        start = time.perf_counter()
        plan = self.allocator(counts, self.base_gpu, setup.world, config, setup.profile, consts, pooled=mask)
        elapsed = time.perf_counter() - start
        self.allocator_s.append(elapsed)
        self.allocations += 1
        if self.pool_experts.shape[1] < setup.spec.num_experts:  # what the allocator wanted vs what Np allowed
            unrestricted = self.allocator(counts, self.base_gpu, setup.world, config, setup.profile, consts)
            self.hits.add(*pool_hits(unrestricted.slot_expert, mask))
        self.vexperts = plan.vexperts.tolist()
        return PlanMade(self.adopt(plan), list(self.vexperts), elapsed, pool_changed)

    def _refresh_pool(self) -> bool:
        """Pool the hottest Np experts (when Np changed or does not cover every expert); whether the pool changed."""
        if self.pooled == self.pool_experts.shape[1] and self.pooled >= self.setup.spec.num_experts:
            return False
        wanted = hottest_experts(self.hotness, self.pooled)
        if wanted.shape == self.pool_experts.shape and torch.equal(wanted, self.pool_experts):
            return False
        self.pool_experts = wanted  # the coordinator refreshes its pool with the plan
        return True

    @property
    def pool_hit_ratio(self) -> float:
        """Wanted vExperts the pool held over the last allocations (1 when the pool holds every expert)."""
        return self.hits.value if self.pool_experts.shape[1] < self.setup.spec.num_experts else 1.0

    # -- load ---------------------------------------------------------------------------------

    def record(self, window: CountsWindow) -> WindowBalance:
        """Take in one count window: its span, the hotness and every iteration's balance for the decay."""
        balance = window_balance(window, self.base_gpu, self.setup.world)
        self.windows.append(window.span)
        for i, value in enumerate(balance.measured.mean(1).tolist()):
            self.decay.balance(window.start + i, value)
        self.hotness = HOTNESS_DECAY * self.hotness + balance.counts.to(torch.float64)
        return balance

    def iteration_done(self, iteration: int, plan_ids: list[int]) -> None:
        """Every local worker ran ``iteration`` on ``plan_ids`` (per layer)."""
        self.decay.plan(iteration, max(plan_ids, default=0))

    def retune(self, k: int, pooled: int) -> None:
        """New k and Np: intervals of the old k say nothing about the new one, nor hits of the old pool."""
        if k != self.k:
            self.decay.reset()
        if pooled != self.pooled:
            self.hits.reset()
        self.k, self.pooled = k, pooled

    def prune(self, keep: int) -> None:
        """Keep the last ``keep`` windows and allocator times, and a tenth as many plans' tables."""
        for history in (self.windows, self.allocator_s):
            del history[: max(0, len(history) - keep)]
        plans = max(16, keep // 10)
        for plan_id in sorted(self.tables)[: max(0, len(self.tables) - plans)]:
            self.tables.pop(plan_id, None)
            self.plan_pools.pop(plan_id, None)
