"""The 256-sequence decode step's heaviest kernels, each launched as the product serves it, for Nsight Compute
(issue #21: the MLA decode kernel and the expert GEMMs are the step's items furthest above their bytes' time):
``attention_kernels.mla_decode`` at DeepSeek-V3's shapes (128 heads, latent 512, rope 64, 16-token pages; context 96)
and ``grouped_gemm_kernel.triton_swiglu`` over 8 experts at H 7168 / I 2048 with its served launch table (top-2,
groups even or skewed as ``grouped_gemm_tuning.py`` makes them). Each kernel runs ``--repeat`` times (ncu's ``-s`` /
``-c`` pick which to profile); no timing here — ``benchmarks/ncu_stalls.sh`` profiles it and prints where the warps
stall, SASS line by line.

    ncu -k regex:_mla_decode_kernel -s 2 -c 1 --set full -o mla python3 benchmarks/ncu_targets.py --kernel mla
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_gemm_tuning import group_ends

from vexpert_runtime.model.grouped_gemm_kernel import triton_swiglu
from vexpert_runtime.model.grouped_moe import packed_views
from vexpert_runtime.serve import attention_kernels
from vexpert_runtime.serve.attention import build_metadata
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork


def run_mla(batch: int, context: int, repeat: int) -> None:
    heads, latent, rope, page = 128, 512, 64, 16
    pool = BlockPool(batch * (context // page + 2) + 2, page)
    work = []
    for seq in range(batch):
        pool.add(seq)
        work.append(SequenceWork(seq, (1,), context, tuple(pool.grow(seq, context + 1)), SamplingSpec()))
    meta = build_metadata(work, page, [None], "cuda", padded_groups=False)
    cache = torch.randn(pool.num_blocks * page, latent + rope, device="cuda", dtype=torch.bfloat16)
    q_latent = torch.randn(batch, heads, latent, device="cuda", dtype=torch.bfloat16)
    # as served: q_b's output unrotated, its rotary part a strided view, rotated by the kernel (DeepSeek-V3's pairs)
    q_rope = torch.randn(batch, heads, 128 + rope, device="cuda", dtype=torch.bfloat16)[..., 128:]
    angles = torch.rand(batch, rope // 2, device="cuda") * 100.0
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    for _ in range(repeat):
        attention_kernels.mla_decode(q_latent, q_rope, cache, meta, (latent + rope) ** -0.5,
                                     rope=attention_kernels.QueryRotary(cos, sin, True))
    torch.cuda.synchronize()


def run_experts(tokens: int, skewed: bool, repeat: int) -> None:
    hidden, inter, experts, top_k = 7168, 2048, 8, 2
    offs, rows = group_ends(tokens, top_k, experts, skewed)
    offs = offs.cuda()
    packed = torch.randn(experts, 3 * inter * hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w13, w2 = packed_views(packed, inter, hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(repeat):
        triton_swiglu(x, w13, w2, offs)
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=("mla", "experts"), required=True)
    parser.add_argument("--batch", type=int, default=256, help="sequences (mla) or tokens (experts)")
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--skewed", action="store_true", help="experts: the Zipf-like split")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.kernel == "mla":
        run_mla(args.batch, args.context, args.repeat)
    else:
        run_experts(args.batch, args.skewed, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
