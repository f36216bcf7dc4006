"""A CPU rank's expert kernels side by side (why a CPU rank times them at load: ``--cpu-expert-kernel auto``,
``grouped_moe.cpu_expert_kernel_seconds``).

The product's CPU expert computations over the same random experts: the per-expert loop over
``packed_views`` of the packed rows (``F.linear``, MKL: what a CPU rank ran first; the tests' reference),
``grouped``: ``torch._grouped_mm`` over the same rows (one call per stack, no Python loop), and
``prepacked``: ``PrepackedExperts.swiglu`` (oneDNN's ``_linear_pointwise`` over weights reordered once),
with ``rows`` tokens per expert, interleaved, medians; fp32, one torch thread. Default shapes: the
side-by-side CPU model of ``cpu_serve_compare.py`` (32 experts, hidden 512, moe_intermediate 256).

    .venv/bin/python benchmarks/cpu_expert_layout.py --out benchmarks/results/cpu_compare/expert_layout.jsonl

``--model DIR``: whole steps of that checkpoint instead, through the product's ``HFStepModel`` with the EP
layer on one rank (``EPExperts``) holding its resident experts prepacked vs as rows (``_grouped_mm``):
a 16-sequence decode step at context 64+ and a 4 × 64-token prefill, interleaved, medians; ``--profile``
adds cProfile's top functions of 20 decode steps (with the kernel ``auto`` picks, which is also printed).

    .venv/bin/python benchmarks/cpu_expert_layout.py --model /tmp/cpu-compare/model --profile \
        --out benchmarks/results/cpu_compare/expert_layout_steps.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vexpert_runtime.model.ep_moe import base_experts
from vexpert_runtime.model.grouped_moe import PrepackedExperts, grouped_swiglu, packed_views
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.moe_executors import EPExperts
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork


def steps(model_dir: str, rounds: int, profile: bool) -> dict[str, Any]:
    """Decode and prefill steps with prepacked vs packed-row resident experts (see the module docstring)."""
    model = HFStepModel(model_dir, dtype=torch.float32, kv_cache_tokens=16384)
    executor = EPExperts.for_model(model, 0, 1, None)  # auto: times both kernels on layer 0
    model.executor = executor
    mine = base_experts(model.num_experts, 1, 0)
    rows = [model.expert_rows(layer, mine) for layer in range(len(model.moe_layers))]
    residents = {"prepacked": [PrepackedExperts.of(r, model.intermediate_size, r.shape[1] // (3 * model.intermediate_size))
                               for r in rows],
                 "grouped": rows}
    chosen, resident_auto = executor.cpu_expert_kernel, executor.resident
    model.drop_expert_weights()
    rng, sequences, context = random.Random(0), 16, 64
    pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
    next_seq = sequences

    def prompt() -> tuple[int, ...]:
        return tuple(rng.randrange(model.vocab_size) for _ in range(context))

    for seq in range(sequences):
        pool.add(seq)
    model.step([SequenceWork(seq, prompt(), 0, tuple(pool.grow(seq, context)), SamplingSpec()) for seq in range(sequences)])
    position = context

    def decode() -> None:
        nonlocal position
        model.step([SequenceWork(seq, (rng.randrange(model.vocab_size),), position, tuple(pool.grow(seq, position + 1)),
                                 SamplingSpec(draw=position - context)) for seq in range(sequences)])
        position += 1

    def prefill() -> None:
        nonlocal next_seq
        seqs = list(range(next_seq, next_seq + 4))
        next_seq += 4
        for seq in seqs:
            pool.add(seq)
        model.step([SequenceWork(seq, prompt(), 0, tuple(pool.grow(seq, context)), SamplingSpec()) for seq in seqs])
        for seq in seqs:
            pool.free(seq)

    times: dict[str, list[float]] = {f"{kind}_{name}": [] for kind in ("decode16", "prefill4x64") for name in residents}
    for round_ in range(rounds + 1):
        for name, resident in residents.items():
            executor.resident = resident  # type: ignore[assignment]
            for kind, step, repeat in (("decode16", decode, 3), ("prefill4x64", prefill, 1)):
                start = time.perf_counter()
                for _ in range(repeat):
                    step()
                if round_:  # round 0: warm-up (oneDNN compiles its kernels per row count)
                    times[f"{kind}_{name}"].append((time.perf_counter() - start) / repeat * 1e3)
    result: dict[str, Any] = {"model": model_dir, "rounds": rounds,
                              **{f"{key}_ms": round(statistics.median(v), 2) for key, v in times.items()}}
    for kind in ("decode16", "prefill4x64"):
        result[f"{kind}_grouped_over_prepacked"] = round(result[f"{kind}_prepacked_ms"] / result[f"{kind}_grouped_ms"], 3)
    result["auto_chose"] = chosen
    result["auto_seconds"] = {name: round(s * 1e3, 3) for name, s in executor.cpu_expert_seconds.items()}
    if profile:
        executor.resident = resident_auto
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            decode()
        profiler.disable()
        rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][3])[:30]  # type: ignore[attr-defined]
        result["decode16_profile_cumulative_self_ms_per_step"] = [
            (f"{Path(f).name}:{line} {fn}", round(ct / 20 * 1e3, 2), round(tt / 20 * 1e3, 2))
            for (f, line, fn), (_, _, tt, ct, _) in rows]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", help="time whole steps of this checkpoint instead (see the module docstring)")
    parser.add_argument("--profile", action="store_true", help="with --model: cProfile 20 decode steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model:
        result = steps(args.model, args.rounds, args.profile)
        print(json.dumps(result))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
        return
    e, h, i = args.experts, args.hidden, args.intermediate
    packed = torch.randn(e, 3 * i * h) * 0.02
    w13, w2 = packed_views(packed, i, h)
    prepacked = PrepackedExperts.of(packed, i, h)
    loops = {"loop": lambda x, offs: grouped_swiglu(x, w13, w2, offs, grouped=False),
             "grouped": lambda x, offs: grouped_swiglu(x, w13, w2, offs, grouped=True),
             "prepacked": prepacked.swiglu}
    weight_bytes = packed.numel() * packed.element_size()
    for rows in args.rows:
        x = torch.randn(e * rows, h)
        offs = torch.arange(1, e + 1, dtype=torch.int32) * rows
        times: dict[str, list[float]] = {name: [] for name in loops}
        for round_ in range(args.rounds + 2):
            for name, loop in loops.items():
                start = time.perf_counter()
                loop(x, offs)
                if round_ >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(t) for name, t in times.items()}
        result = {"experts": e, "hidden": h, "intermediate": i, "rows_per_expert": rows,
                  **{f"{name}_ms": round(median[name] * 1e3, 3) for name in loops},
                  **{f"{name}_over_loop": round(median["loop"] / median[name], 3) for name in ("grouped", "prepacked")},
                  **{f"{name}_weight_gb_per_s": round(weight_bytes / median[name] / 1e9, 1) for name in loops}}
        print(json.dumps(result))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
