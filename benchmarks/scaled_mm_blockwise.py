"""Block-scaled FP8 GEMMs from torch itself (``torch._scaled_mm`` with DeepSeek-V3's scales: activations per row and
128 columns, weights per 128 × 128 block — cuBLAS's block scaling on Hopper) beside what ``vexpert serve`` runs for
DeepSeek-V3's linear layers today: cuBLAS bf16 over the dequantised weight (``linear_format: dense``, the default) and
our Triton kernel over the FP8 weight as stored (``fp8_linear``, W8A16 and W8A8), at the attention's and the shared
expert's shapes, 16 / 64 / 256 rows; each graphed (``grouped_gemm_tuning.graphed_ms``), the FP8 paths checked against the
same product in float32 (the activations quantised as W8A8 quantises them). Where torch refuses a scale layout the row
says why (``error``). Whether torch's GEMM is worth serving the FP8 linears with is what this measures (issue #21).

    PYTHONPATH=runtime python3 benchmarks/scaled_mm_blockwise.py --rows 16 64 256 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_gemm_tuning import graphed_ms, write_results

from vexpert_runtime.model.expert_format import dequantize_fp8_block, quantize_fp8_block
from vexpert_runtime.model.fp8_activations import dequantize_activation_groups, quantize_activation_groups
from vexpert_runtime.serve.fp8_linear import fp8_linear

# DeepSeek-V3's linears outside the routed experts: (name, N, K)
SHAPES = (("q_a+kv_a", 2112, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384), ("shared gate+up", 4096, 7168),
          ("shared down", 7168, 2048))


def torch_blockwise(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                    layout: str) -> torch.Tensor:
    """``torch._scaled_mm`` over FP8 x [M, K] (scales [M, K/128]) and FP8 W [N, K] (scales [N/128, K/128]):
    ``layout`` says how the scales are laid out (torch's Hopper block scaling wants them outer-dimension-major)."""
    if layout == "outer-major":
        scale_a = x_scales.t().contiguous().t()  # [M, K/128], stride (1, M)
        scale_b = w_scales.t()  # [K/128, N/128] view of the [N/128, K/128] scales
    else:
        scale_a = x_scales
        scale_b = w_scales.t().contiguous()
    return torch._scaled_mm(xq, wq.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def quantised_then_blockwise(x: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor, layout: str) -> torch.Tensor:
    """x quantised per row and 128 columns (as a served W8A8 linear quantises it), then :func:`torch_blockwise`."""
    return torch_blockwise(*quantize_activation_groups(x, 128), wq, w_scales, layout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for name, n, k in SHAPES:
        weight = torch.randn(n, k, device="cuda") * 0.02
        wq, w_scales = quantize_fp8_block(weight, (128, 128))
        dense = dequantize_fp8_block(wq, w_scales, (128, 128), torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, x_scales = quantize_activation_groups(x, 128)
            want = dequantize_activation_groups(xq, x_scales, 128, torch.float32) @ dense.float().t()
            row: dict[str, object] = {"shape": name, "rows": m, "n": n, "k": k}
            row["bf16_cublas_ms"] = round(graphed_ms(args.iters, F.linear, x, dense), 4)
            row["triton_w8a16_ms"] = round(graphed_ms(args.iters, fp8_linear, x, wq, w_scales, 128, 128, False), 4)
            row["triton_w8a8_ms"] = round(graphed_ms(args.iters, fp8_linear, x, wq, w_scales, 128, 128, True), 4)
            got = fp8_linear(x, wq, w_scales, 128, 128, True)
            row["triton_w8a8_rel_err"] = round(float((got.float() - want).norm() / want.norm()), 5)
            for layout in ("outer-major", "row-major"):
                try:
                    got = torch_blockwise(xq, x_scales, wq, w_scales, layout)
                    torch.cuda.synchronize()
                    row[f"torch_{layout}_rel_err"] = round(float((got.float() - want).norm() / want.norm()), 5)
                    row[f"torch_{layout}_ms"] = round(graphed_ms(args.iters, torch_blockwise, xq, x_scales, wq, w_scales,
                                                                 layout), 4)
                    # with the activations' quantisation in the timing, as a served W8A8 linear pays it
                    row[f"torch_{layout}_with_quant_ms"] = round(graphed_ms(args.iters, quantised_then_blockwise, x, wq,
                                                                            w_scales, layout), 4)
                except Exception as exc:  # what torch says is the result here
                    row[f"torch_{layout}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_results(args.out, rows=rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
