"""``vexpert demo``: the README's main-job command (one local CPU node, drifting real load)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run one local CPU node on a tiny DeepSeek-shaped model under a drifting real-load trace",
        description=(
            "Start a coordinator and CPU workers, replay bundled DeepSeek-V3 expert loads (decode → prefill → "
            "decode) on a tiny DeepSeek-shaped model and show static vs vExpert balance and tokens/s as it runs. "
            "Metrics are served on 127.0.0.1 while it runs."
        ),
    )
    parser.add_argument("--iterations", type=int, default=40, help="decode iterations to run (default 40)")
    parser.add_argument("--verify", action="store_true", help="check every step against a single-process reference")
    parser.add_argument("--json", action="store_true", help="print progress to stderr and end with one JSON object")
    parser.add_argument("--workers", type=int, default=4, help="CPU worker processes = EP ranks (divides 32; default 4)")
    parser.add_argument("--tokens-per-worker", type=int, default=64, help="decode batch per worker (default 64)")
    parser.add_argument("-k", "--allocation-interval", type=int, default=4, help="iterations between allocations (default 4)")
    parser.add_argument("--metrics-port", type=int, default=0, help="metrics port on 127.0.0.1 (default: any free port)")
    parser.add_argument(
        "--dispatch", choices=("auto", "plan", "local", "global"), default="auto",
        help="how a replicated expert's tokens split over its copies every layer: the plan's fixed shares, or "
        "water-filled from each iteration's counts (local: each rank's own; global: all-reduced); default auto",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vexpert_runtime.demo import VERIFY_TOLERANCE, DemoSettings, run_demo
    from vexpert_runtime.errors import require_at_least

    for name, meaning in (("iterations", "decode iterations to run"), ("workers", "the demo node's CPU worker processes (EP ranks)"),
                          ("tokens_per_worker", "tokens each worker routes per iteration"),
                          ("allocation_interval", "iterations between allocations (k)")):
        require_at_least(f"--{name.replace('_', '-')}", getattr(args, name), 1, meaning)
    settings = DemoSettings(
        iterations=args.iterations,
        workers=args.workers,
        tokens_per_worker=args.tokens_per_worker,
        allocation_interval=args.allocation_interval,
        seed=args.seed,
        verify=args.verify,
        metrics_port=args.metrics_port,
        dispatch=args.dispatch,
    )
    out = sys.stderr if args.json else sys.stdout

    def emit(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        _, summary = run_demo(settings, emit)
    except RuntimeError as exc:  # a worker or the fill loop failed: everything is already stopped
        print(f"error: demo failed: {exc}", file=sys.stderr)
        return 1
    emit(
        f"done: {summary['iterations']} iterations, dispatch {summary['dispatch']}, balance static {summary['static_balance']:.3f} → vExpert "
        f"{summary['vexpert_balance']:.3f} (+{summary['balance_gain']:.3f}), {summary['tokens_per_s']:.0f} tokens/s, "
        f"{summary['bytes_streamed']} bytes streamed, slots {summary['slot_bytes_per_worker']} B/worker"
        + (f", max rel error {summary['max_rel_error']:.2e}" if args.verify else "")
    )
    if args.json:
        print(json.dumps(summary), flush=True)
    if args.verify and (summary["max_rel_error"] is None or summary["max_rel_error"] > VERIFY_TOLERANCE):
        print(f"error: verification failed: max relative error {summary['max_rel_error']} > {VERIFY_TOLERANCE}", file=sys.stderr)
        return 1
    return 0
