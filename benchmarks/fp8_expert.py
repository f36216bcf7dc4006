"""Block-FP8 vs bf16 expert rows on one GPU (DeepSeek-V3 expert: I = 2048, H = 7168).

Measures (CUDA events, median of N): the pinned host→device copy of one packed row (what a slot
fill moves), the dequantisation of a stack of FP8 rows into a bf16 scratch, and the SwiGLU grouped
GEMMs over that stack: bf16 rows as they are, FP8 rows dequantised first (the path before 2026-12-06),
and FP8 rows as the EP layer now computes them (``ExpertStacks.swiglu``: the Triton grouped GEMM reading
the fp8 weights and block scales in place; W8A16 and, ``model.expert_compute: w8a8``, against FP8 activations
quantised ahead of each GEMM — that quantisation timed with it), each with the weights' bytes over its time.
Prints JSON.

    python3 benchmarks/fp8_expert.py --experts 4 --pairs 512 2048 8192
    python3 benchmarks/fp8_expert.py --experts 8 --pairs 32 128 512 --skewed   # the serving benchmark's rank
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from vexpert_runtime.model.ep_moe import ExpertStacks
from vexpert_runtime.model.expert_format import ExpertFormat, quantize_fp8_block
from vexpert_runtime.model.grouped_moe import GROUP_ALIGN, grouped_swiglu, packed_views
from vexpert_runtime.model.moe_math import relative_error

INTER, HIDDEN, BLOCK = 2048, 7168, (128, 128)


def cuda_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of ``fn`` on the current stream (3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fp8_rows(fmt: ExpertFormat, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows [E, D8] uint8, the same experts as bf16 rows [E, 3·I·H]) of random weights."""
    fp8, dense = [], []
    for _ in range(experts):
        w = {"gate": torch.randn(INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
             "up": torch.randn(INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
             "down": torch.randn(HIDDEN, INTER, generator=gen) / INTER**0.5}
        q = {p: quantize_fp8_block(t, BLOCK) for p, t in w.items()}
        fp8.append(fmt.pack_fp8({p: a for p, (a, _) in q.items()}, {p: s for p, (_, s) in q.items()}))
        dense.append(torch.cat([w[p].reshape(-1) for p in ("gate", "up", "down")]).to(torch.bfloat16))
    return torch.stack(fp8), torch.stack(dense)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=4, help="rows in the stack (EP64: 4 resident experts/GPU)")
    parser.add_argument("--pairs", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skewed", action="store_true",
                        help="pairs split 1/(e+1) over the experts (a hot expert), not evenly")
    args = parser.parse_args()
    device = torch.device("cuda")
    fmt = ExpertFormat(INTER, HIDDEN, torch.bfloat16, BLOCK)
    host8, host16 = fp8_rows(fmt, args.experts, torch.Generator().manual_seed(0))
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "fp8_row_bytes": fmt.row_bytes, "bf16_row_bytes": host16[0].numel() * 2}
    # One slot fill: a pinned pool row → HBM.
    for name, row in (("fp8", host8[0]), ("bf16", host16[0])):
        pinned, target = row.pin_memory(), torch.empty_like(row, device=device)
        ms = cuda_ms(lambda p=pinned, t=target: t.copy_(p, non_blocking=True), args.repeats)
        out[f"copy_{name}_ms"] = round(ms, 4)
        out[f"copy_{name}_gb_per_s"] = round(row.numel() * row.element_size() / ms / 1e6, 2)
    rows8, rows16 = host8.to(device), host16.to(device)
    out["dequant_stack_ms"] = round(cuda_ms(lambda: fmt.stack_weights(rows8), args.repeats), 4)
    results = []
    stacks = ExpertStacks(rows8, None, INTER, format=fmt)
    w8a8 = ExpertStacks(rows8, None, INTER, format=dataclasses.replace(fmt, fp8_activations=True))
    w13, w2 = packed_views(rows16, INTER, HIDDEN)
    for pairs in args.pairs:
        share = torch.tensor([1.0 / (e + 1) if args.skewed else 1.0 for e in range(args.experts)])
        counts = (share / share.sum() * pairs).floor().long()
        counts[0] += pairs - int(counts.sum())
        padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        offs = padded.cumsum(0).to(device=device, dtype=torch.int32)
        x = torch.randn(int(padded.sum()), HIDDEN, device=device, dtype=torch.bfloat16)
        out8 = torch.empty_like(x)
        bf16_ms = cuda_ms(lambda x=x, offs=offs: grouped_swiglu(x, w13, w2, offs), args.repeats)
        dequant_ms = cuda_ms(lambda x=x, offs=offs: grouped_swiglu(x, *fmt.stack_weights(rows8), offs), args.repeats)
        in_place_ms = cuda_ms(lambda x=x, offs=offs, o=out8: stacks.swiglu(x, rows8, offs, o), args.repeats)
        out_a8 = torch.empty_like(x)
        w8a8_ms = cuda_ms(lambda x=x, offs=offs, o=out_a8: w8a8.swiglu(x, rows8, offs, o), args.repeats)
        # The FP8 paths against bf16 weights they were quantised from (e4m3 precision, not a bug bound), and
        # the in-place kernel against the dequantised stack (the same FP8 weights: rounding only).
        want = grouped_swiglu(x, w13, w2, offs).float()
        dequantised = grouped_swiglu(x, *fmt.stack_weights(rows8), offs).float()
        stacks.swiglu(x, rows8, offs, out8)
        w8a8.swiglu(x, rows8, offs, out_a8)
        results.append({"pairs": int(padded.sum()), "bf16_gemm_ms": round(bf16_ms, 4),
                        "fp8_dequant_plus_gemm_ms": round(dequant_ms, 4), "fp8_in_place_ms": round(in_place_ms, 4),
                        "fp8_w8a8_ms": round(w8a8_ms, 4),
                        "bf16_weight_tb_per_s": round(host16.numel() * 2 / bf16_ms / 1e9, 2),
                        "fp8_in_place_weight_tb_per_s": round(host8.numel() / in_place_ms / 1e9, 2),
                        "rel_error_vs_bf16_weights": round(relative_error(dequantised, want), 4),
                        "in_place_vs_dequantised": round(relative_error(out8.float(), dequantised), 5),
                        "w8a8_vs_dequantised": round(relative_error(out_a8.float(), dequantised), 5)})
        print(json.dumps(results[-1]), flush=True)
    out["grouped_swiglu"] = results
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
