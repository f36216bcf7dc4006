"""``vexpert trace build``: per-iteration expert counts from real load statistics."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("trace", help="build load traces")
    trace_sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    build = trace_sub.add_parser(
        "build",
        help="sample a phased trace from SGLang expert statistics (.json) or per-iteration CSVs",
        description="Phases switch abruptly. SOURCE is bundled:NAME, an SGLang .json, or FILE.csv[#GROUP].",
    )
    build.add_argument("--phase", action="append", required=True, metavar="SOURCE:ITERS",
                       help="a phase; repeat for several (e.g. bundled:decode_in1000out1000:200)")
    build.add_argument("--gpus", type=int, required=True, help="GPUs (EP ranks) in the simulated cluster")
    build.add_argument("--tokens-per-gpu", type=int, default=256, help="decode batch per GPU (default 256)")
    build.add_argument("--top-k", type=int, default=8, help="routed experts per token (default 8)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--jitter", type=float, default=0.0, metavar="M",
                       help="per-iteration jitter: each (iteration, layer) routes from Dirichlet(M·p_phase), "
                            "M = effective independent routings (small decode batches route together); 0 = off")
    build.add_argument("--drift", type=float, default=0.0, metavar="SIGMA",
                       help="continuous drift: every expert's log-popularity wanders every iteration "
                            "(Ornstein-Uhlenbeck, stationary std SIGMA, across phases); 0 = off")
    build.add_argument("--drift-iterations", type=float, default=100.0,
                       help="correlation time of the drift in iterations (default 100)")
    build.add_argument("--raw-series", action="store_true",
                       help="CSV phases replay their recorded per-iteration counts as they are (no resampling)")
    build.add_argument("-o", "--output", required=True, help="output .npz (key `counts` int [T, L, E])")
    build.set_defaults(handler=_build)


def _build(args: argparse.Namespace) -> int:
    from vexpert_runtime.outputs import check_output_path
    from vexpert_runtime.simulation.trace import Variation, build_trace, parse_phase, save_trace

    check_output_path(args.output, "--output")
    phases = [parse_phase(spec) for spec in args.phase]
    variation = Variation(args.jitter, args.drift, args.drift_iterations, args.raw_series)
    trace = build_trace(phases, args.gpus, args.tokens_per_gpu, args.top_k, args.seed, variation)
    save_trace(trace, args.output)
    t, layers, experts = trace.counts.shape
    print(json.dumps({"output": args.output, "iterations": t, "layers": layers, "experts": experts,
                      "phases": trace.phase_names, "phase_starts": trace.phase_starts}))
    return 0
