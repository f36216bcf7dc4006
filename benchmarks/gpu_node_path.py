"""Issue #12 on a GPU host: ``vexpert node`` itself — its supervisor, coordinator and workers
(:func:`vexpert_runtime.node.run_node`) — with DeepSeek-V3-sized experts (I = 2048, H = 7168).

Runs the node on a skewed drifting load with 2 EP ranks (two GPUs, or two workers sharing the one
GPU there is: ``runtime.workers_per_gpu = 2``, their all-to-all then goes through host memory
over gloo, which adds host synchronisation to every layer's dispatch and combine: step times here
are slower than NCCL's and compare only with each other) in bf16 and in block FP8, each twice:

* ``streaming``: 4 MoE layers, G = 2, Vmax = 1 → 2 slots per worker; even layers take the bottom
  slot, odd ones the top one, so every layer's vExperts are copied every iteration while the
  previous layer computes;
* ``prefilled``: 2 MoE layers, same slots → each layer keeps its own slot, nothing is copied after
  the first iteration of a plan: the same compute without the streaming.

Reports, per run: slot HBM per worker (slots + flags), fill bandwidth (bytes the coordinator copied /
time the copies took, CUDA events on its copy streams) next to a plain pinned host→device copy of
one expert row measured in this process, step time per MoE layer (median, p90) overall and around
plan switches, the node's allocator time (the graphed allocator on the GPU once compiled), and a
torch-profiler trace of one steady-state worker iteration with its host synchronisations counted.

    python benchmarks/gpu_node_path.py --out benchmarks/results/gpu_node_path      # GPU host
    python benchmarks/gpu_node_path.py --small --cpu --out /tmp/gnp                # CPU twin (shapes only)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import MoESpec, random_weights, write_checkpoint
from vexpert_runtime.model.expert_layout import FP8_BLOCK
from vexpert_runtime.model.families import DEEPSEEK
from vexpert_runtime.node import NodeOptions, NodeReport, resolve_setup, run_node
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload


def spec_for(layers: int, experts: int, hidden: int, inter: int, fp8: bool) -> MoESpec:
    spec = MoESpec(architecture=DEEPSEEK, hidden_size=hidden, intermediate_size=inter, num_experts=experts, top_k=2,
                   moe_layers=tuple(range(1, 1 + layers)), n_group=1, topk_group=1, routed_scaling_factor=2.5,
                   correction_bias=True, shared_intermediate_size=0)
    if fp8:
        spec = dataclasses.replace(spec, fp8_block=(128, 128), expert_storage=FP8_BLOCK)
    return spec


def write_model(path: Path, spec: MoESpec) -> Path:
    """A random checkpoint; dense weights are stored as bf16 (half the bytes to write)."""
    weights = random_weights(spec, seed=0)
    for name, tensor in weights.items():
        if tensor.dtype == torch.float32 and ".experts." in name and not name.endswith("_scale_inv"):
            weights[name] = tensor.to(torch.bfloat16)
    return write_checkpoint(path, spec, weights)


def pinned_h2d_gbps(nbytes: int, repeats: int = 20) -> float:
    """Plain pinned host→device bandwidth for one expert row of ``nbytes`` (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return nbytes / statistics.median(times[3:]) / 1e9


def count_syncs(trace: Path) -> dict[str, Any]:
    """Host synchronisations in a chrome trace of one worker iteration (CUDA runtime calls)."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    names = [e.get("name", "") for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    syncs = [n for n in names if n.startswith(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
             or n == "cudaMemcpy"]
    memops = [n for n in names if "StreamWaitValue" in n or "StreamWriteValue" in n]
    return {"runtime_calls": len(names), "host_syncs": len(syncs), "sync_calls": sorted(set(syncs)),
            "stream_memops": len(memops), "graph_launches": sum(n.startswith("cudaGraphLaunch") for n in names),
            "kernel_launches": sum(n.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for n in names)}


def run(checkpoint: Path, device: str, ranks: int, layers: int, iterations: int, tokens: int, k: int,
        profile_dir: Path | None, profile_at: int, perf_profile: dict[str, Any] | None = None,
        verify: bool = False, env: dict[str, str] | None = None) -> tuple[NodeReport, dict[str, Any]]:
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    raw = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "bfloat16" if device == "cuda" else "float32"},
        "parallelism": {"expert_parallel_size": ranks, "gpus_per_node": ranks, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": k},
        "runtime": {"device": device, "cpu_workers": ranks if device == "cpu" else 0, "metrics_port": 0,
                    "slot_fill_timeout_s": 60.0, "workers_per_gpu": max(1, -(-ranks // max(gpus, 1))) if gpus else 1},
    }
    if perf_profile is not None:
        raw["profile"] = perf_profile
    setup = resolve_setup(RuntimeConfig.model_validate(raw), checkpoint)
    workload = drifting_workload((("decode_in1000out1000", 40), ("prefill_in4096", 40)), layers, setup.spec.num_experts,
                                 tokens_per_worker=tokens, seed=1)
    lines: list[str] = []
    extra = dict(env or {})
    if profile_dir is not None:
        extra["VEXPERT_PROFILE"] = f"{profile_at}:{profile_dir}"
    os.environ.update(extra)  # the node's processes inherit it
    try:
        started = time.perf_counter()
        report = run_node(setup, NodeOptions(workload=workload, iterations=iterations, log=lines.append, verify=verify))
        wall = time.perf_counter() - started
    finally:
        for key in extra:
            os.environ.pop(key, None)
    steps = [r.step_s for r in report.records if r.iteration >= 5]  # past start-up
    per_layer = sorted(s / layers * 1000 for s in steps)
    switches = {it for it, _ in report.plan_switches}
    near = [r.step_s / layers * 1000 for r in report.records if r.iteration in switches and r.iteration >= 5]
    allocator_ms = sorted(t * 1000 for t in report.allocator_s)
    summary = {
        "layers": layers,
        "iterations": report.iterations,
        "wall_s": round(wall, 1),
        "slot_bytes_per_worker": report.slot_bytes_per_worker,
        "flag_bytes_per_worker": 8 * layers + 8,
        "bytes_streamed": report.bytes_streamed,
        "copy_s": round(report.copy_s, 4),
        "fill_gbps": round(report.bytes_streamed / report.copy_s / 1e9, 2) if report.copy_s > 0 else None,
        "step_ms_per_layer_median": round(statistics.median(per_layer), 3) if per_layer else None,
        "step_ms_per_layer_p90": round(per_layer[int(0.9 * (len(per_layer) - 1))], 3) if per_layer else None,
        "step_ms_per_layer_at_plan_switches": [round(x, 3) for x in near],
        "plan_switches": len(report.plan_switches) - 1,
        "allocator_ms_median": round(statistics.median(allocator_ms), 3) if allocator_ms else None,
        "allocator_ms_last5": [round(x, 3) for x in allocator_ms[-5:]] if allocator_ms else [],
        "allocator_ms_graphed_median": round(statistics.median([t * 1000 for t in report.allocator_s[-5:]]), 3)
        if report.allocator_s else None,
        "static_balance": round(report.static_balance, 3),
        "vexpert_balance": round(report.vexpert_balance, 3),
        "degraded_layers": report.degraded_groups,
        "max_rel_error": report.max_rel_error,
        "env": env or {},
        "log": [line for line in lines if "allocator" in line],
    }
    return report, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="CPU workers (the twin; timings mean nothing)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (H=256, I=128)")
    parser.add_argument("--iterations", type=int, default=300, help="long enough for the graphed allocator to compile (≈20 s)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--formats", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--runs", nargs="+", default=["pair", "single"],
                        help="pair: 2 ranks, streaming and pre-filled per format; single: 1 rank, graphed vs eager")
    parser.add_argument("--perf-profile", type=Path, default=None,
                        help="a calibrated PerformanceProfile JSON for the node's cost model (default: the paper's)")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    hidden, inter = (256, 128) if args.small else (7168, 2048)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                               "torch": torch.__version__, "hidden": hidden, "intermediate": inter,
                               "experts": args.experts, "tokens_per_worker": args.tokens}
    if device == "cuda":
        bf16_row = 3 * hidden * inter * 2
        results["pinned_h2d_gbps_bf16_row"] = round(pinned_h2d_gbps(bf16_row), 2)
        results["pinned_h2d_gbps_fp8_row"] = round(pinned_h2d_gbps(bf16_row // 2 + 4096), 2)
        results["gpus"] = torch.cuda.device_count()
    perf = json.loads(args.perf_profile.read_text()) if args.perf_profile else None
    if perf is not None:
        results["perf_profile_hardware"] = perf.get("hardware")
    summary_path = args.out / "summary.json"
    if summary_path.exists():  # runs split over several invocations add to one summary
        results = json.loads(summary_path.read_text()) | results
    with tempfile.TemporaryDirectory(prefix="vexpert-gnp-") as tmp:
        for fmt in args.formats if "pair" in args.runs else []:
            for name, layers in (("streaming", 4), ("prefilled", 2)):
                key = f"{fmt}_{name}"
                started = time.perf_counter()
                checkpoint = write_model(Path(tmp) / key, spec_for(layers, args.experts, hidden, inter, fmt == "fp8"))
                write_s = time.perf_counter() - started
                profile = args.out / f"trace_{key}" if name == "streaming" else None
                _, summary = run(checkpoint, device, 2, layers, args.iterations, args.tokens, 10, profile,
                                 profile_at=args.iterations - 5, perf_profile=perf)
                summary["checkpoint_write_s"] = round(write_s, 1)
                if profile is not None:
                    traces = sorted(profile.glob("worker*.json"))
                    summary["profile"] = {t.name: count_syncs(t) for t in traces}
                results[key] = summary
                print(key, json.dumps({k: v for k, v in summary.items() if k != "log"}), flush=True)
                (args.out / "summary.json").write_text(json.dumps(results, indent=2))
                import shutil

                shutil.rmtree(checkpoint, ignore_errors=True)
        if device == "cuda" and "single" in args.runs:
            # One rank alone on the GPU: no collective, so its decode step is one CUDA graph; checked
            # against the single-process reference, traced, and timed against the same step run eagerly.
            checkpoint = write_model(Path(tmp) / "single", spec_for(4, args.experts, hidden, inter, False))
            for key, env in (("bf16_single_rank_graphed", {}), ("bf16_single_rank_eager", {"VEXPERT_CUDA_GRAPHS": "0"})):
                profile = args.out / f"trace_{key}"
                _, summary = run(checkpoint, device, 1, 4, 60, args.tokens, 10, profile, profile_at=55,
                                 verify=True, env=env)
                summary["profile"] = {t.name: count_syncs(t) for t in sorted(profile.glob("worker*.json"))}
                results[key] = summary
                print(key, json.dumps({k: v for k, v in summary.items() if k != "log"}), flush=True)
                summary_path.write_text(json.dumps(results, indent=2))
    summary_path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
