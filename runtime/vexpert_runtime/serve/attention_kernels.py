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
* :func:`gqa_decode` — Qwen GQA: one program per (sequence, KV head) with that head's query group,
  optionally over a sliding window (the query's last ``window`` tokens).

Both equal :func:`~.attention.mla_attention` / :func:`~.attention.gqa_attention` (the torch twins,
CPU and prefill path) up to summation order; the CPU tests run them in Triton's interpreter.
Shapes: ``B`` sequences (one query token each), ``nh`` heads, ``C`` latent, ``R`` rotary, ``d`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    def _mla_tile(ql, qr, cache, table, n, nmask, scale, stride_cache, stride_tn, m_i, l_i, acc,
                  C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, PAGE: tl.constexpr):
        """One tile of cached rows ``n`` (``nmask``: those that count) folded into a head block's online softmax
        (running max m_i, denominator l_i, Σ p·c acc) — one definition for the one-pass and the split kernels, whose
        every tile holds at least one row that counts (so m_new is finite)."""
        block = tl.load(table + (n // PAGE) * stride_tn, mask=nmask, other=0).to(tl.int64)
        row = (block * PAGE + n % PAGE) * stride_cache
        return _mla_fold(ql, qr, cache, row, nmask, scale, m_i, l_i, acc, C, R, CP, RP)

    @triton.jit
    def _mla_fold(ql, qr, cache, row, nmask, scale, m_i, l_i, acc,
                  C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr):
        """:func:`_mla_tile` past the block tables: the cached rows at element offsets ``row`` folded in."""
        offs_c = tl.arange(0, CP)
        offs_r = tl.arange(0, RP)
        # (an FP8 cache's rows widened to the queries' dtype: a no-op for a cache in that dtype)
        kc = tl.load(cache + row[:, None] + offs_c[None, :], mask=nmask[:, None] & (offs_c < C)[None, :],
                     other=0.0).to(ql.dtype)
        kr = tl.load(cache + row[:, None] + C + offs_r[None, :], mask=nmask[:, None] & (offs_r < R)[None, :],
                     other=0.0).to(qr.dtype)
        s = tl.dot(ql, tl.trans(kc), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _mla_rows(ql, qr, cache, table, start, end, scale, stride_cache, stride_tn,
                  C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        """Online softmax of a head block's queries over the sequence's cached rows [start, end):
        (running max [BLOCK_H], denominator [BLOCK_H], Σ p·c [BLOCK_H, CP]) — for the one-pass and the split
        kernels."""
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, CP], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _mla_tile(ql, qr, cache, table, n, n < end, scale, stride_cache, stride_tn, m_i, l_i,
                                      acc, C, R, CP, RP, PAGE)
        return m_i, l_i, acc

    @triton.jit
    def rotary_indices(offs_r, R: tl.constexpr, INTERLEAVE: tl.constexpr):
        """For output columns ``offs_r`` of a rotary embedding over R columns
        (:func:`~.attention_layers.apply_rotary`'s two forms): (the cos / sin column, the input column it scales,
        the partner column the sine scales, whether the column is in the upper half)."""
        HALF: tl.constexpr = R // 2
        upper = offs_r >= HALF
        if INTERLEAVE:  # DeepSeek's: out[j] = x[2j]·c[j] − x[2j+1]·s[j], out[h+j] = x[2j+1]·c[j] + x[2j]·s[j]
            pair = tl.where(upper, offs_r - HALF, offs_r)
            own = tl.where(upper, 2 * pair + 1, 2 * pair)
            partner = tl.where(upper, 2 * pair, 2 * pair + 1)
        else:  # transformers' rotate_half: out[j] = x[j]·c[j] + (−x[j+h] | x[j−h])·s[j]
            pair = offs_r
            own = offs_r
            partner = tl.where(upper, offs_r - HALF, offs_r + HALF)
        return pair, own, partner, upper

    @triton.jit
    def rotated(x, other, c, s, upper):
        """The rotary embedding's outputs from their own inputs ``x``, partners ``other`` and cos / sin ``c`` / ``s``
        (the :func:`rotary_indices` columns): each product and the sum rounded to x's dtype, as the eager torch code
        computes it."""
        straight = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        turned = (other.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        signed = tl.where(upper, turned.to(tl.float32), -turned.to(tl.float32))
        return (straight.to(tl.float32) + signed).to(x.dtype)

    @triton.jit
    def _mla_queries(q_lat, q_rope, cos, sin, b, heads, stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_rope,
                     NH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr,
                     ROTATE: tl.constexpr, INTERLEAVE: tl.constexpr):
        """Token ``b``'s latent and rotary queries of ``heads`` (zeros past NH / C / R). ``ROTATE``: ``q_rope`` is
        the projection's output before the rotary embedding, applied here at the token's ``cos`` / ``sin`` rows
        (row stride ``stride_rope``) as :func:`~.attention_layers.apply_rotary` computes it — each product and the
        sum rounded to the queries' dtype — so no kernel of its own writes the rotated queries first."""
        hmask = heads < NH
        offs_c = tl.arange(0, CP)
        offs_r = tl.arange(0, RP)
        rmask = hmask[:, None] & (offs_r < R)[None, :]
        ql = tl.load(q_lat + b * stride_qlb + heads[:, None] * stride_qlh + offs_c[None, :],
                     mask=hmask[:, None] & (offs_c < C)[None, :], other=0.0)
        q_row = q_rope + b * stride_qrb + heads[:, None] * stride_qrh
        if ROTATE:
            pair, own, partner, upper = rotary_indices(offs_r, R, INTERLEAVE)
            x = tl.load(q_row + own[None, :], mask=rmask, other=0.0)
            other = tl.load(q_row + partner[None, :], mask=rmask, other=0.0)
            c = tl.load(cos + b * stride_rope + pair, mask=offs_r < R, other=0.0)
            s_ = tl.load(sin + b * stride_rope + pair, mask=offs_r < R, other=0.0)
            qr = rotated(x, other, c[None, :], s_[None, :], upper[None, :])
        else:
            qr = tl.load(q_row + offs_r[None, :], mask=rmask, other=0.0)
        return ql, qr

    @triton.jit
    def _mla_decode_kernel(q_lat, q_rope, cos, sin, cache, tables, token_seq, lens, out, scale,
                           stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_rope, stride_cache, stride_tb,
                           stride_tn, stride_ob, stride_oh,
                           NH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           ROTATE: tl.constexpr = False, INTERLEAVE: tl.constexpr = False):
        b = tl.program_id(0)
        table = tables + tl.load(token_seq + b) * stride_tb
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ql, qr = _mla_queries(q_lat, q_rope, cos, sin, b, heads, stride_qlb, stride_qlh, stride_qrb, stride_qrh,
                              stride_rope, NH, C, R, CP, RP, ROTATE, INTERLEAVE)
        length = tl.load(lens + b)
        _, l_i, acc = _mla_rows(ql, qr, cache, table, 0, length, scale, stride_cache, stride_tn, C, R, CP, RP, PAGE,
                                BLOCK_H, BLOCK_N)
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        offs_c = tl.arange(0, CP)
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
                 result.to(out.dtype.element_ty), mask=(heads < NH)[:, None] & (offs_c < C)[None, :])

    @triton.jit
    def _split_range(length, split, max_splits, SPLIT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(splits this query's context takes, its rows [start, end) in split ``split``): one split per
        SPLIT_ROWS rows, at most ``max_splits``, each a whole number of BLOCK_N-row tiles (the last
        splits may be empty: their end ≤ start)."""
        splits = tl.minimum(tl.maximum((length + SPLIT_ROWS - 1) // SPLIT_ROWS, 1), max_splits)
        chunk = ((length + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = split * chunk
        return splits, start, tl.minimum(length, start + chunk)

    @triton.jit
    def _store_split(m_i, l_i, acc, splits, out_ptrs, part_ptrs, lse_ptrs, mask, head_mask):
        """A split's end, as both split kernels write it: the output itself where the query's context
        took one split, else the normalised partial output and its log-sum-exp (−∞ for an empty split)."""
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if splits == 1:
            tl.store(out_ptrs, result.to(out_ptrs.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptrs, result, mask=mask)
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptrs, lse, mask=head_mask)

    # max_splits is a runtime argument, not specialised: one compile serves every split count (a
    # graph per count is captured on first use while serving; a compile then would stall the rank)
    @triton.jit(do_not_specialize=["max_splits"])
    def _mla_decode_split_kernel(q_lat, q_rope, cos, sin, cache, tables, token_seq, lens, out, part, part_lse, scale,
                                 stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_rope, stride_cache, stride_tb,
                                 stride_tn, stride_ob, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
                                 max_splits, NH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr,
                                 RP: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                                 SPLIT_ROWS: tl.constexpr, ROTATE: tl.constexpr = False,
                                 INTERLEAVE: tl.constexpr = False):
        """Split ``program_id(2)`` of a query's context (split-KV, as FlashDecoding and SGLang's
        ``decode_attention`` stage 1): a query whose context takes one split writes its output here;
        the others write their normalised partial output and log-sum-exp for :func:`_merge_splits_kernel`."""
        b = tl.program_id(0)
        split = tl.program_id(2)
        length = tl.load(lens + b)
        splits, start, end = _split_range(length, split, max_splits, SPLIT_ROWS, BLOCK_N)
        if split < splits:
            table = tables + tl.load(token_seq + b) * stride_tb
            heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            ql, qr = _mla_queries(q_lat, q_rope, cos, sin, b, heads, stride_qlb, stride_qlh, stride_qrb, stride_qrh,
                                  stride_rope, NH, C, R, CP, RP, ROTATE, INTERLEAVE)
            m_i, l_i, acc = _mla_rows(ql, qr, cache, table, start, end, scale, stride_cache, stride_tn, C, R, CP, RP,
                                      PAGE, BLOCK_H, BLOCK_N)
            offs_c = tl.arange(0, CP)
            _store_split(m_i, l_i, acc, splits, out + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
                         part + b * stride_pb + split * stride_ps + heads[:, None] * stride_ph + offs_c[None, :],
                         part_lse + b * stride_lb + split * stride_ls + heads,
                         (heads < NH)[:, None] & (offs_c < C)[None, :], heads < NH)

    @triton.jit(do_not_specialize=["max_splits"])
    def _merge_splits_kernel(part, part_lse, lens, out,
                             stride_pb, stride_ps, stride_ph, stride_lb, stride_ls, stride_ob, stride_oh, max_splits,
                             NH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr, SPLIT_ROWS: tl.constexpr, WINDOW: tl.constexpr = 0):
        """out[b, heads] = Σ_s e^(lse_s − M)·o_s / Σ_s e^(lse_s − M) over query ``b``'s splits (a query of
        one split was written by the split kernel itself); empty splits carry lse −∞ and weigh 0."""
        b = tl.program_id(0)
        length = tl.load(lens + b)
        if WINDOW > 0:
            length = tl.minimum(length, WINDOW)
        splits, _, _ = _split_range(length, 0, max_splits, SPLIT_ROWS, BLOCK_N)
        if splits > 1:
            heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            hmask = heads < NH
            offs_d = tl.arange(0, DP)
            mask = hmask[:, None] & (offs_d < D)[None, :]
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            den = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, DP], dtype=tl.float32)
            for split in range(0, splits):
                lse = tl.load(part_lse + b * stride_lb + split * stride_ls + heads, mask=hmask, other=float("-inf"))
                m_new = tl.maximum(m_i, lse)
                m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # no −∞ − (−∞) for an empty split
                alpha = tl.exp(m_i - m_safe)
                weight = tl.exp(lse - m_safe)
                o = tl.load(part + b * stride_pb + split * stride_ps + heads[:, None] * stride_ph + offs_d[None, :],
                            mask=mask, other=0.0)
                acc = acc * alpha[:, None] + weight[:, None] * o
                den = den * alpha + weight
                m_i = m_new
            result = acc / tl.where(den > 0, den, 1.0)[:, None]
            tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     result.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _gqa_rows(qq, cache, table, kv_head, start, end, scale, stride_cache, stride_kv, stride_head, stride_tn,
                  D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr):
        """:func:`_mla_rows` for one KV head's query group over rows [start, end)."""
        offs_d = tl.arange(0, DP)
        dmask = offs_d < D
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, DP], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            nmask = n < end
            block = tl.load(table + (n // PAGE) * stride_tn, mask=nmask, other=0).to(tl.int64)
            row = (block * PAGE + n % PAGE) * stride_cache + kv_head * stride_head
            mask2 = nmask[:, None] & dmask[None, :]
            k = tl.load(cache + row[:, None] + offs_d[None, :], mask=mask2, other=0.0).to(qq.dtype)  # (FP8: widened)
            v = tl.load(cache + row[:, None] + stride_kv + offs_d[None, :], mask=mask2, other=0.0).to(qq.dtype)
            s = tl.dot(qq, tl.trans(k), input_precision="ieee")
            s = tl.where(nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _gqa_queries(q, b, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     BLOCK_G: tl.constexpr):
        """Token ``b``'s queries of KV head ``kv_head``'s group [BLOCK_G, DP] (zeros past GROUP / D), their
        heads, columns, mask and row mask."""
        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUP
        heads = kv_head * GROUP + g
        offs_d = tl.arange(0, DP)
        mask = gmask[:, None] & (offs_d < D)[None, :]
        qq = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)
        return qq, heads, offs_d, mask, gmask

    @triton.jit
    def _gqa_decode_kernel(q, cache, tables, token_seq, lens, out, scale,
                           stride_qb, stride_qh, stride_cache, stride_kv, stride_head, stride_tb, stride_tn,
                           stride_ob, stride_oh,
                           GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = 0):
        b = tl.program_id(0)
        table = tables + tl.load(token_seq + b) * stride_tb
        kv_head = tl.program_id(1)
        qq, heads, offs_d, mask, _ = _gqa_queries(q, b, kv_head, stride_qb, stride_qh, GROUP, D, DP, BLOCK_G)
        length = tl.load(lens + b)
        first = 0
        if WINDOW > 0:  # a sliding window: the query at position p sees keys p − WINDOW + 1 .. p
            first = tl.maximum(length - WINDOW, 0)
        _, l_i, acc = _gqa_rows(qq, cache, table, kv_head, first, length, scale, stride_cache, stride_kv, stride_head,
                                stride_tn, D, DP, PAGE, BLOCK_G, BLOCK_N)
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 result.to(out.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["max_splits"])
    def _gqa_decode_split_kernel(q, cache, tables, token_seq, lens, out, part, part_lse, scale,
                                 stride_qb, stride_qh, stride_cache, stride_kv, stride_head, stride_tb, stride_tn,
                                 stride_ob, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls, max_splits,
                                 GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
                                 BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                                 WINDOW: tl.constexpr = 0):
        """:func:`_mla_decode_split_kernel` for GQA: split ``program_id(2)`` of one KV head's group
        (of the window's rows, with a sliding window)."""
        b = tl.program_id(0)
        split = tl.program_id(2)
        length = tl.load(lens + b)
        first = 0
        if WINDOW > 0:
            first = tl.maximum(length - WINDOW, 0)
        splits, start, end = _split_range(length - first, split, max_splits, SPLIT_ROWS, BLOCK_N)
        start += first
        end += first
        if split < splits:
            table = tables + tl.load(token_seq + b) * stride_tb
            kv_head = tl.program_id(1)
            qq, heads, offs_d, mask, gmask = _gqa_queries(q, b, kv_head, stride_qb, stride_qh, GROUP, D, DP, BLOCK_G)
            m_i, l_i, acc = _gqa_rows(qq, cache, table, kv_head, start, end, scale, stride_cache, stride_kv,
                                      stride_head, stride_tn, D, DP, PAGE, BLOCK_G, BLOCK_N)
            _store_split(m_i, l_i, acc, splits, out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         part + b * stride_pb + split * stride_ps + heads[:, None] * stride_ph + offs_d[None, :],
                         part_lse + b * stride_lb + split * stride_ls + heads, mask, gmask)


@dataclass(frozen=True)
class QueryRotary:
    """The rotary embedding :func:`mla_decode` applies to its rotary queries as it loads them: ``cos`` / ``sin``
    [T, R] (a row per query token, the step's), DeepSeek's ``interleave`` pairing or transformers' halves
    (:func:`~.attention_layers.apply_rotary`'s two forms)."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleave: bool


def mla_launch_config(tokens: int) -> tuple[int, int, int, int]:
    """(head block, context block, warps, stages) of :func:`mla_decode`'s one-pass kernel for ``tokens``
    queries: from a sweep on an H200 at DeepSeek-V3's shapes, context 96 (``benchmarks/mla_decode_tuning.py``,
    ``results/serve_engine/mla_decode_tuning_run12.json``): (32, 64, 8, 3) took 0.028 / 0.030 ms at 16 / 64
    sequences against 0.043 / 0.045 for the first choice (16, 32, 4, 2); at 256, (64, 64, 8, 3) took
    0.084 ms against 0.135 (more heads per program: each cached row read by fewer programs)."""
    return (64, 64, 8, 3) if tokens >= 128 else (32, 64, 8, 3)


def mla_split_launch_config(tokens: int) -> tuple[int, int, int, int]:
    """:func:`mla_launch_config` of the split-KV kernel (long contexts, few queries): 64-head blocks, so
    half as many programs read each cached row as with 32. An H200 at a 32,768-token context
    (``results/serve_engine/mla_decode_tuning_run21_splits.json``, at the splits :func:`mla_kv_splits`
    picks): 1 / 4 / 16 sequences 0.116 / 0.215 / 0.734 ms per layer against 0.149 / 0.348 / 1.260 with
    the one-pass kernel's (32, 64, 8, 3); 2 stages at 1 sequence (0.116 vs 0.132), 3 from 4 (0.215 vs 0.222)."""
    return (64, 64, 8, 2 if tokens < 4 else 3)


# Split-KV (FlashDecoding): a one-pass launch runs one program per (query, head block); a few queries
# over long contexts leave most SMs idle while each program walks its whole context (a 32k-token
# DeepSeek-V3 context at one sequence: 4 programs on an H200's 132 SMs). Then the context is cut into
# splits of at least SPLIT_ROWS rows, each a program, merged by their log-sum-exp.
SPLIT_ROWS = 256  # a split's least rows: its partial output and log-sum-exp must be worth writing
MAX_KV_SPLITS = 64


def kv_splits(rows: int, programs_per_row: int, longest: int, sm_count: int, *,
              split_programs_per_row: int | None = None, programs_per_sm: int = 2) -> int:
    """The most splits a decode launch of ``rows`` queries may cut a context into (a power of two;
    1: the one-pass kernel). Split only where the one-pass grid (``rows · programs_per_row``
    programs) leaves SMs idle and the longest context (``longest`` tokens) takes at least two
    splits; then enough splits for about ``programs_per_sm`` programs of the split kernel (``rows ·
    split_programs_per_row`` per split; default: as the one pass) per SM. A query's own context decides
    how many of them it uses (:func:`_split_range`): short ones stay one pass in any launch.

    A host-side, shape-level choice — rows is a graph bucket's size, ``longest`` comes from the
    block tables' width — so a graph per (bucket, splits) holds it (:mod:`.cuda_graphs`)."""
    programs = rows * programs_per_row
    if programs >= sm_count or longest < 2 * SPLIT_ROWS:
        return 1
    per_split = rows * (programs_per_row if split_programs_per_row is None else split_programs_per_row)
    want = min(-(-programs_per_sm * sm_count // per_split), -(-longest // SPLIT_ROWS), MAX_KV_SPLITS)
    return 1 << (want.bit_length() - 1)


def mla_programs_per_row(rows: int, heads: int) -> int:
    """Head blocks :func:`mla_decode`'s one-pass kernel launches per query at ``rows`` queries."""
    return -(-heads // mla_launch_config(rows)[0])


def mla_kv_splits(rows: int, heads: int, longest: int, sm_count: int) -> int:
    """:func:`kv_splits` of :func:`mla_decode`: split where the one-pass grid leaves SMs idle, into about
    one split-kernel program per SM — its 64-head blocks hold one program per SM (216 KB of shared
    memory, ``kernel_resources.py``), and one per SM was the fastest measured: at 1 / 4 / 16 sequences
    of 32,768 tokens, 64 / 16 / 4 splits (``mla_decode_tuning_run21_splits.json``).

    And at least 2 splits once the context is long (``longest`` ≥ 2 · :data:`SPLIT_ROWS`) where the
    one-pass grid's head blocks are smaller than the split kernel's (fewer than 128 rows: 32 heads):
    there the cached rows are the kernel's work, and 64-head blocks read each row half as often. An
    H100 (``mla_decode_{long,4k}_bf16_run24_h100.json``): 64 sequences of 32,768 tokens 2.81 ms per layer in 2
    splits against 5.11 in one 32-head pass; of 4,096 tokens 0.394 against 0.656 — while at 96 tokens
    the 32-head pass stays the faster (0.030 against 0.044 ms on an H200, run 12)."""
    splits = kv_splits(rows, mla_programs_per_row(rows, heads), longest, sm_count,
                       split_programs_per_row=-(-heads // mla_split_launch_config(rows)[0]), programs_per_sm=1)
    if splits == 1 and longest >= 2 * SPLIT_ROWS and mla_launch_config(rows)[0] < mla_split_launch_config(rows)[0]:
        return 2
    return splits


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, split_rows: int | None = None,
               rope: QueryRotary | None = None) -> torch.Tensor:
    """q_latent [T, nh, C], q_rope [T, nh, R] (any tokens: decodes or prompt chunks, each with its
    own context, see :class:`~.attention.AttentionMetadata`; any token and head strides) over a latent cache
    [slots, C + R] → Σ p·c [T, nh, C]. With ``rope`` q_rope is the query projection's rotary part before its rotary
    embedding, which the kernel applies as it loads it (:class:`QueryRotary`). Launch parameters left None come from :func:`mla_launch_config` (T is a
    graph bucket's size where graphs run: a shape-only choice); ``meta.kv_splits`` > 1 cuts long
    contexts into splits of at least ``split_rows`` rows (None: :data:`SPLIT_ROWS`, as :func:`kv_splits`),
    launched as :func:`mla_split_launch_config` says.

    (A persistent variant — a few programs per SM, each walking its (query, head block) items as one pipelined loop
    over their context tiles — was 8 % slower than this one-pass grid at 256 sequences of 96 tokens on an H100: it
    fits only 32-head blocks, so each cached row is read by four programs, not two; it lived up to commit b7c8ba4,
    ``results/serve_engine/mla_decode_persistent_run30_h100.json``. Two programs per (query, head block), each keeping
    half of the latent output — half the float32 accumulator, two programs per SM, every score computed twice — took
    0.0915 against 0.0879 ms at 256 sequences and 0.0294 against 0.0284 at 64, each at its best launch, on an H100;
    up to commit c89c364, ``mla_decode_halves_run33_h100.json``. Nsight Compute has this kernel latency-bound at 256
    sequences: 36 % of DRAM bandwidth, 8 warps an SM, a third of the warps' samples waiting on global loads and on
    the score GEMM, ``results/ncu/``.)"""
    batch, heads, latent = q_latent.shape
    splits = meta.kv_splits
    tuned = mla_launch_config(batch) if splits == 1 else mla_split_launch_config(batch)
    block_h = tuned[0] if block_h is None else block_h
    block_n = tuned[1] if block_n is None else block_n
    num_warps = tuned[2] if num_warps is None else num_warps
    num_stages = tuned[3] if num_stages is None else num_stages
    width = q_rope.shape[2]
    out = torch.empty_like(q_latent)
    page = meta.block_size
    head_blocks = triton.cdiv(heads, block_h)
    shapes: dict[str, int | bool] = dict(NH=heads, C=latent, R=width, CP=_pow2(latent), RP=_pow2(width), PAGE=page,
                                         BLOCK_H=block_h, BLOCK_N=block_n)
    if q_rope.stride(2) != 1:
        raise ValueError(f"mla_decode wants q_rope with unit stride along its last dim, got strides {q_rope.stride()}")
    if rope is not None:
        if rope.cos.shape != (batch, width) or rope.sin.shape != rope.cos.shape or width % 2 \
                or rope.cos.stride() != rope.sin.stride() or rope.cos.stride(1) != 1:
            raise ValueError(f"QueryRotary wants cos and sin [{batch}, {width}] (an even width) alike with unit column "
                             f"stride, got {list(rope.cos.shape)} {rope.cos.stride()} and {list(rope.sin.shape)} "
                             f"{rope.sin.stride()}")
        shapes.update(ROTATE=True, INTERLEAVE=rope.interleave)
        cos, sin, stride_rope = rope.cos, rope.sin, rope.cos.stride(0)
    else:
        cos, sin, stride_rope = q_rope, q_rope, 0  # never read
    strides = (q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), stride_rope, cache.stride(0),
               meta.block_tables.stride(0), meta.block_tables.stride(1), out.stride(0), out.stride(1))
    if splits == 1:
        _mla_decode_kernel[(batch, head_blocks)](
            q_latent, q_rope, cos, sin, cache, meta.block_tables, meta.token_seq, meta.context_lens, out, scale,
            *strides, **shapes, num_warps=num_warps, num_stages=num_stages,
        )
        return out
    split_rows = SPLIT_ROWS if split_rows is None else split_rows
    part, part_lse = _split_buffers(batch, splits, heads, latent, q_latent.device)
    _mla_decode_split_kernel[(batch, head_blocks, splits)](
        q_latent, q_rope, cos, sin, cache, meta.block_tables, meta.token_seq, meta.context_lens, out, part, part_lse,
        scale,
        *strides, *part.stride()[:3], *part_lse.stride()[:2], splits, **shapes, SPLIT_ROWS=split_rows,
        num_warps=num_warps, num_stages=num_stages,
    )
    _merge_splits(part, part_lse, meta.context_lens, out, block_n, split_rows)
    return out


def gqa_decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               block_n: int = 32, split_rows: int | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, nh, d] (per-token contexts as in :func:`mla_decode`) over a GQA cache [slots, 2, nkv, d]
    → [T, nh, d]; ``meta.kv_splits`` as in :func:`mla_decode`; ``window``: a sliding window (each query
    attends its last ``window`` tokens; None: its whole context)."""
    batch, heads, dim = q.shape
    kv_heads = cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    page = meta.block_size
    shapes = dict(GROUP=group, D=dim, DP=_pow2(dim), PAGE=page, BLOCK_G=_pow2(group), BLOCK_N=block_n)
    if window is not None:  # a constexpr: no window compiles the kernel as it was
        if window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")
        shapes["WINDOW"] = window
    strides = (q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
               meta.block_tables.stride(0), meta.block_tables.stride(1), out.stride(0), out.stride(1))
    splits = meta.kv_splits
    if splits == 1:
        _gqa_decode_kernel[(batch, kv_heads)](
            q, cache, meta.block_tables, meta.token_seq, meta.context_lens, out, scale, *strides, **shapes,
            num_warps=4, num_stages=2,
        )
        return out
    split_rows = SPLIT_ROWS if split_rows is None else split_rows
    part, part_lse = _split_buffers(batch, splits, heads, dim, q.device)
    _gqa_decode_split_kernel[(batch, kv_heads, splits)](
        q, cache, meta.block_tables, meta.token_seq, meta.context_lens, out, part, part_lse, scale, *strides,
        *part.stride()[:3], *part_lse.stride()[:2], splits, **shapes, SPLIT_ROWS=split_rows,
        num_warps=4, num_stages=2,
    )
    _merge_splits(part, part_lse, meta.context_lens, out, block_n, split_rows, window)
    return out


def _split_buffers(batch: int, splits: int, heads: int, dim: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [T, splits, nh, d] and their log-sum-exps [T, splits, nh], fp32 (inside a CUDA
    graph: from its memory pool, like every other intermediate)."""
    part = torch.empty((batch, splits, heads, dim), dtype=torch.float32, device=device)
    return part, torch.empty((batch, splits, heads), dtype=torch.float32, device=device)


_MERGE_BLOCK_H = 16


def _merge_splits(part: torch.Tensor, part_lse: torch.Tensor, lens: torch.Tensor, out: torch.Tensor,
                  block_n: int, split_rows: int, window: int | None = None) -> None:
    batch, splits, heads, dim = part.shape
    extra = {} if window is None else {"WINDOW": window}
    _merge_splits_kernel[(batch, triton.cdiv(heads, _MERGE_BLOCK_H))](
        part, part_lse, lens, out, *part.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), splits,
        NH=heads, D=dim, DP=_pow2(dim), BLOCK_H=_MERGE_BLOCK_H, BLOCK_N=block_n, SPLIT_ROWS=split_rows,
        num_warps=4, num_stages=1, **extra,
    )
