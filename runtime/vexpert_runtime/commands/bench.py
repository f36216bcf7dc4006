"""``vexpert bench allocator``: allocation latency for a cluster shape."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("bench", help="micro-benchmarks")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    p = bench_sub.add_parser("allocator", help="time one allocation (median, p90) next to EPLB on the same input")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--vmax", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from vexpert_runtime.policy.bench import bench_allocator

    result = bench_allocator(args.layers, args.experts, args.gpus, args.nodes, args.device, args.repeats,
                             group_size=args.group_size, vmax=args.vmax)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"allocator {result['layers']}×{result['experts']} on {result['gpus']} GPUs ({result['device']}): "
              f"median {result['median_ms']:.2f} ms, p90 {result['p90_ms']:.2f} ms; "
              f"EPLB {result['eplb_median_ms']:.1f} ms ({result['speedup_vs_eplb']:.1f}× slower); "
              f"balance {result['balance_before']:.3f} → {result['balance_after']:.3f}")
    return 0
