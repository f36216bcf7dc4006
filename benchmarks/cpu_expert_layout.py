"""The CPU expert loop over packed expert rows vs oneDNN-prepacked experts (why a CPU rank keeps its
resident experts prepacked: ``grouped_moe.PrepackedExperts``).

The product's two CPU expert loops over the same random experts: ``grouped_moe.grouped_swiglu`` over
``packed_views`` of the packed rows (``F.linear``, MKL: what a CPU rank ran before, and what its slots
still run) and ``PrepackedExperts.swiglu`` (oneDNN's ``_linear_pointwise`` over weights reordered once),
with ``rows`` tokens per expert, interleaved A/B, medians; fp32, one torch thread. Default shapes: the
side-by-side CPU model of ``cpu_serve_compare.py`` (32 experts, hidden 512, moe_intermediate 256).

    .venv/bin/python benchmarks/cpu_expert_layout.py --out benchmarks/results/cpu_compare/expert_layout.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vexpert_runtime.model.grouped_moe import PrepackedExperts, grouped_swiglu, packed_views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate
    packed = torch.randn(e, 3 * i * h) * 0.02
    w13, w2 = packed_views(packed, i, h)
    prepacked = PrepackedExperts.of(packed, i, h)
    loops = {"packed": lambda x, offs: grouped_swiglu(x, w13, w2, offs, grouped=False), "prepacked": prepacked.swiglu}
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
                  "packed_ms": round(median["packed"] * 1e3, 3), "prepacked_ms": round(median["prepacked"] * 1e3, 3),
                  "speedup": round(median["packed"] / median["prepacked"], 3),
                  "prepacked_weight_gb_per_s": round(weight_bytes / median["prepacked"] / 1e9, 1)}
        print(json.dumps(result))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
