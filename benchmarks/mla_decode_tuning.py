"""The MLA decode kernel's launch parameters on a GPU: ``attention_kernels.mla_decode`` (the product's kernel,
what the graphed decode step runs for DeepSeek-V3) swept over head block, context block, warps and
stages at DeepSeek-V3's shapes (128 heads, latent 512, rope 64, 16-token pages; the rotary queries unrotated, a strided
view that the kernel rotates, as served since run 33), for several batches at one context; each configuration checked
against the torch twin (``attention.mla_attention``) and timed
over ``--iters`` launches between CUDA events (median of 5 repeats). Prints one JSON row per
configuration and the best per batch.

    PYTHONPATH=runtime python3 benchmarks/mla_decode_tuning.py --batches 16 64 256 --context 96

``--warps`` widens the sweep (16 warps: 128 registers a thread, see ``kernel_resources.py``); ``--kv-splits``
sweeps split-KV at long contexts (each configuration also at these split counts; 1: one pass):

    PYTHONPATH=runtime python3 benchmarks/mla_decode_tuning.py --batches 1 4 16 --context 32768 \
        --block-h 32 --block-n 64 --warps 8 --stages 3 --kv-splits 1 4 16 64

``--kv-cache-dtype fp8``: the cache in FP8 e4m3 (as ``vexpert serve --kv-cache-dtype fp8`` keeps it). Each row
also prints ``kv_tb_per_s``, the cache's bytes (each row once) ÷ the kernel's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.serve import attention_kernels
from vexpert_runtime.serve.attention import build_metadata, mla_attention
from vexpert_runtime.serve.attention_layers import apply_rotary
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--latent", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--block-h", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--kv-splits", type=int, nargs="+", default=[1])
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the cache's dtype: the queries' (auto) or FP8 e4m3, as --kv-cache-dtype fp8 keeps it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    rows = []
    for batch in args.batches:
        pool = BlockPool(batch * (args.context // args.page + 2) + 2, args.page)
        work = []
        for seq in range(batch):
            pool.add(seq)
            work.append(SequenceWork(seq, (1,), args.context, tuple(pool.grow(seq, args.context + 1)), SamplingSpec()))
        meta = build_metadata(work, args.page, [None], device, dtype=dtype)
        kernel_meta = build_metadata(work, args.page, [None], device, padded_groups=False)
        cache = torch.randn(pool.num_blocks * args.page, args.latent + args.rope, device=device, dtype=dtype)
        if args.kv_cache_dtype == "fp8":
            cache = cache.to(torch.float8_e4m3fn)
        q_latent = torch.randn(batch, args.heads, args.latent, device=device, dtype=dtype)
        # as the served step passes them: q_b's output unrotated (its rotary part a strided view of [T, nh, 128 + R]),
        # the kernel applying DeepSeek-V3's interleaved rotary embedding as it loads it; the twin gets them rotated
        raw = torch.randn(batch, args.heads, 128 + args.rope, device=device, dtype=dtype)[..., 128:]
        angles = torch.rand(batch, args.rope // 2, device=device) * 100.0
        cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        rope = attention_kernels.QueryRotary(cos, sin, True)
        q_rope = apply_rotary(raw, cos, sin, True)
        scale = (args.latent + args.rope) ** -0.5
        if batch * args.context <= 1 << 16:
            want = mla_attention(q_latent, q_rope, cache, meta, scale).float()
        else:  # the twin pads every query to the longest context: at 16 × 32,768 tokens that is 144 GiB at once
            want = torch.cat([mla_attention(q_latent[row:row + 1], q_rope[row:row + 1], cache,
                                            build_metadata(work[row:row + 1], args.page, [None], device, dtype=dtype),
                                            scale).float() for row in range(batch)])
        kv_bytes = batch * (args.context + 1) * cache.stride(0) * cache.element_size()  # each cached row read once
        best = None
        for block_h, block_n, warps, stages, splits in itertools.product(args.block_h, args.block_n, args.warps,
                                                                         args.stages, args.kv_splits):
            split_meta = dataclasses.replace(kernel_meta, kv_splits=splits)
            launch = dict(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                got = attention_kernels.mla_decode(q_latent, raw, cache, split_meta, scale, rope=rope, **launch)
                torch.cuda.synchronize()
            except Exception as exc:  # a configuration Triton cannot build (shared memory)
                rows.append({"batch": batch, "block_h": block_h, "block_n": block_n, "warps": warps,
                             "stages": stages, "kv_splits": splits, "error": str(exc)[:120]})
                continue
            error = (got.float() - want).abs().max().item()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    attention_kernels.mla_decode(q_latent, raw, cache, split_meta, scale, rope=rope, **launch)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / args.iters)
            row = {"batch": batch, "context": args.context, "block_h": block_h, "block_n": block_n, "warps": warps,
                   "stages": stages, "kv_splits": splits, "kv_cache_dtype": args.kv_cache_dtype,
                   "ms": round(statistics.median(times), 4), "max_abs_error": round(error, 4),
                   "kv_tb_per_s": round(kv_bytes / (statistics.median(times) * 1e9), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if error < 0.05 and (best is None or row["ms"] < best["ms"]):
                best = row
        print("best", json.dumps(best), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
