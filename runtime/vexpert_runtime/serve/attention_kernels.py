"""Triton decode attention over the paged KV cache: one launch per layer for all of a rank's sequences.

Decode iterations (every sequence feeds one token) are the serving engine's hot path and run inside
the decode step's CUDA graph, so their attention must read each sequence's own context length and
block table from device tensors — no padding to the longest sequence, no host sync. Measured on one
H200 (benchmarks/README.md, issue #21): one padded SDPA call for 256 sequences takes 318–322 µs per
DeepSeek-V3 layer and FlexAttention does not compile for MLA's shapes as called; FlashInfer's MLA
kernels come in a 62 MB wheel, more than travels to our GPU hosts. So: two small kernels of our own
in the style of SGLang's Triton decode kernels (``srt/layers/attention/triton_ops``), online softmax
over the sequence's blocks, one program per (sequence, head block):

* :func:`mla_decode` — DeepSeek-V3 MLA in latent space: a block of query heads against the one
  latent "head" (scores = q_c·c + q_pe·k_pe, output Σ p·c), reading each cached row once per head block;
* :func:`gqa_decode` — Qwen GQA: one program per (sequence, KV head) with that head's query group.

Both equal :func:`~.attention.mla_attention` / :func:`~.attention.gqa_attention` (the torch twins,
CPU and prefill path) up to summation order; the CPU tests run them in Triton's interpreter.
Shapes: ``B`` sequences (one query token each), ``nh`` heads, ``C`` latent, ``R`` rotary, ``d`` head dim.
"""

from __future__ import annotations

import torch

from vexpert_runtime.serve.attention import AttentionMetadata

try:  # CUDA builds of torch ship Triton; CPU-only installs may not (the torch path serves there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def available() -> bool:
    """Whether the kernels can run (Triton is importable)."""
    return triton is not None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _mla_decode_kernel(q_lat, q_rope, cache, tables, token_seq, lens, out, scale,
                           stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cache, stride_tb, stride_tn,
                           stride_ob, stride_oh,
                           NH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        table = tables + tl.load(token_seq + b) * stride_tb
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < NH
        offs_c = tl.arange(0, CP)
        offs_r = tl.arange(0, RP)
        cmask = offs_c < C
        rmask = offs_r < R
        ql = tl.load(q_lat + b * stride_qlb + heads[:, None] * stride_qlh + offs_c[None, :],
                     mask=hmask[:, None] & cmask[None, :], other=0.0)
        qr = tl.load(q_rope + b * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :],
                     mask=hmask[:, None] & rmask[None, :], other=0.0)
        length = tl.load(lens + b)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, CP], dtype=tl.float32)
        for start in range(0, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < length
            block = tl.load(table + (n // PAGE) * stride_tn, mask=nmask, other=0).to(tl.int64)
            row = (block * PAGE + n % PAGE) * stride_cache
            kc = tl.load(cache + row[:, None] + offs_c[None, :], mask=nmask[:, None] & cmask[None, :], other=0.0)
            kr = tl.load(cache + row[:, None] + C + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
            s = tl.dot(ql, tl.trans(kc), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
            s = tl.where(nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc, input_precision="ieee")
            m_i = m_new
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
                 result.to(out.dtype.element_ty), mask=hmask[:, None] & cmask[None, :])

    @triton.jit
    def _gqa_decode_kernel(q, cache, tables, token_seq, lens, out, scale,
                           stride_qb, stride_qh, stride_cache, stride_kv, stride_head, stride_tb, stride_tn,
                           stride_ob, stride_oh,
                           GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        table = tables + tl.load(token_seq + b) * stride_tb
        kv_head = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUP
        heads = kv_head * GROUP + g
        offs_d = tl.arange(0, DP)
        dmask = offs_d < D
        qq = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                     mask=gmask[:, None] & dmask[None, :], other=0.0)
        length = tl.load(lens + b)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, DP], dtype=tl.float32)
        for start in range(0, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < length
            block = tl.load(table + (n // PAGE) * stride_tn, mask=nmask, other=0).to(tl.int64)
            row = (block * PAGE + n % PAGE) * stride_cache + kv_head * stride_head
            mask2 = nmask[:, None] & dmask[None, :]
            k = tl.load(cache + row[:, None] + offs_d[None, :], mask=mask2, other=0.0)
            v = tl.load(cache + row[:, None] + stride_kv + offs_d[None, :], mask=mask2, other=0.0)
            s = tl.dot(qq, tl.trans(k), input_precision="ieee")
            s = tl.where(nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 result.to(out.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def mla_launch_config(tokens: int) -> tuple[int, int, int, int]:
    """(head block, context block, warps, stages) of :func:`mla_decode` for ``tokens`` queries: from a
    sweep on an H200 at DeepSeek-V3's shapes, context 96 (``benchmarks/mla_decode_tuning.py``,
    ``results/serve_engine/mla_decode_tuning_run12.json``): (32, 64, 8, 3) took 0.028 / 0.030 ms at 16 / 64
    sequences against 0.043 / 0.045 for the first choice (16, 32, 4, 2); at 256, (64, 64, 8, 3) took
    0.084 ms against 0.135 (more heads per program: each cached row read by fewer programs)."""
    return (64, 64, 8, 3) if tokens >= 128 else (32, 64, 8, 3)


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> torch.Tensor:
    """q_latent [T, nh, C], q_rope [T, nh, R] (any tokens: decodes or prompt chunks, each with its
    own context, see :class:`~.attention.AttentionMetadata`) over a latent cache [slots, C + R]
    → Σ p·c [T, nh, C]. Launch parameters left None come from :func:`mla_launch_config` (T is a
    graph bucket's size where graphs run: a shape-only choice)."""
    batch, heads, latent = q_latent.shape
    tuned = mla_launch_config(batch)
    block_h = tuned[0] if block_h is None else block_h
    block_n = tuned[1] if block_n is None else block_n
    num_warps = tuned[2] if num_warps is None else num_warps
    num_stages = tuned[3] if num_stages is None else num_stages
    rope = q_rope.shape[2]
    out = torch.empty_like(q_latent)
    page = meta.block_size
    grid = (batch, triton.cdiv(heads, block_h))
    _mla_decode_kernel[grid](
        q_latent, q_rope, cache, meta.block_tables, meta.token_seq, meta.context_lens, out, scale,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
        meta.block_tables.stride(0), meta.block_tables.stride(1), out.stride(0), out.stride(1),
        NH=heads, C=latent, R=rope, CP=_pow2(latent), RP=_pow2(rope), PAGE=page, BLOCK_H=block_h,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def gqa_decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               block_n: int = 32) -> torch.Tensor:
    """q [T, nh, d] (per-token contexts as in :func:`mla_decode`) over a GQA cache [slots, 2, nkv, d]
    → [T, nh, d]."""
    batch, heads, dim = q.shape
    kv_heads = cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    page = meta.block_size
    _gqa_decode_kernel[(batch, kv_heads)](
        q, cache, meta.block_tables, meta.token_seq, meta.context_lens, out, scale,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), meta.block_tables.stride(0),
        meta.block_tables.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, D=dim, DP=_pow2(dim), PAGE=page, BLOCK_G=_pow2(group), BLOCK_N=block_n,
        num_warps=4, num_stages=2,
    )
    return out
