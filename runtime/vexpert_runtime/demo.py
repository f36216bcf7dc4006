"""``vexpert demo``: one local node on CPU running the built-in DeepSeek-shaped model under a drifting
real-load trace, showing static vs vExpert balance and tokens/s as it runs.

The router of the tiny random model is skewed with bundled DeepSeek-V3 per-layer distributions
(decode → prefill → decode phases, see :mod:`vexpert_runtime.simulation.workload`), the allocator re-plans
every k iterations, and the static balance is what the contiguous placement would have had on the
very same routed tokens. ``--verify`` compares every rank's output of every step with the
single-process reference.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.model.reference import VERIFY_TOLERANCE as _TOLERANCE_BY_DTYPE
from vexpert_runtime.node import NodeOptions, NodeReport, Progress, resolve_setup, run_node
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import DEMO_PHASES, demo_model_spec, drifting_workload

VERIFY_TOLERANCE = _TOLERANCE_BY_DTYPE["float32"]  # the demo runs in fp32


@dataclass(frozen=True)
class DemoSettings:
    iterations: int = 40
    workers: int = 4
    tokens_per_worker: int = 64
    allocation_interval: int = 4
    seed: int = 0
    verify: bool = False
    metrics_port: int = 0  # 0: any free port on 127.0.0.1
    group_size: int = 2
    vmax: int = 1
    dispatch: str = "auto"  # vexpert.dispatch: auto | plan | local | global


def demo_config(checkpoint: Path, settings: DemoSettings) -> RuntimeConfig:
    """The RuntimeConfig the demo runs under (what an operator would render for a CPU node)."""
    return RuntimeConfig.model_validate(
        {
            "model": {"name": "vexpert-demo (DeepSeek-shaped)", "checkpoint_path": str(checkpoint), "dtype": "float32"},
            "parallelism": {
                "expert_parallel_size": settings.workers,
                "gpus_per_node": settings.workers,
                "master_addr": "127.0.0.1",
                "master_port": free_port(),
            },
            "vexpert": {"group_size": settings.group_size, "vmax": settings.vmax, "dispatch": settings.dispatch},
            "tuning": {"allocation_interval": settings.allocation_interval},
            "runtime": {"device": "cpu", "cpu_workers": settings.workers, "metrics_port": settings.metrics_port},
        }
    )


def format_progress(p: Progress) -> str:
    total = f"/{p.total}" if p.total else ""
    error = f"  max rel err {p.max_rel_error:.1e}" if p.max_rel_error is not None else ""
    return (
        f"iter {p.iteration:>4}{total}  {p.phase:<22} balance static {p.static_balance:.3f} → vExpert "
        f"{p.vexpert_balance:.3f}  {p.tokens_per_s:8.0f} tok/s  vExperts/layer {' '.join(map(str, p.vexperts))}{error}"
    )


def run_demo(settings: DemoSettings, emit: Callable[[str], None]) -> tuple[NodeReport, dict[str, Any]]:
    """Run the demo; ``emit`` receives the progress lines. Returns the report and the summary."""
    spec = demo_model_spec()
    workload = drifting_workload(DEMO_PHASES, spec.num_layers, spec.num_experts, settings.tokens_per_worker, settings.seed)
    with tempfile.TemporaryDirectory(prefix="vexpert-demo-") as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "model", spec, seed=settings.seed)
        config = demo_config(checkpoint, settings)
        setup = resolve_setup(config, checkpoint)
        emit(
            f"vexpert demo: {settings.workers} CPU workers + coordinator, model {spec.num_layers} MoE layers × "
            f"{spec.num_experts} experts (top-{spec.top_k}), {settings.tokens_per_worker} tokens/worker, "
            f"k={settings.allocation_interval}, G={settings.group_size}, vmax={settings.vmax}, "
            f"dispatch {setup.dispatch} ({setup.dispatch_reason}), "
            f"phases {' → '.join(name for name, _ in DEMO_PHASES)}"
        )
        options = NodeOptions(
            workload=workload,
            iterations=settings.iterations,
            verify=settings.verify,
            progress=lambda p: emit(format_progress(p)),
            metrics_addr="127.0.0.1",
            on_metrics=lambda port: emit(f"metrics: http://127.0.0.1:{port}/metrics"),
        )
        report = run_node(setup, options)
    summary: dict[str, Any] = {
        "iterations": report.iterations,
        "static_balance": round(report.static_balance, 4),
        "vexpert_balance": round(report.vexpert_balance, 4),
        "balance_gain": round(report.vexpert_balance - report.static_balance, 4),
        "tokens_per_s": round(report.tokens_per_s, 1),
        "workers": settings.workers,
        "dispatch": report.dispatch,
        "allocation_interval": report.k,
        "pooled_experts": report.pooled,
        "allocations": report.allocations,
        "allocator_ms_mean": round(1e3 * sum(report.allocator_s) / max(1, len(report.allocator_s)), 3),
        "plan_switches": [list(s) for s in report.plan_switches],
        "slot_bytes_per_worker": report.slot_bytes_per_worker,
        "pool_bytes": report.pool_bytes,
        "bytes_streamed": report.bytes_streamed,
        "degraded_groups": report.degraded_groups,
        "metrics_url": f"http://127.0.0.1:{report.metrics_port}/metrics" if report.metrics_port else None,
    }
    if settings.verify:
        summary["max_rel_error"] = report.max_rel_error
    return report, summary
