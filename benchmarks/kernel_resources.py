"""What the product's Triton attention kernels cost an H200's SMs, without an H200: each kernel compiled
for sm_90 (Triton's own compiler and ``ptxas``, both in the Triton wheel; no GPU needed) at the launch
configurations ``vexpert serve`` uses, with the registers per thread, the bytes spilled to local memory
(``ptxas``' stack frame), the shared memory, the programs one SM can hold by registers and by shared
memory (H200: 64 K registers, 228 KB shared per SM) and a hash of the SASS without addresses, so two
trees can be compared instruction for instruction (``--compare OTHER.jsonl``).

Shapes: DeepSeek-V3's MLA (128 heads, latent 512, rope 64) and Qwen3-30B-A3B's GQA (32 query heads,
4 KV heads, head dim 128), 16-token pages, bf16 cache, int64 tables stored column by column (a graph's);
DeepSeek-V3's expert GEMMs (H 7168, I 2048, 8 experts). Arguments are specialised as Triton's JIT does
for those launches (16-byte-aligned pointers, integers divisible by 16, integers equal to 1).

    python benchmarks/kernel_resources.py --out benchmarks/results/kernel_resources_sm90.jsonl

``--sweep --only NAME`` compiles one kernel at every ``--block-h`` × ``--block-n`` × ``--warps`` × ``--stages``
point, to pick the points a GPU sweep should time (those that hold more programs per SM):

    python benchmarks/kernel_resources.py --sweep --only mla_decode_split \
        --out benchmarks/results/kernel_resources_sm90_mla_split_sweep.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated (3.9 warns otherwise)
warnings.filterwarnings("ignore", module="triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.serve import attention_kernels as ak  # noqa: E402

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

def _spec(name: str, fn: Any, pointers: dict[str, str], scalars: dict[str, int | float], constexprs: dict[str, int],
          warps: int, stages: int, unspecialised: tuple[str, ...] = ()) -> dict[str, Any]:
    """One launch as Triton's JIT specialises it: pointers 16-byte aligned (torch's allocations, and the
    views the product passes), an integer argument divisible by 16 marked so, one equal to 1 folded into
    a constant — except the kernel's ``do_not_specialize`` arguments (``unspecialised``). ``scalars`` are
    the values of a served launch (DeepSeek-V3 / Qwen3-30B-A3B shapes, a graph's column-major tables)."""
    signature: dict[str, str] = {}
    constants = dict(constexprs)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for arg in fn.arg_names:
        index = (fn.arg_names.index(arg),)
        if arg in pointers:
            signature[arg] = pointers[arg]
            attrs[index] = [["tt.divisibility", 16]]
        elif arg in constexprs:
            signature[arg] = "constexpr"
        elif isinstance(scalars.get(arg), float):
            signature[arg] = "fp32"
        elif arg in scalars:
            value = int(scalars[arg])
            if value == 1 and arg not in unspecialised:
                signature[arg] = "constexpr"
                constants[arg] = 1
            else:
                signature[arg] = "i32"
                if value % 16 == 0 and arg not in unspecialised:
                    attrs[index] = [["tt.divisibility", 16]]
        else:
            raise KeyError(f"{name}: no value for argument {arg!r}")
    return dict(name=name, fn=fn, signature=signature, constexprs=constants, attrs=attrs, warps=warps, stages=stages,
                shown={k: v for k, v in constexprs.items()})


def kernel_specs() -> list[dict[str, Any]]:
    """Every launch configuration served, as :func:`_spec` describes it."""
    import vexpert_runtime.model.grouped_gemm_kernel as gg

    rows, seqs, heads, latent, rope, splits = 256, 256, 128, 512, 64, 8
    bf16 = "*bf16"
    mla_pointers = {"q_lat": bf16, "q_rope": bf16, "cos": bf16, "sin": bf16, "cache": bf16, "tables": "*i64",
                    "token_seq": "*i64", "lens": "*i64", "out": bf16, "part": "*fp32", "part_lse": "*fp32"}
    mla_scalars: dict[str, int | float] = {
        # the rotary queries as the served step passes them: q_b's output unrotated, [T, nh, 128 + 64] strided
        "scale": 0.1, "stride_qlb": heads * latent, "stride_qlh": latent, "stride_qrb": heads * 192, "stride_qrh": 192,
        "stride_rope": rope,
        "stride_cache": latent + rope, "stride_tb": 1, "stride_tn": seqs, "stride_ob": heads * latent,
        "stride_oh": latent, "stride_pb": splits * heads * latent, "stride_ps": heads * latent, "stride_ph": latent,
        "stride_lb": splits * heads, "stride_ls": heads, "max_splits": splits}
    specs = []
    mla = dict(NH=heads, C=latent, R=rope, CP=latent, RP=rope, PAGE=16, ROTATE=True, INTERLEAVE=True)
    for tokens in (rows, 16):
        block_h, block_n, warps, stages = ak.mla_launch_config(tokens)
        shapes = {**mla, "BLOCK_H": block_h, "BLOCK_N": block_n}
        specs.append(_spec("mla_decode rows>=128" if tokens >= 128 else "mla_decode rows<128", ak._mla_decode_kernel,
                           mla_pointers, mla_scalars, shapes, warps, stages))
    block_h, block_n, warps, stages = ak.mla_split_launch_config(16)  # splits run where few rows leave SMs idle
    specs.append(_spec("mla_decode_split rows<128", ak._mla_decode_split_kernel, mla_pointers, mla_scalars,
                       {**mla, "BLOCK_H": block_h, "BLOCK_N": block_n, "SPLIT_ROWS": ak.SPLIT_ROWS}, warps, stages,
                       unspecialised=("max_splits",)))
    q_heads, kv_heads, dim = 32, 4, 128  # Qwen3-30B-A3B
    gqa_pointers = {**{k: v for k, v in mla_pointers.items() if k not in ("q_lat", "q_rope")}, "q": bf16}
    gqa_scalars: dict[str, int | float] = {
        **mla_scalars, "stride_qb": q_heads * dim, "stride_qh": dim, "stride_cache": 2 * kv_heads * dim,
        "stride_kv": kv_heads * dim, "stride_head": dim, "stride_ob": q_heads * dim, "stride_oh": dim,
        "stride_pb": splits * q_heads * dim, "stride_ps": q_heads * dim, "stride_ph": dim,
        "stride_lb": splits * q_heads, "stride_ls": q_heads}
    gqa = dict(GROUP=q_heads // kv_heads, D=dim, DP=dim, PAGE=16, BLOCK_G=ak._pow2(q_heads // kv_heads), BLOCK_N=32,
               WINDOW=0)  # as gqa_decode launches it
    specs.append(_spec("gqa_decode", ak._gqa_decode_kernel, gqa_pointers, gqa_scalars, gqa, 4, 2))
    specs.append(_spec("gqa_decode_split", ak._gqa_decode_split_kernel, gqa_pointers, gqa_scalars,
                       {**gqa, "SPLIT_ROWS": ak.SPLIT_ROWS}, 4, 2, unspecialised=("max_splits",)))
    specs.append(_spec("gqa_decode window", ak._gqa_decode_kernel, gqa_pointers, gqa_scalars,
                       {**gqa, "WINDOW": 4096}, 4, 2))  # Mixtral-style sliding-window layers
    for label, nh, width, scalars in (("mla", heads, latent, mla_scalars), ("gqa", q_heads, dim, gqa_scalars)):
        merge = dict(NH=nh, D=width, DP=width, BLOCK_H=ak._MERGE_BLOCK_H, BLOCK_N=64, SPLIT_ROWS=ak.SPLIT_ROWS,
                     WINDOW=0)
        specs.append(_spec(f"merge_splits {label}", ak._merge_splits_kernel, mla_pointers, scalars, merge, 4, 1,
                           unspecialised=("max_splits",)))
    # The MLA layer's norms, rotary key and cache write after its fused q_a + kv_a GEMM (one program per token)
    import vexpert_runtime.serve.attention_input_kernels as aik

    q_rank = 1536
    specs.append(_spec("mla_cache_rows", aik._mla_cache_rows_kernel,
                       {"a": bf16, "q_weight": bf16, "kv_weight": bf16, "cos": bf16, "sin": bf16, "slots": "*i64",
                        "cache": bf16, "q_normed": bf16},
                       {"q_eps": 1e-6, "kv_eps": 1e-6, "stride_a": q_rank + latent + rope, "stride_rope": rope,
                        "stride_cache": latent + rope, "stride_q": q_rank},
                       dict(Q=q_rank, C=latent, R=rope, QP=2048, CP=latent, RP=rope, INTERLEAVE=True), 4, 1))
    # Qwen3-30B-A3B's per-head norms, rotary embedding and cache write after its fused q / k / v GEMM
    specs.append(_spec("gqa_cache_rows", aik._gqa_cache_rows_kernel,
                       {"qkv": bf16, "q_weight": bf16, "k_weight": bf16, "cos": bf16, "sin": bf16, "slots": "*i64",
                        "cache": bf16, "q_out": bf16},
                       {"eps": 1e-6, "stride_qkv": (q_heads + 2 * kv_heads) * dim, "stride_rope": dim,
                        "stride_cache": 2 * kv_heads * dim, "stride_kv": kv_heads * dim, "stride_head": dim,
                        "stride_qt": q_heads * dim, "stride_qh": dim},
                       dict(NH=q_heads, KVH=kv_heads, D=dim, NHP=q_heads, KVHP=kv_heads, DP=dim, NORM=True), 4, 1))
    # The expert SwiGLU's grouped GEMMs at DeepSeek-V3's H 7168 / I 2048 (packed rows: D = 3·I·H), 8 experts,
    # with the launch table's choice at ≤ 24 rows per expert (16 streams) and at 64 (256 streams).
    # Block-FP8 rows (DeepSeek-V3's release: 128 × 128 blocks) with their own table, weights and scales read in place;
    # and against FP8 activations (W8A8: their scales per row and 128 columns, FP8 dots).
    from vexpert_runtime.model.expert_layout import Fp8RowLayout

    hidden, inter, experts = 7168, 2048, 8
    fp8_row = Fp8RowLayout(inter, hidden).row_bytes
    for fp8, a8 in ((False, False), (True, False), (True, True)):
        packed = fp8_row if fp8 else 3 * inter * hidden  # a row's elements (FP8: bytes)
        gemm_pointers = {"x": "*fp8e4nv" if a8 else bf16, "xs": "*fp32" if a8 else bf16, "w": "*fp8e4nv" if fp8 else bf16,
                         "s": "*fp32" if fp8 else bf16, "offs": "*i32", "out": bf16, "row_src": "*i64"}
        for gemm, (depth, width, x_stride, w_row) in (("gate_up", (hidden, inter, hidden, hidden)),
                                                      ("down", (inter, hidden, inter, inter))):
            for rows_per_expert in (16, 64):
                block_m, block_n, block_k, warps, stages, split_m = gg.launch_config(gemm, rows_per_expert, fp8, a8)
                scale = {"UP_S": inter // 128 if gemm == "gate_up" else 0, "stride_se": fp8_row // 4,
                         "stride_sn": depth // 128} if fp8 else {"UP_S": 0, "stride_se": 0, "stride_sn": 0}
                scalars: dict[str, int | float] = {"K": depth, "N": width, "UP": width, "stride_xm": x_stride,
                                                   "stride_we": packed, "stride_wn": w_row, "stride_om": width,
                                                   "split_m": split_m, "stride_xsm": depth // 128 if a8 else 0,
                                                   **scale}
                shapes = {"SWIGLU": gemm == "gate_up", "FP8": fp8, "A8": a8, "SCALE_N": 128 if fp8 else 1,
                          "SCALE_K": 128 if fp8 else 1, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                          "GATHER": gemm == "gate_up"}  # a single-GPU EP layer's gate/up reads its tokens in place
                if split_m == 0:
                    fn, shapes = gg._grouped_gemm_row_tile_kernel, {**shapes, "E": experts, "EP": experts}
                else:
                    fn = gg._grouped_gemm_kernel
                kind = " fp8 w8a8" if a8 else " fp8" if fp8 else ""
                specs.append(_spec(f"grouped_gemm{kind} {gemm} {rows_per_expert} rows/expert", fn,
                                   gemm_pointers, scalars, shapes, warps, stages))
    # The routers' expert selection as the fused routers launch it: DeepSeek-V3's release (256 experts in 8
    # groups, 4 kept, top-8) and a grouped 8-expert one (8 in 4 groups, 2 kept, top-2); Qwen3-30B-A3B's
    # softmax top-8 of 128 (bf16 weights out).
    import vexpert_runtime.model.routing_kernel as rk

    select_pointers = {"logits": "*fp32", "bias": "*fp32", "ids_out": "*i64", "weights_out": "*fp32"}
    for label, (n_experts, groups, kept, top_k, softmax) in (("deepseek_v3_select 256 experts", (256, 8, 4, 8, False)),
                                                             ("deepseek_v3_select 8 experts", (8, 4, 2, 2, False)),
                                                             ("softmax_topk_select 128 experts", (128, 1, 1, 8, True))):
        select_scalars: dict[str, int | float] = {"tokens": rows, "stride_l": n_experts, "stride_o": top_k,
                                                  "scaling": 1.0 if softmax else 2.5}
        select = rk.launch_constexprs(n_experts, groups, kept, top_k, softmax=softmax, has_bias=not softmax,
                                      normalise=True)
        pointers = {**select_pointers, "logits": bf16, "weights_out": bf16} if softmax else select_pointers
        specs.append(_spec(label, rk._select_experts_kernel, pointers, select_scalars, select, 4, 1))
    # The EP layer's layout kernel, one rank's pairs of a 256-sequence step (512 rows; 8 experts and 2 slots: 16
    # one-hot columns) at the served launch and the warps benchmarks/layout_kernel_tuning.py times
    import vexpert_runtime.model.layout_kernel as lk

    pairs, groups = 512, 16
    layout_pointers = {"group_src": "*i64", "local_table": "*i64", "row_src": "*i64", "position": "*i64",
                       "resident_offs": "*i32", "slot_offs": "*i32", "computed": "*i64"}
    layout_scalars: dict[str, int | float] = {"stride_table": 1, "T": pairs, "M": 2 * pairs, "resident_rows": pairs}
    served_warps, entries = lk.launch_config(pairs, groups)
    for warps in sorted({served_warps, 8, 16}):
        layout = {"RESIDENT": 8, "SLOTS": 2, "ALIGN": 16, "LOOKUP": 1, "TOKEN_DIV": 2, "GP": groups,
                  "CHUNK": min(pairs, entries // groups), "ZERO_BLOCK": 1024}
        label = "layout 512 rows" + (" (served)" if warps == served_warps else "")
        specs.append(_spec(label, lk._layout_kernel, layout_pointers, layout_scalars, layout, warps, 1))
    return specs


def resources(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile one spec for sm_90 and read its resources from the cubin."""
    compiled = triton.compile(ASTSource(fn=spec["fn"], signature=spec["signature"], constexprs=spec["constexprs"],
                                        attrs=spec["attrs"]),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=spec["warps"], num_stages=spec["stages"]))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(_BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert match is not None, usage
    registers, stack = int(match.group(1)), int(match.group(2))
    instructions = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
                    for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    shared = int(compiled.metadata.shared)
    threads = 32 * spec["warps"]
    return {"kernel": spec["name"], "warps": spec["warps"], "stages": spec["stages"],
            "constexprs": spec["shown"], "registers": registers, "spill_bytes": stack, "shared_bytes": shared,
            "programs_per_sm_by_registers": REGISTERS_PER_SM // (registers * threads),
            "programs_per_sm_by_shared": SHARED_PER_SM // max(shared, 1),
            "sass_instructions": len(instructions),
            "sass_sha1": hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:12],
            "triton": triton.__version__}


def launch_points(spec: dict[str, Any], block_h: list[int], block_n: list[int], warps: list[int],
                  stages: list[int]) -> list[dict[str, Any]]:
    """``spec`` at every (BLOCK_H, BLOCK_N, warps, stages) given: the points a GPU sweep
    (``mla_decode_tuning.py``) would time, to see beforehand which can hold more programs per SM."""
    if "BLOCK_H" not in spec["constexprs"]:
        raise SystemExit(f"--sweep: {spec['name']} has no BLOCK_H (the sweep is for the attention kernels; use --only)")
    return [dict(spec, name=f"{spec['name']} {h}x{n} w{w} s{st}",
                 constexprs={**spec["constexprs"], "BLOCK_H": h, "BLOCK_N": n}, warps=w, stages=st,
                 shown={**spec["shown"], "BLOCK_H": h, "BLOCK_N": n})
            for h, n, w, st in itertools.product(block_h, block_n, warps, stages)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="append the rows as JSON lines")
    parser.add_argument("--compare", type=Path, help="rows of another tree: say which kernels' SASS differ")
    parser.add_argument("--only", help="kernels whose name contains this")
    parser.add_argument("--sweep", action="store_true",
                        help="each kernel (with --only: those named) at every --block-h × --block-n × --warps × "
                             "--stages point instead of its served launch (attention kernels)")
    parser.add_argument("--block-h", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    specs = [spec for spec in kernel_specs() if args.only is None or args.only in spec["name"]]
    if args.sweep:
        specs = [point for spec in specs for point in launch_points(spec, args.block_h, args.block_n, args.warps,
                                                                     args.stages)]
    rows = [resources(spec) for spec in specs]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out is not None:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    if args.compare is not None:
        other = {r["kernel"]: r for r in map(json.loads, args.compare.read_text().splitlines())}
        for row in rows:
            was = other.get(row["kernel"])
            verdict = "new" if was is None else "same SASS" if was["sass_sha1"] == row["sass_sha1"] else "differs"
            print(f"{row['kernel']}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
