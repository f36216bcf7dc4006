"""Where the MLA decode kernel's time goes at many short contexts (issue #21; a diagnostic, not a served path): the
served one-pass kernel (``attention_kernels._mla_decode_kernel``) beside copies of it that each leave out one part of
the work — the queries' loads (``Q_CONST``: a constant query), the output's store (``NO_STORE``: written only under
a condition that never holds at run time), the block tables' indirection (``DIRECT``: each sequence's rows read at
a fixed contiguous place; one stage fewer, which holds the same two buffers of rows) — and with all three left out (the cached rows' stream and the arithmetic alone). The
variants compute other numbers; only their times are compared. Graph-free launches between CUDA events, median
of 5, DeepSeek-V3's shapes (128 heads, latent 512, rope 64, 16-token pages), the served launch per batch.

    PYTHONPATH=runtime python3 benchmarks/mla_latency_probe.py --batches 256 64 --context 96
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.serve import attention_kernels as ak
from vexpert_runtime.serve.attention import build_metadata
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork


@triton.jit
def _probe_kernel(q_lat, q_rope, cache, tables, token_seq, lens, out, scale,
                  stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cache, stride_tb, stride_tn,
                  stride_ob, stride_oh, rows_per_seq,
                  NH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  Q_CONST: tl.constexpr, NO_STORE: tl.constexpr, DIRECT: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, CP)
    if Q_CONST:
        ql = tl.full([BLOCK_H, CP], 0.01, dtype=tl.bfloat16)
        qr = tl.full([BLOCK_H, RP], 0.01, dtype=tl.bfloat16)
    else:
        ql, qr = ak._mla_queries(q_lat, q_rope, q_rope, q_rope, b, heads, stride_qlb, stride_qlh, stride_qrb,
                                 stride_qrh, 0, NH, C, R, CP, RP, False, False)  # (queries rotated already)
    length = tl.load(lens + b)
    table = tables + tl.load(token_seq + b) * stride_tb
    if DIRECT:  # the sequence's rows at a fixed contiguous place: no block-table load before each tile's rows
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, CP], dtype=tl.float32)
        for first in range(0, length, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            row = (b.to(tl.int64) * rows_per_seq + n) * stride_cache
            m_i, l_i, acc = ak._mla_fold(ql, qr, cache, row, n < length, scale, m_i, l_i, acc, C, R, CP, RP)
    else:  # the served loop itself
        _, l_i, acc = ak._mla_rows(ql, qr, cache, table, 0, length, scale, stride_cache, stride_tn, C, R, CP, RP, PAGE,
                                   BLOCK_H, BLOCK_N)
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = (heads < NH)[:, None] & (offs_c < C)[None, :]
    if NO_STORE:
        mask = mask & (tl.sum(l_i, 0) < -1.0)  # never at run time: l_i ≥ 0
    tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :], result.to(out.dtype.element_ty),
             mask=mask)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    heads, latent, rope, page = 128, 512, 64, 16
    rows = []
    for batch in args.batches:
        pool = BlockPool(batch * (args.context // page + 2) + 2, page)
        work = []
        for seq in range(batch):
            pool.add(seq)
            work.append(SequenceWork(seq, (1,), args.context, tuple(pool.grow(seq, args.context + 1)), SamplingSpec()))
        meta = build_metadata(work, page, [None], "cuda", padded_groups=False)
        cache = torch.randn(pool.num_blocks * page, latent + rope, device="cuda", dtype=torch.bfloat16)
        q_latent = torch.randn(batch, heads, latent, device="cuda", dtype=torch.bfloat16)
        q_rope = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q_latent)
        block_h, block_n, warps, stages = ak.mla_launch_config(batch)
        rows_per_seq = pool.num_blocks * page // batch  # DIRECT: each sequence's rows at a fixed contiguous place
        for q_const, no_store, direct in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)):
            grid = (batch, triton.cdiv(heads, block_h))
            positional = (q_latent, q_rope, cache, meta.block_tables, meta.token_seq, meta.context_lens, out,
                          (latent + rope) ** -0.5, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0),
                          q_rope.stride(1), cache.stride(0), meta.block_tables.stride(0), meta.block_tables.stride(1),
                          out.stride(0), out.stride(1), rows_per_seq)
            keywords = dict(NH=heads, C=latent, R=rope, CP=latent, RP=rope, PAGE=page, BLOCK_H=block_h,
                            BLOCK_N=block_n, Q_CONST=q_const, NO_STORE=no_store, DIRECT=direct, num_warps=warps,
                            num_stages=stages - direct)  # (the served stages hold 2 row buffers: one holds tables)
            launch = functools.partial(_probe_kernel[grid], *positional, **keywords)
            launch()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    launch()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / args.iters)
            served = ak.mla_decode(q_latent, q_rope, cache, meta, (latent + rope) ** -0.5)
            row = {"batch": batch, "context": args.context, "q_const": q_const, "no_store": no_store,
                   "direct": direct, "ms": round(statistics.median(times), 4),
                   "served_equal": bool(torch.equal(served, out)) if not (q_const or no_store or direct) else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
