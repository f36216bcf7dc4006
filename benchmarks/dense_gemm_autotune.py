"""What inductor's GEMM autotuning finds for the decode step's dense linears against cuBLAS, on a GPU (issue #21).

The 256-sequence step's attention output projection (o_proj, [256, 16384] × [16384, 7168]) is cuBLAS's 112×128 tile
grid, ~85 µs a layer on an H200 (run 14) against ~61 µs of its FLOPs at the dense bf16 peak: 168 tiles over 132
SMs, so a second, mostly empty wave. This times, for DeepSeek-V3's dense linear shapes at 64 and 256 rows, the
served ``F.linear`` (cuBLAS) and the same call compiled with ``mode="max-autotune-no-cudagraphs"`` (inductor tries
its Triton templates — persistent TMA ones on sm_90 — beside cuBLAS and keeps the fastest; its autotune table goes
to stderr), each checked against the eager product and timed as the step runs it, captured in a CUDA graph. A template that wins by more than a few µs a layer is worth
serving; one that does not closes the question.

    PYTHONPATH=runtime python3 benchmarks/dense_gemm_autotune.py --rows 64 256 --out dense_gemm_autotune.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from fp8_linear_tuning import SHAPES
from grouped_gemm_tuning import graphed_ms, write_results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES],
                        help="of " + ", ".join(name for name, _, _ in SHAPES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("dense_gemm_autotune.py times CUDA GEMMs: no CUDA device here")
    torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON"
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, out_features, in_features in SHAPES:
        if name not in args.shapes:
            continue
        weight = (torch.randn(out_features, in_features, device="cuda", generator=generator)
                  / in_features ** 0.5).bfloat16()
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", generator=generator).bfloat16()
            torch._dynamo.reset()
            tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            began = time.perf_counter()
            error = (tuned(x, weight).float() - F.linear(x, weight).float()).abs().max().item()
            compile_s = time.perf_counter() - began
            cublas = graphed_ms(args.iters, F.linear, x, weight)
            autotuned = graphed_ms(args.iters, tuned, x, weight)
            row = {"shape": name, "rows": rows, "n": out_features, "k": in_features, "cublas_ms": round(cublas, 4),
                   "autotuned_ms": round(autotuned, 4), "gain_us": round((cublas - autotuned) * 1e3, 1),
                   "max_abs_error": error, "compile_s": round(compile_s, 1),
                   "weights_tb_s": round(weight.numel() * 2 / (min(cublas, autotuned) * 1e-3) / 1e12, 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_results(args.out, rows=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
