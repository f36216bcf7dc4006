"""Sweep the Triton grouped SwiGLU's launch parameters against ``torch._grouped_mm`` on a GPU (issue #21).

The decode step's expert GEMMs at the serving benchmark's DeepSeek-V3 sizes (H 7168, expert I 2048,
8 experts on the rank, top-2): for 16 / 64 / 256 tokens, groups padded to 16 rows as the EP layer lays
them out, once split evenly and once skewed (a Zipf-like split, as the demo router's hot experts give).
Each configuration of ``vexpert_runtime.model.grouped_gemm_kernel`` is checked against the CUTLASS path
(``grouped_moe.grouped_swiglu``) and timed with CUDA events over back-to-back calls; printed: ms per
call, the weights' bytes over that time (GB/s; the GEMMs read every expert once), the best
configuration per GEMM and token count, and per bucket of ``launch_config``'s table the configuration
with the least time over that bucket's cases. ``--out`` writes the JSON; ``--apply`` writes the table into
``grouped_gemm_kernel.py``.

    PYTHONPATH=runtime python3 benchmarks/grouped_gemm_tuning.py --tokens 16 64 256 --out results.json

``--stages`` and ``--gate-up-block-k`` widen the grid: run 15 swept 3 and 4 stages and 128-wide K tiles for the
gate/up GEMM, where the 256-token winner holds one 4-warp program per SM (192 KB of shared memory,
``kernel_resources.py``); 2 stages or 64-wide K tiles fit two or three:

    PYTHONPATH=runtime python3 benchmarks/grouped_gemm_tuning.py --tokens 256 --stages 2 3 4 --gate-up-block-k 64 128

``--fp8``: the experts as block-FP8 rows (DeepSeek-V3's release: 128×128 blocks), which the kernel reads in place
(fp8 weights and their scales; K tiles of at most 128): every configuration checked against CUTLASS over the
dequantised bf16 stack, the bytes counted as stored (half of bf16's). Its launch table is its own;
``--apply`` writes that table (``_FP8_CONFIGS``) instead of the bf16 rows' one.

``--w8a8`` (implies ``--fp8``): against FP8 activations too (``model.expert_compute: w8a8``): each GEMM's input
quantised per row and 128 columns ahead (``quantize_activation_groups``, outside the timed kernel — the serving path
runs it as its own ops), checked against W8A16's CUTLASS result within e4m3's error (8 %; the exact check is the
tests' twin); ``--apply`` writes ``_W8A8_CONFIGS``.

``--gather``: the gate/up GEMM reads its rows in place through ``row_src`` (each buffer row a token of the batch), as
the EP layer serves it since run 28f, instead of from a contiguous copy (the tables before were swept without it).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from vexpert_runtime.model import grouped_gemm_kernel
from vexpert_runtime.model.expert_format import ExpertFormat, quantize_fp8_block
from vexpert_runtime.model.fp8_activations import quantize_activation_groups
from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, launch_config, triton_swiglu
from vexpert_runtime.model.grouped_moe import GROUP_ALIGN, grouped_swiglu, packed_views, padded_capacity


def group_ends(tokens: int, top_k: int, experts: int, skewed: bool) -> tuple[torch.Tensor, int]:
    """offs [E] int32 of ``tokens``·``top_k`` pairs over ``experts`` groups padded to GROUP_ALIGN, and
    the buffer's rows (the EP layer's capacity for that many pairs)."""
    pairs = tokens * top_k
    weights = torch.tensor([1.0 / (e + 1) if skewed else 1.0 for e in range(experts)])
    counts = (weights / weights.sum() * pairs).floor().long()
    counts[0] += pairs - int(counts.sum())
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    return padded.cumsum(0).to(torch.int32), padded_capacity(pairs, experts)


def with_launch_table(source: str, table: dict[str, list[tuple[int, tuple[int, ...]]]], name: str = "_CONFIGS") -> str:
    """grouped_gemm_kernel.py's text with ``table`` (per GEMM: (rows-per-expert limit, config)) as ``name``
    (_CONFIGS: bf16 rows; _FP8_CONFIGS: block-FP8 rows)."""
    begin = source.index(f"\n{name}: dict[") + 1
    stop = source.index("}\n", begin) + 2
    lines = [f"{name}: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {{"]
    for gemm, rows in table.items():
        entries = ", ".join(f"({'1 << 30' if limit >= 1 << 30 else limit}, {tuple(config)})" for limit, config in rows)
        lines.append(f'    "{gemm}": ({entries}),')
    return source[:begin] + "\n".join(lines) + "\n}\n" + source[stop:]


def time_ms(iters: int, fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    """ms per call of fn(*args, **kwargs), back to back between CUDA events (after 3 warm-up calls)."""
    for _ in range(3):
        fn(*args, **kwargs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args, **kwargs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def write_results(path: Path, **fields: object) -> None:
    """A GPU benchmark's results file: the card and torch that ran it, then ``fields`` (JSON, indented)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **fields},
                               indent=1))


def graphed_ms(iters: int, fn: Callable[..., object], *args: object) -> float:
    """ms per call of fn(*args), ``iters`` calls captured in one CUDA graph (as the step replays them: no host
    dispatch between kernels), median of 5 replays (after 3 warm-up calls)."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(*args)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--gate-up-block-k", type=int, nargs="+", default=[128])
    parser.add_argument("--row-tile-block-m", type=int, nargs="+", default=[16, 32, 64],
                        help="BLOCK_M of the row-tile grid past 16 rows per expert")
    parser.add_argument("--fp8", action="store_true", help="block-FP8 expert rows read in place (see above)")
    parser.add_argument("--w8a8", action="store_true", help="FP8 rows against FP8 activations (see above)")
    parser.add_argument("--gather", action="store_true",
                        help="the gate/up GEMM reads its rows in place, as the EP layer serves it (row_src: each buffer "
                             "row a random token of the batch) instead of from a contiguous copy")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--apply", action="store_true", help="write the best configuration per bucket into "
                        "grouped_gemm_kernel.py's launch table")
    args = parser.parse_args()
    args.fp8 = args.fp8 or args.w8a8
    tolerance = 0.08 if args.w8a8 else 0.02  # e4m3 activations: 3 mantissa bits
    torch.manual_seed(0)
    hidden, inter, experts = args.hidden, args.intermediate, args.experts
    rows = torch.randn(experts, 3 * inter * hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w13, w2 = packed_views(rows, inter, hidden)
    bytes_gate_up, bytes_down = w13.numel() * 2, w2.numel() * 2
    # the Triton kernel's operands: the same views, or FP8 rows with their scales (and CUTLASS over their dequantised copy)
    kernel_weights = {"gate_up": (w13, {}), "down": (w2, {})}
    fp8_scales: dict[str, object] = {}  # triton_swiglu's scale arguments (FP8)
    if args.fp8:
        fmt = ExpertFormat(inter, hidden, torch.bfloat16, (128, 128))
        packed = []
        for e in range(experts):
            quantised = {p: quantize_fp8_block(m, fmt.layout.block)
                         for p, m in (("gate", w13[e, :inter]), ("up", w13[e, inter:]), ("down", w2[e]))}
            packed.append(fmt.pack_fp8({p: q for p, (q, _) in quantised.items()},
                                       {p: s for p, (_, s) in quantised.items()}))
        rows8 = torch.stack(packed).cuda()
        stack = fmt.fp8_stack(rows8)
        assert stack is not None
        w13, w2 = fmt.stack_weights(rows8)  # what CUTLASS and the reference multiply
        kernel_weights = {"gate_up": (stack.w13, {"scales": stack.s13, "scale_block": stack.block}),
                          "down": (stack.w2, {"scales": stack.s2, "scale_block": stack.block})}
        bytes_gate_up, bytes_down = stack.w13.numel(), stack.w2.numel()
        fp8_scales = {"scales": (stack.s13, stack.s2), "scale_block": stack.block, "fp8_activations": args.w8a8}
    results = []
    for tokens, skewed in itertools.product(args.tokens, (False, True)):
        offs, capacity = group_ends(tokens, args.top_k, experts, skewed)
        offs = offs.cuda()
        used = int(offs[-1])
        x = torch.randn(capacity, hidden, device="cuda", dtype=torch.bfloat16)
        gathered: dict[str, object] = {}  # --gather: the gate/up GEMM's row_src over the batch's tokens
        batch = x
        if args.gather:
            batch = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            row_src = torch.randint(0, tokens, (capacity,), device="cuda")
            x, gathered = batch[row_src], {"row_src": row_src}
        want_h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        want_act = torch.nn.functional.silu(want_h[:, :inter]) * want_h[:, inter:]
        want = grouped_swiglu(x, w13, w2, offs, gpu_kernel="cutlass")
        case = {"tokens": tokens, "skewed": skewed, "rows": capacity, "used_rows": used,
                "cutlass_ms": round(time_ms(args.iters, grouped_swiglu, x, w13, w2, offs, gpu_kernel="cutlass"), 4),
                "triton_default_ms": round(time_ms(args.iters, triton_swiglu, x, kernel_weights["gate_up"][0],
                                                  kernel_weights["down"][0], offs, **fp8_scales), 4),
                "cutlass_gate_up_ms": round(time_ms(args.iters, torch._grouped_mm, x, w13.transpose(-2, -1),
                                                    offs=offs), 4),
                "cutlass_down_ms": round(time_ms(args.iters, torch._grouped_mm, want_act, w2.transpose(-2, -1),
                                                 offs=offs), 4),
                "configs": {"gate_up": [], "down": []}}
        # Around run 13's winners (a 5-dimensional sweep there), with the row split of the expert-major
        # grid (1, 2, 4) and the row-tile grid (0).
        # (run 13: BLOCK_M 64 for the expert-major grid past 16 rows per expert; the row-tile grid's
        # tiles may be smaller, so more of a hot expert's rows run at once)
        small = tokens * args.top_k / experts <= 16
        grids = [((16,) if small else (64,), (1, 2, 4)), ((16,) if small else tuple(args.row_tile_block_m), (0,))]
        for gemm, source, ks in (("gate_up", batch, tuple(args.gate_up_block_k)), ("down", want_act, (64, 128))):
            weight, scaled = kernel_weights[gemm]
            if gemm == "gate_up":
                scaled = {**scaled, **gathered}
            if args.w8a8:  # the GEMM's input as the serving path hands it over: FP8 with a scale per row and 128 columns
                source, x_scales = quantize_activation_groups(source, 128)
                scaled = {**scaled, "x_scales": x_scales, "out_dtype": torch.bfloat16}
            reference = want_act if gemm == "gate_up" else want
            for block_m, block_n, block_k, warps, stages, split in itertools.chain.from_iterable(
                    itertools.product(block_ms, (64, 128), ks, (4, 8), args.stages, splits) for block_ms, splits in grids):
                config = (block_m, block_n, block_k, warps, stages, split)
                try:
                    got = grouped_gemm(source, weight, offs, swiglu=gemm == "gate_up", config=config, **scaled)
                    torch.cuda.synchronize()
                except Exception as error:  # out of shared memory etc.: the sweep goes on
                    case["configs"][gemm].append({"config": config, "error": str(error)[:120]})
                    continue
                err = float((got[:used].float() - reference[:used].float()).abs().max())
                scale = float(reference[:used].float().abs().max())
                ms = time_ms(args.iters, grouped_gemm, source, weight, offs, swiglu=gemm == "gate_up", config=config,
                             **scaled)
                size = bytes_gate_up if gemm == "gate_up" else bytes_down
                case["configs"][gemm].append({"config": config, "ms": round(ms, 4), "gbps": round(size / ms / 1e6),
                                              "rel_err": round(err / max(scale, 1e-6), 4)})
            ok = [c for c in case["configs"][gemm] if "ms" in c and c["rel_err"] < tolerance]
            best = min(ok, key=lambda c: c["ms"])
            case[f"best_{gemm}"] = best
            cutlass = case[f"cutlass_{gemm}_ms"]
            size = bytes_gate_up if gemm == "gate_up" else bytes_down
            print(f"tokens {tokens:4d} {'skewed' if skewed else 'even  '} {gemm:7s}: cutlass {cutlass:.4f} ms "
                  f"({size / cutlass / 1e6:.0f} GB/s), triton best {best['config']} {best['ms']:.4f} ms "
                  f"({best['gbps']} GB/s, rel err {best['rel_err']}); {len(ok)} configs ok", flush=True)
        results.append(case)
    # launch_config picks by rows per expert (a bucket of the table), not by skew: per bucket and GEMM,
    # the configuration with the least time summed over every case in that bucket (even and skewed)
    table = {}
    for gemm in ("gate_up", "down"):
        rows_table = []
        current = (grouped_gemm_kernel._W8A8_CONFIGS if args.w8a8 else grouped_gemm_kernel._FP8_CONFIGS if args.fp8
                   else grouped_gemm_kernel._CONFIGS)
        for limit, default in current[gemm]:
            cases = [c for c in results if launch_config(gemm, c["rows"] / experts, args.fp8, args.w8a8) == default]
            totals: dict[tuple[int, ...], list[float]] = {}
            for c in cases:
                for entry in c["configs"][gemm]:
                    if "ms" in entry and entry["rel_err"] < tolerance:
                        totals.setdefault(tuple(entry["config"]), []).append(entry["ms"])
            complete = {k: sum(v) for k, v in totals.items() if len(v) == len(cases)}
            best = min(complete, key=complete.__getitem__) if complete else default
            rows_table.append((limit, best))
            if complete:
                print(f"{gemm:7s} rows/expert <= {limit}: best over {len(cases)} cases {best} {complete[best]:.4f} ms; "
                      f"the table's {default} {complete.get(default, float('nan')):.4f} ms", flush=True)
        table[gemm] = rows_table
    if args.apply:
        kernel_file = Path(grouped_gemm_kernel.__file__)
        kernel_file.write_text(with_launch_table(kernel_file.read_text(), table,
                                                 "_W8A8_CONFIGS" if args.w8a8 else "_FP8_CONFIGS" if args.fp8
                                                 else "_CONFIGS"))
        print(f"wrote the table into {kernel_file}", flush=True)
    if args.out:
        write_results(args.out, hidden=hidden, intermediate=inter, experts=experts,
                      experts_format="block_fp8" if args.fp8 else "bf16",
                      expert_compute="w8a8" if args.w8a8 else "w8a16", table=table, cases=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
