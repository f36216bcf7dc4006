"""Sweep the launch parameters of the block-FP8 linear layers (``--linear-format fp8_block``) on a GPU (issue #21).

Run 27 found FP8 linears slower than cuBLAS's bf16 GEMMs (the graphed 256-sequence step 1.881 -> 2.397 ms with W8A8,
64 sequences 1.377 -> 1.587): :func:`~vexpert_runtime.serve.fp8_linear.fp8_linear` runs the expert kernel over one
"expert", with the down-projection's launch table, whose 128-column blocks give o_proj (N 7,168) 56 programs at 64
rows or fewer — under half an H100's SMs. This times, for DeepSeek-V3's FP8 linear shapes at 16 / 64 / 256 rows,
cuBLAS's bf16 ``F.linear`` over the dequantised weight, the served launch (``launch_config("linear", ...)``) and a
grid of launch configurations, W8A16 and W8A8, each checked against the dequantised product (W8A8 within e4m3's
error); per row bucket of the table it prints the configuration with the least time summed over the shapes, and
``--apply`` writes those as the ``"linear"`` rows of ``_FP8_CONFIGS`` / ``_W8A8_CONFIGS``:

    PYTHONPATH=runtime python3 benchmarks/fp8_linear_tuning.py --rows 16 64 256 --out linear.json [--apply]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from grouped_gemm_tuning import time_ms, with_launch_table

from vexpert_runtime.model import grouped_gemm_kernel
from vexpert_runtime.model.expert_format import quantize_fp8_block
from vexpert_runtime.model.fp8_activations import quantize_activation_groups
from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, launch_config
from vexpert_runtime.model.moe_math import relative_error
from vexpert_runtime.serve.fp8_linear import Fp8Linear

# DeepSeek-V3's FP8 linears besides the experts, (name, N, K): MLA's fused q_a + kv_a, q_b and o_proj, the shared
# expert's fused gate + up and its down (kv_b_proj stays dense: the decode absorbs it)
SHAPES = (("q_a+kv_a", 1536 + 576, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384),
          ("shared gate+up", 4096, 7168), ("shared down", 7168, 2048))
BLOCK = (128, 128)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--modes", nargs="+", choices=("w8a16", "w8a8"), default=["w8a16", "w8a8"])
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic in Triton's interpreter "
                        "(TRITON_INTERPRET=1; shapes cut to 1/32, one configuration, times meaningless)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--apply", action="store_true", help="write the best configuration per row bucket into "
                        "grouped_gemm_kernel.py's \"linear\" rows")
    args = parser.parse_args()
    device, dry = args.device, args.device != "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    layers = []
    for name, out_features, in_features in SHAPES:
        if dry:
            out_features, in_features = -(-out_features // 32 // 128) * 128, -(-in_features // 32 // 128) * 128
        weight = torch.randn(out_features, in_features, device=device, generator=generator) / in_features ** 0.5
        layers.append((name, Fp8Linear(*quantize_fp8_block(weight, BLOCK), BLOCK)))
    grid = [(m, n, 128, warps, stages, 0) for m, n, warps, stages in
            itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (3, 4))]
    if dry:
        grid = [launch_config("linear", 64, True, False)]
    timed = time_ms if not dry else lambda _iters, fn, *a, **k: (fn(*a, **k), 0.0)[1]
    results: list[dict[str, object]] = []
    for mode, rows in itertools.product(args.modes, args.rows):
        a8 = mode == "w8a8"
        for name, layer in layers:
            dtype = torch.float32 if dry else torch.bfloat16  # (the interpreter widens fp8 to bf16 wrongly)
            x = torch.randn(rows, layer.in_features, device=device, generator=generator).to(dtype)
            dense = layer.dequantized(dtype)
            want = torch.nn.functional.linear(x, dense)
            offs = torch.full((1,), rows, dtype=torch.int32, device=device)
            w, scales = layer.weight.unsqueeze(0), layer.weight_scale_inv.unsqueeze(0)
            if a8:
                source, x_scales = quantize_activation_groups(x, BLOCK[1])
                extra = {"x_scales": x_scales, "out_dtype": dtype}
            else:
                source, extra = x, {}
            case: dict[str, object] = {"mode": mode, "rows": rows, "linear": name, "n": layer.out_features,
                                       "k": layer.in_features,
                                       "cublas_bf16_ms": round(timed(args.iters, torch.nn.functional.linear, x, dense), 4),
                                       "served": launch_config("linear", rows, True, a8), "configs": []}
            configs: list[dict[str, object]] = case["configs"]  # type: ignore[assignment]
            for config in dict.fromkeys([*grid, case["served"]]):  # the served launch timed too
                try:
                    got = grouped_gemm(source, w, offs, config=config, scales=scales, scale_block=BLOCK, **extra)
                    if not dry:
                        torch.cuda.synchronize()
                except Exception as error:  # out of shared memory etc.: the sweep goes on
                    configs.append({"config": config, "error": str(error)[:120]})
                    continue
                err = relative_error(got.float(), want.float())
                ms = timed(args.iters, grouped_gemm, source, w, offs, config=config, scales=scales, scale_block=BLOCK,
                           **extra)
                configs.append({"config": config, "ms": round(ms, 4), "rel_err": round(err, 4)})
            tolerance = 0.08 if a8 else 0.02
            ok = [c for c in configs if "ms" in c and c["rel_err"] < tolerance]  # type: ignore[operator]
            served = next((c for c in ok if tuple(c["config"]) == case["served"]), None)  # type: ignore[arg-type]
            best = min(ok, key=lambda c: c["ms"])  # type: ignore[arg-type, return-value]
            case["best"] = best
            print(f"{mode} rows {rows:4d} {name:15s} [{layer.out_features}, {layer.in_features}]: cuBLAS bf16 "
                  f"{case['cublas_bf16_ms']} ms, served {served['ms'] if served else 'n/a'} ms, best {best['config']} "
                  f"{best['ms']} ms", flush=True)
            results.append(case)
    tables = {}
    for mode in args.modes:
        a8 = mode == "w8a8"
        current = grouped_gemm_kernel._W8A8_CONFIGS if a8 else grouped_gemm_kernel._FP8_CONFIGS
        rows_table = []
        for limit, default in current["linear"]:
            cases = [c for c in results if c["mode"] == mode and launch_config("linear", c["rows"], True, a8) == default]
            totals: dict[tuple[int, ...], list[float]] = {}
            for c in cases:
                for entry in c["configs"]:  # type: ignore[attr-defined]
                    if "ms" in entry and entry["rel_err"] < (0.08 if a8 else 0.02):
                        totals.setdefault(tuple(entry["config"]), []).append(entry["ms"])
            complete = {k: sum(v) for k, v in totals.items() if len(v) == len(cases)}
            fastest = min(complete, key=complete.__getitem__) if complete else default
            rows_table.append((limit, fastest))
            cublas = sum(c["cublas_bf16_ms"] for c in cases)  # type: ignore[misc]
            if complete:
                print(f"{mode} rows <= {limit}: best over {len(cases)} linears {fastest} {complete[fastest]:.4f} ms; the "
                      f"table's {default} {complete.get(default, float('nan')):.4f} ms; cuBLAS bf16 {cublas:.4f} ms",
                      flush=True)
        tables[mode] = rows_table
        if args.apply:
            name = "_W8A8_CONFIGS" if a8 else "_FP8_CONFIGS"
            kernel_file = Path(grouped_gemm_kernel.__file__)
            full = {gemm: list(entries) for gemm, entries in current.items()}
            full["linear"] = rows_table
            kernel_file.write_text(with_launch_table(kernel_file.read_text(), full, name))
            print(f"wrote {name}['linear'] into {kernel_file}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if not dry else device,
                                        "torch": torch.__version__,
                                        "tables": tables, "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
