"""``vexpert simulate``: replay a trace for every placement policy and print the table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

PLOT_HELP = "write a PNG of balance over iterations per policy (like the paper's Fig. 6a)"


def register(sub: Any) -> None:
    p = sub.add_parser("simulate", help="compare static, EPLB, B3, vExpert (k=1, k, future) and a bound on a trace")
    p.add_argument("trace", help="trace .npz from `vexpert trace build`")
    p.add_argument("--gpus", type=int, required=True, help="EP ranks (must divide the expert count)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (EPLB's hierarchical policy packs groups per node)")
    p.add_argument("--k", type=int, default=10, help="vExpert allocation interval in iterations (default 10)")
    p.add_argument("--group-size", type=int, default=2, help="G: layers sharing a slot budget (default 2)")
    p.add_argument("--vmax", type=int, default=1, help="per-layer vExpert budget per GPU (default 1)")
    p.add_argument("--tau", type=float, default=0.7, help="balance threshold τ (default 0.7)")
    p.add_argument("--no-adjacency-bound", action="store_true",
                   help="let adjacent layers' vExperts exceed the G·vmax slots together (group budget only; "
                        "their copies then wait for the previous layer and are charged in full)")
    p.add_argument("--eplb-interval", type=int, default=200, help="iterations between EPLB rebalances (default 200)")
    p.add_argument("--eplb-policy", default="auto", choices=["auto", "hierarchical", "global"])
    p.add_argument("--compare-eplb-policies", action="store_true",
                   help="also report eplb[-redundant]:hierarchical and :global")
    p.add_argument("--expert-groups", type=int, default=0, help="expert groups (0 = 8 for 256 experts, else 1)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies (default: all but eplb-slots, EPLB as a node runs it live)")
    p.add_argument("--dispatch", default="auto", choices=["plan", "local", "allreduce", "auto"],
                   help="vexpert's per-iteration replica dispatch: the plan's fixed shares, rank-local counts, "
                        "counts all-reduced per layer, or the performance model's pick (default auto)")
    p.add_argument("--eplb-dispatch", default="plan", choices=["plan", "local", "allreduce", "auto"],
                   help="the same for EPLB's replicas (default plan: split evenly, as SGLang does)")
    p.add_argument("--compare-dispatch", action="store_true", help="also report vexpert+plan, +local and +allreduce")
    p.add_argument("--eplb-sweep", default="", metavar="I1,I2,...",
                   help="also report eplb-redundant at these rebalance intervals, with plan and all-reduced dispatch "
                        "(e.g. 10,20,50,100,200,500)")
    p.add_argument("--warmup", type=int, default=0,
                   help="first W iterations are prior traffic: every policy's first plan is made from them, "
                        "no stall or allocation charged, not scored (default 0: every policy starts static)")
    p.add_argument("--hbm-gb", type=float, default=None,
                   help="HBM per GPU in GB for the KV-cache/batch model (default: the profile's, 80; 0 = off)")
    p.add_argument("--profile", default=None, help="PerformanceProfile JSON from `vexpert calibrate`")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="override the trace's batch for the time model")
    p.add_argument("--sensitivity", action="store_true",
                   help="also report vExpert's throughput change when each model parameter is off by ±20%% (paper Table 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help=PLOT_HELP)
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from vexpert_runtime.errors import VExpertInputError, require_at_least
    from vexpert_runtime.policy.perf_model import InferenceConstants
    from vexpert_runtime.policy.profile import PerformanceProfile, load_profile
    from vexpert_runtime.simulation.simulate import DEFAULT_POLICIES, SimulationConfig, simulate, summarize
    from vexpert_runtime.simulation.trace import load_trace

    trace = load_trace(args.trace)
    iterations, layers, experts = trace.counts.shape
    policies = tuple(DEFAULT_POLICIES if not args.policies else [p.strip() for p in args.policies.split(",") if p.strip()])
    try:
        sweep = tuple(int(x) for x in args.eplb_sweep.split(",") if x.strip())
    except ValueError:
        raise VExpertInputError("--eplb-sweep", f"{args.eplb_sweep!r} is not a list of integers", "e.g. 10,20,50") from None
    cfg = SimulationConfig(
        num_gpus=args.gpus, num_nodes=args.nodes, allocation_interval=args.k, group_size=args.group_size,
        vmax=args.vmax, balance_threshold=args.tau, eplb_interval=args.eplb_interval,
        eplb_policy=args.eplb_policy, expert_groups=args.expert_groups, policies=policies,
        compare_eplb_policies=args.compare_eplb_policies, adjacency_bound=not args.no_adjacency_bound,
        dispatch=args.dispatch, eplb_dispatch=args.eplb_dispatch, compare_dispatch=args.compare_dispatch,
        eplb_sweep=sweep, warmup=args.warmup,
    )
    cfg.validate(experts, iterations)
    profile = load_profile(args.profile) if args.profile else PerformanceProfile()
    if args.hbm_gb is not None:
        require_at_least("--hbm-gb", args.hbm_gb, 0, "HBM per GPU in GB (0: no KV-cache/batch model)")
        profile = profile.with_hardware(profile.hardware.model_copy(update={"hbm_gb": args.hbm_gb}))
    tokens = args.tokens_per_gpu or _trace_tokens_per_gpu(trace.meta, args.gpus)
    require_at_least("--tokens-per-gpu", tokens, 1, "tokens each GPU routes per iteration (the trace's when left out)")
    consts = InferenceConstants(tokens_per_gpu=tokens, top_k=int(trace.meta.get("top_k", 8)),
                                experts_per_gpu=experts // args.gpus)
    if args.plot:
        from vexpert_runtime.outputs import check_output_path

        check_output_path(args.plot, "--plot")
    started = time.perf_counter()
    progress = None if args.json else (lambda name: print(f"  simulating {name} …", file=sys.stderr, flush=True))
    results = simulate(trace.counts, cfg, profile, consts, progress=progress)
    summary = summarize(results, profile, consts, experts, args.gpus)
    elapsed = time.perf_counter() - started
    table = None
    if args.sensitivity:
        from vexpert_runtime.simulation.simulate import sensitivity

        table = sensitivity(trace.counts, cfg, profile, consts)
    if args.plot:
        from vexpert_runtime.simulation.plot import plot_balance

        # scored iterations start after the warm-up: shift the phase marks with them
        shown = [(max(0, start - args.warmup), name) for start, name in zip(trace.phase_starts, trace.phase_names, strict=True)]
        plot_balance(results, [s for s, _ in shown], [n for _, n in shown], args.plot)
    out = {
        "trace": {"path": args.trace, "iterations": iterations, "layers": layers, "experts": experts,
                  "phases": trace.phase_names, "phase_starts": trace.phase_starts},
        "config": {"gpus": args.gpus, "nodes": args.nodes, "k": args.k, "group_size": args.group_size,
                   "vmax": args.vmax, "tau": args.tau, "eplb_interval": args.eplb_interval,
                   "eplb_policy": args.eplb_policy, "adjacency_bound": not args.no_adjacency_bound,
                   "dispatch": args.dispatch, "eplb_dispatch": args.eplb_dispatch, "warmup": args.warmup,
                   "hbm_gb": profile.hardware.hbm_gb},
        "policies": summary,
        "elapsed_s": round(elapsed, 3),
    }
    if table is not None:
        out["sensitivity"] = table
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_table(summary))
        if table is not None:
            print("\nvExpert throughput change with one allocator parameter off (scored with the true profile):")
            for name, row in table.items():
                print(f"  {name:<14}" + "".join(f"{k:>7} {v * 100:+6.2f}%" for k, v in row.items()))
        print(f"\n{iterations} iterations × {layers} layers × {experts} experts on {args.gpus} GPUs; "
              f"simulated in {elapsed:.1f} s" + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    header = (f"{'policy':<40}{'balance':>9}{'p10':>8}{'worst layer':>13}{'vExp/GPU/it':>13}{'stalls':>8}"
              f"{'dispatch':>10}{'batch':>7}{'tok/s/GPU':>11}{'rel. thrpt':>12}")
    lines = [header, "-" * len(header)]
    for name, s in summary.items():
        worst = f"{s['worst_layer_balance']:.3f}@{s['worst_layer']}"
        scored = s["predicted_relative_throughput"] is not None
        tps = f"{s['predicted_tokens_per_s_per_gpu']:>11.1f}" if scored else f"{'—':>11}"
        rel = f"{s['predicted_relative_throughput']:>11.3f}×" if scored else f"{'(bound)':>12}"
        lines.append(
            f"{name:<40}{s['balance_mean']:>9.3f}{s['balance_p10']:>8.3f}{worst:>13}"
            f"{s['vexperts_per_gpu_per_iteration']:>13.1f}{s['rebalance_stalls']:>8d}{s['dispatch']:>10}"
            f"{s['batch_per_gpu']:>7.0f}{tps}{rel}"
        )
    return "\n".join(lines)


def _trace_tokens_per_gpu(meta: dict[str, Any], gpus: int) -> int:
    """Tokens per GPU of the simulated cluster: the trace's batch (tokens per GPU × its GPUs) over
    ``gpus``; a trace built for another GPU count keeps its total tokens per iteration."""
    per_gpu = int(meta.get("tokens_per_gpu", 256))
    built_for = int(meta.get("gpus", gpus) or gpus)
    return max(1, per_gpu * built_for // gpus)
