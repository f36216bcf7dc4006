"""What the product's Triton attention kernels cost an H200's SMs, without an H200: each kernel compiled
for sm_90 (Triton's own compiler and ``ptxas``, both in the Triton wheel; no GPU needed) at the launch
configurations ``vexpert serve`` uses, with the registers per thread, the bytes spilled to local memory
(``ptxas``' stack frame), the shared memory, the programs one SM can hold by registers and by shared
memory (H200: 64 K registers, 228 KB shared per SM) and a hash of the SASS without addresses, so two
trees can be compared instruction for instruction (``--compare OTHER.jsonl``).

Shapes: DeepSeek-V3's MLA (128 heads, latent 512, rope 64) and Qwen3-30B-A3B's GQA (32 query heads,
4 KV heads, head dim 128), 16-token pages, bf16 cache, int64 tables.

    python benchmarks/kernel_resources.py --out benchmarks/results/kernel_resources_sm90.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
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

_MLA_POINTERS = [("q_lat", "*bf16"), ("q_rope", "*bf16"), ("cache", "*bf16"), ("tables", "*i64"),
                 ("token_seq", "*i64"), ("lens", "*i64"), ("out", "*bf16")]
_MLA_STRIDES = ["stride_qlb", "stride_qlh", "stride_qrb", "stride_qrh", "stride_cache", "stride_tb", "stride_tn",
                "stride_ob", "stride_oh"]
_GQA_POINTERS = [("q", "*bf16"), ("cache", "*bf16"), ("tables", "*i64"), ("token_seq", "*i64"), ("lens", "*i64"),
                 ("out", "*bf16")]
_GQA_STRIDES = ["stride_qb", "stride_qh", "stride_cache", "stride_kv", "stride_head", "stride_tb", "stride_tn",
                "stride_ob", "stride_oh"]
_PART = [("part", "*fp32"), ("part_lse", "*fp32")]
_PART_STRIDES = ["stride_pb", "stride_ps", "stride_ph", "stride_lb", "stride_ls"]
_SPLIT_ARGS = [*_PART_STRIDES, "max_splits"]


def _signature(pointers: list[tuple[str, str]], scalars: list[str], constexprs: dict[str, int],
               scale: bool = True) -> dict[str, str]:
    sig = dict(pointers)
    if scale:
        sig["scale"] = "fp32"
    sig.update({name: "i32" for name in scalars})
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def kernel_specs() -> list[dict[str, Any]]:
    """(name, kernel, signature, constexprs, warps, stages) of every launch configuration served."""
    specs = []
    mla = dict(NH=128, C=512, R=64, CP=512, RP=64, PAGE=16)
    for rows in (256, 16):
        block_h, block_n, warps, stages = ak.mla_launch_config(rows)
        shapes = {**mla, "BLOCK_H": block_h, "BLOCK_N": block_n}
        specs.append(dict(name="mla_decode rows>=128" if rows >= 128 else "mla_decode rows<128",
                          fn=ak._mla_decode_kernel, constexprs=shapes, warps=warps, stages=stages,
                          signature=_signature(_MLA_POINTERS, _MLA_STRIDES, shapes)))
    block_h, block_n, warps, stages = ak.mla_launch_config(16)  # splits run where few rows leave SMs idle
    split = {**mla, "BLOCK_H": block_h, "BLOCK_N": block_n, "SPLIT_ROWS": ak.SPLIT_ROWS}
    specs.append(dict(name="mla_decode_split rows<128", fn=ak._mla_decode_split_kernel, constexprs=split,
                      warps=warps, stages=stages,
                      signature=_signature(_MLA_POINTERS + _PART, _MLA_STRIDES + _SPLIT_ARGS, split)))
    gqa = dict(GROUP=8, D=128, DP=128, PAGE=16, BLOCK_G=ak._pow2(8), BLOCK_N=32, WINDOW=0)  # as gqa_decode launches it
    specs.append(dict(name="gqa_decode", fn=ak._gqa_decode_kernel, constexprs=gqa, warps=4, stages=2,
                      signature=_signature(_GQA_POINTERS, _GQA_STRIDES, gqa)))
    gsplit = {**gqa, "SPLIT_ROWS": ak.SPLIT_ROWS}
    specs.append(dict(name="gqa_decode_split", fn=ak._gqa_decode_split_kernel, constexprs=gsplit, warps=4, stages=2,
                      signature=_signature(_GQA_POINTERS + _PART, _GQA_STRIDES + _SPLIT_ARGS, gsplit)))
    windowed = {**gqa, "WINDOW": 4096}  # Mixtral-style sliding-window layers
    specs.append(dict(name="gqa_decode window", fn=ak._gqa_decode_kernel, constexprs=windowed, warps=4, stages=2,
                      signature=_signature(_GQA_POINTERS, _GQA_STRIDES, windowed)))
    for dim, label in ((512, "mla"), (128, "gqa")):
        merge = dict(NH=128 if label == "mla" else 32, D=dim, DP=dim, BLOCK_H=ak._MERGE_BLOCK_H, BLOCK_N=64,
                     SPLIT_ROWS=ak.SPLIT_ROWS, WINDOW=0)
        specs.append(dict(name=f"merge_splits {label}", fn=ak._merge_splits_kernel, constexprs=merge, warps=4,
                          stages=1, signature=_signature(
                              [("part", "*fp32"), ("part_lse", "*fp32"), ("lens", "*i64"), ("out", "*bf16")],
                              [*_PART_STRIDES, "stride_ob", "stride_oh", "max_splits"], merge, scale=False)))
    return specs


def resources(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile one spec for sm_90 and read its resources from the cubin."""
    compiled = triton.compile(ASTSource(fn=spec["fn"], signature=spec["signature"], constexprs=spec["constexprs"]),
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
            "constexprs": spec["constexprs"], "registers": registers, "spill_bytes": stack, "shared_bytes": shared,
            "programs_per_sm_by_registers": REGISTERS_PER_SM // (registers * threads),
            "programs_per_sm_by_shared": SHARED_PER_SM // max(shared, 1),
            "sass_instructions": len(instructions),
            "sass_sha1": hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:12],
            "triton": triton.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="append the rows as JSON lines")
    parser.add_argument("--compare", type=Path, help="rows of another tree: say which kernels' SASS differ")
    parser.add_argument("--only", help="kernels whose name contains this")
    args = parser.parse_args()
    rows = [resources(spec) for spec in kernel_specs() if args.only is None or args.only in spec["name"]]
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
