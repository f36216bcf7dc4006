"""How a node run is driven (:class:`NodeOptions`) and what it reports (:class:`Progress` after each
allocation window, :class:`IterationRecord` per iteration, :class:`NodeReport` at the end)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vexpert_runtime.model.ep_moe import RoutingTable
from vexpert_runtime.node.messages import WindowSpan
from vexpert_runtime.node.plans import PlanSwitch
from vexpert_runtime.node.protocol import SlotFiller
from vexpert_runtime.node.slot_probe import ProbeFactory
from vexpert_runtime.policy import allocator as placement_policy
from vexpert_runtime.workload import Workload

# ---------------------------------------------------------------------------------------------
# Options and report
# ---------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What the node reports after each allocation window (the demo's progress line)."""

    iteration: int
    total: int | None
    phase: str
    static_balance: float
    vexpert_balance: float
    tokens_per_s: float
    vexperts: list[int]
    plan_id: int
    max_rel_error: float | None
    bytes_streamed: int
    degraded_groups: int


@dataclass
class NodeOptions:
    """How to drive the node (not part of the operator's config)."""

    workload: Workload = field(default_factory=Workload)
    iterations: int | None = None  # None: until stopped (SIGTERM)
    verify: bool = False
    config_path: Path | None = None  # re-read ``tuning`` when this file changes
    progress: Callable[[Progress], None] | None = None
    allocate: bool = True  # run the allocator every k iterations
    # The coordinator's slot filler: a SlotFiller subclass, or a picklable callable making one
    # (it crosses into the coordinator process).
    filler: Callable[..., SlotFiller] = SlotFiller
    # The placement policy the supervisor runs every k iterations (``allocate``'s signature); None:
    # the config's ``vexpert.placement_policy`` (``balance.node_allocator``: for vExpert the graphed
    # allocator on the first GPU of GPU nodes, ``allocate`` on CPU nodes).
    allocator: Callable[..., placement_policy.Plan] | None = None
    keep_history: int = 10_000  # iterations (and windows, plans/10) the report keeps: a node
    # that runs until SIGTERM must not grow without bound
    fill_restart_delay_s: float = 1.0  # first wait before restarting a dead fill loop (doubles, ≤ 30 s)
    # Looks at every layer's slots in every worker (node.slot_probe; picklable, it crosses into the
    # workers): what it reports lands in the records' ``details``. Probed workers run eagerly.
    probe: ProbeFactory | None = None
    metrics_addr: str | None = None
    on_metrics: Callable[[int], None] | None = None  # called with the bound port once serving
    log: Callable[[str], None] | None = None
    # ``vexpert serve``: per local worker, its model and request/event queues (ServeWorkerArgs); the
    # workers then run the model's requests instead of ``workload`` (which only sizes the allocator's batch)
    serve: list[Any] | None = None


@dataclass
class IterationRecord:
    """One iteration as the supervisor saw it (its workers' reports and its count window)."""

    iteration: int
    step_s: float = 0.0
    wait_s: float = 0.0
    degraded_groups: int = 0
    plan_ids: list[int] = field(default_factory=list)  # per group
    static_balance: float | None = None
    vexpert_balance: float | None = None
    rel_error: float | None = None
    details: dict[int, Any] = field(default_factory=dict)  # rank → what its slot probe reported (options.probe)
    reports: int = 0


@dataclass
class NodeReport:
    """Summary of a finished run."""

    iterations: int
    static_balance: float
    vexpert_balance: float
    tokens_per_s: float
    max_rel_error: float | None
    slot_bytes_per_worker: int
    pool_bytes: int
    bytes_streamed: int
    plan_switches: list[PlanSwitch]  # taken by the fill loop; first = starting plan
    allocations: int
    allocator_s: list[float]
    degraded_groups: int
    metrics_port: int | None
    records: list[IterationRecord]
    metrics_text: str = ""
    pooled: int = 0
    k: int = 0
    windows: list[WindowSpan] = field(default_factory=list)  # one per all-reduce
    tables: dict[int, RoutingTable] = field(default_factory=dict)  # plan id → routing table
    plan_pools: dict[int, list[list[int]]] = field(default_factory=dict)  # plan id → pooled experts [L][Np]
    copy_s: float = 0.0  # time the fill loop's copies were in flight (bytes_streamed / copy_s: fill bandwidth)
    graphed_steps: int = 0  # worker steps replayed from a captured CUDA graph (summed over workers)
    dispatch: str = "plan"  # replica dispatch the workers ran (plan | local | global)
    verify_near_ties: int = 0  # low precision: tokens at a routing tie left out of --verify (verification.py)

