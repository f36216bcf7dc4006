"""``vexpert node --config FILE``: run one node (coordinator + one worker per GPU, or CPU workers)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "node",
        help="run one vExpert node: coordinator + workers (the pod's main process)",
        description=(
            "Run the coordinator and one worker per visible GPU (or --cpu-workers N CPU workers) under a "
            "RuntimeConfig rendered by the operator. The node serves Prometheus metrics (/metrics) and its readiness "
            "(/ready: 200 once the workers have loaded the model, formed the process group and run an iteration) "
            "on runtime.metrics_port, takes its rank from VEXPERT_NODE_RANK or else the pod name's ordinal, "
            "re-reads the file's tuning section (k, Np) when it changes, and stops cleanly on SIGTERM. Without a "
            "serving frontend it drives a synthetic decode load (optionally skewed with bundled real loads)."
        ),
    )
    parser.add_argument("--config", required=True, help="runtime.yaml (RuntimeConfig, YAML or JSON)")
    parser.add_argument("--cpu-workers", type=int, default=None, help="run N CPU worker processes instead of GPUs")
    parser.add_argument("--iterations", type=int, default=None, help="stop after N iterations (default: until SIGTERM)")
    parser.add_argument("--tokens-per-worker", type=int, default=64, help="synthetic decode batch per worker")
    parser.add_argument(
        "--load",
        default="",
        help="comma-separated bundled:NAME:ITERS phases that skew the router with real loads (default: unskewed)",
    )
    parser.add_argument("--verify", action="store_true", help="check every step against the single-process reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=run)


def _load_phases(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """Validate ``--tokens-per-worker`` and parse ``--load`` (before anything starts)."""
    from vexpert_runtime.errors import VExpertInputError, require_at_least
    from vexpert_runtime.simulation.trace import BUNDLED_PREFIX, bundled_names, parse_phase

    require_at_least("--tokens-per-worker", args.tokens_per_worker, 1, "tokens each worker routes per iteration")
    phases = []
    for item in filter(None, (part.strip() for part in args.load.split(","))):
        phase = parse_phase(item)
        name = phase.source[len(BUNDLED_PREFIX) :]
        if not phase.source.startswith(BUNDLED_PREFIX) or name not in bundled_names():
            raise VExpertInputError(
                "--load", f"{phase.source!r} is not a bundled load", "use bundled:NAME:ITERS with NAME one of " + ", ".join(bundled_names())
            )
        phases.append((name, phase.iterations))
    return tuple(phases)


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from vexpert_runtime.config import load_runtime_config
    from vexpert_runtime.errors import CPU_WORKERS_MEANING, require_at_least
    from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
    from vexpert_runtime.model.reference import VERIFY_TOLERANCE
    from vexpert_runtime.node import NodeOptions, NodeRuntime, install_signal_handlers, resolve_setup
    from vexpert_runtime.simulation.workload import demo_model_spec, drifting_workload
    from vexpert_runtime.workload import Workload

    require_at_least("--cpu-workers", args.cpu_workers, 1, CPU_WORKERS_MEANING)
    require_at_least("--iterations", args.iterations, 1, "iterations to run (leave it out to run until stopped)")
    config_path = Path(args.config)
    config = load_runtime_config(config_path)
    phases = _load_phases(args)

    def log(line: str) -> None:
        print(f"vexpert node: {line}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="vexpert-node-") as tmp:
        checkpoint = config.model.checkpoint_path
        builtin = not checkpoint
        if builtin:
            checkpoint = str(write_tiny_checkpoint(Path(tmp) / "demo-model", demo_model_spec(), seed=args.seed))
        setup = resolve_setup(config, checkpoint, cpu_workers=args.cpu_workers)
        if builtin:
            log("no model.checkpoint_path: running the built-in demo model")
        mem = setup.memory
        log(
            f"{setup.local_workers} {setup.device} workers (EP ranks {setup.ranks[0]}..{setup.ranks[-1]} of {setup.world}), "
            f"{setup.spec.num_layers} MoE layers × {setup.spec.num_experts} experts, Np={setup.pooled}, k={setup.k}, "
            f"L2 pool {mem.pool_bytes} B, L1 slots {mem.slot_bytes_per_worker} B per worker"
        )

        def progress(p: Any) -> None:
            log(
                f"iter {p.iteration} plan {p.plan_id}: balance static {p.static_balance:.3f} → {p.vexpert_balance:.3f}, "
                f"{p.tokens_per_s:.0f} tok/s, degraded groups {p.degraded_groups}"
                + (f", max rel err {p.max_rel_error:.1e}" if p.max_rel_error is not None else "")
            )

        spec = setup.spec
        workload = (
            drifting_workload(phases, spec.num_layers, spec.num_experts, args.tokens_per_worker, args.seed)
            if phases
            else Workload(tokens_per_worker=args.tokens_per_worker, seed=args.seed)
        )
        options = NodeOptions(
            workload=workload,
            iterations=args.iterations,
            verify=args.verify,
            config_path=config_path,
            progress=progress,
            on_metrics=lambda port: log(f"metrics on :{port}/metrics, readiness on :{port}/ready"),
            log=log,
        )
        runtime = NodeRuntime(setup, options)
        install_signal_handlers(runtime)
        try:
            report = runtime.run()
        except RuntimeError as exc:  # a worker or the fill loop failed: everything is already stopped
            print(f"error: node failed: {exc}", file=sys.stderr)
            return 1
    waits = [r.wait_s for r in report.records if r.reports]
    mean_wait_ms = 1e3 * sum(waits) / len(waits) if waits else 0.0
    rate_gbs = report.bytes_streamed / report.copy_s / 1e9 if report.copy_s > 0 else 0.0
    log(
        f"stopped after {report.iterations} iterations: balance static {report.static_balance:.3f} → "
        f"{report.vexpert_balance:.3f}, {report.tokens_per_s:.0f} tokens/s, slot-fill wait mean "
        f"{mean_wait_ms:.3f} ms max {1e3 * max(waits, default=0.0):.3f} ms per iteration, "
        f"{report.bytes_streamed} B streamed ({rate_gbs:.2f} GB/s while copying), "
        f"{max(0, len(report.plan_switches) - 1)} plan switches, "  # the first entry is the starting plan
        f"degraded groups {report.degraded_groups}"
        + (f", max rel error {report.max_rel_error:.2e}" if report.max_rel_error is not None else "")
        + (f" ({report.verify_near_ties} tokens at a routing tie left out)" if report.verify_near_ties else "")
    )
    if args.verify:
        tolerance = VERIFY_TOLERANCE[setup.dtype]
        if report.max_rel_error is None or report.max_rel_error > tolerance:
            print(f"error: verification failed: max relative error {report.max_rel_error} > {tolerance} "
                  f"({setup.dtype})", file=sys.stderr)
            return 1
    return 0
