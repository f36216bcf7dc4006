"""The Triton paged-attention kernels (issue #21) in Triton's interpreter, against their torch twins.

CI has no GPU: the kernels run on CPU tensors with ``TRITON_INTERPRET=1`` (set before Triton is
imported, so in a subprocess). Decodes and a prompt chunk (each token its own causal context),
sequences of different lengths, block tables that are not contiguous (and stored column by column, as
a graph's inputs hold them) and a block size that does not divide the lengths; a zero-length row (a CUDA-graph pad row) yields zeros.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_support import run_in_triton_interpreter

REPO = Path(__file__).resolve().parents[1]


def check_kernels_on_cpu() -> None:
    from vexpert_runtime.serve.attention import build_metadata, gqa_attention, mla_attention
    from vexpert_runtime.serve.attention_kernels import gqa_decode, mla_decode
    from vexpert_runtime.serve.step import SequenceWork

    torch.manual_seed(0)
    size = 4
    # Two decodes, a first token, a prompt chunk in the middle of its prompt (causal inside it).
    work = [SequenceWork(0, (1,), 5, (3, 5)), SequenceWork(1, (1,), 0, (1,)), SequenceWork(2, (1,), 40, tuple(range(6, 30, 2))),
            SequenceWork(3, (1, 2, 3, 4, 5, 6), 7, (31, 30, 2, 4))]
    meta = build_metadata(work, size, [None], "cpu")
    tokens = meta.slot_mapping.shape[0]
    blocks = 32
    # the same tables stored column by column, as a graph's inputs hold them (strides (1, B))
    by_column = meta.__class__(**{**meta.__dict__, "block_tables": meta.block_tables.t().contiguous().t()})
    assert by_column.block_tables.stride() == (1, meta.block_tables.shape[0])
    for latent, rope, heads in ((32, 16, 20), (24, 8, 3)):  # powers of two, and widths the kernel pads
        cache = torch.randn(blocks * size, latent + rope)
        q_latent, q_rope = torch.randn(tokens, heads, latent), torch.randn(tokens, heads, rope)
        want = mla_attention(q_latent, q_rope, cache, meta, 0.3)
        got = mla_decode(q_latent, q_rope, cache, meta, 0.3, block_n=16)
        assert (got - want).abs().max() < 1e-5, (latent, rope)
        assert torch.equal(mla_decode(q_latent, q_rope, cache, by_column, 0.3, block_n=16), got)
    for kv_heads, group, dim in ((2, 3, 16), (1, 4, 12)):
        cache = torch.randn(blocks * size, 2, kv_heads, dim)
        q = torch.randn(tokens, kv_heads * group, dim)
        want = gqa_attention(q, cache, meta, 0.25, None)
        got = gqa_decode(q, cache, meta, 0.25, block_n=16)
        assert (got - want).abs().max() < 1e-5, (kv_heads, group, dim)
        assert torch.equal(gqa_decode(q, cache, by_column, 0.25, block_n=16), got)
    check_split_kernels_on_cpu()
    # Sliding windows (GQA): each query sees its last `window` tokens, in one pass and in splits.
    for window in (3, 6, 64):
        windowed = build_metadata(work, size, [None, window], "cpu")
        cache = torch.randn(blocks * size, 2, 2, 16)
        q = torch.randn(tokens, 6, 16)
        want = gqa_attention(q, cache, windowed, 0.25, window)
        got = gqa_decode(q, cache, windowed, 0.25, block_n=16, window=window)
        assert (got - want).abs().max() < 1e-5, window
        assert (got - gqa_attention(q, cache, windowed, 0.25, None)).abs().max() > 1e-3 or window == 64
        split = windowed.__class__(**{**windowed.__dict__, "kv_splits": 4})
        assert (gqa_decode(q, cache, split, 0.25, block_n=2, split_rows=2, window=window) - want).abs().max() < 1e-5
    # A pad row of a graphed batch: no context, output zeros (not NaN).
    lens = meta.context_lens.clone()
    lens[1] = 0
    pad = meta.__class__(**{**meta.__dict__, "context_lens": lens})
    cache = torch.randn(blocks * size, 2, 2, 16)
    out = gqa_decode(torch.randn(tokens, 6, 16), cache, pad, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()


def check_split_kernels_on_cpu() -> None:
    """Split-KV: contexts cut into up to 2, 4 or 8 splits of at least 8 rows (16-row tiles, so the last
    splits of a 70-token context are empty) equal the one-pass kernels; a query whose context takes one
    split (9 tokens, the prompt chunk's first rows), and a pad row, are written by the split kernel itself."""
    import dataclasses

    from vexpert_runtime.serve.attention import build_metadata, gqa_attention, mla_attention
    from vexpert_runtime.serve.attention_kernels import gqa_decode, mla_decode
    from vexpert_runtime.serve.step import SequenceWork

    torch.manual_seed(1)
    size = 4
    work = [SequenceWork(0, (1,), 69, tuple(range(40, 58))), SequenceWork(1, (1,), 8, (2, 3, 4)),
            SequenceWork(2, (1,), 33, tuple(range(10, 19))), SequenceWork(3, (1, 2, 3, 4, 5, 6), 3, (31, 30, 1))]
    meta = build_metadata(work, size, [None], "cpu")
    tokens = meta.slot_mapping.shape[0]
    lens = meta.context_lens.clone()
    lens[2] = 0  # a pad row
    meta = dataclasses.replace(meta, context_lens=lens)
    blocks = 64
    latent, rope, heads = 24, 8, 5
    cache = torch.randn(blocks * size, latent + rope)
    q_latent, q_rope = torch.randn(tokens, heads, latent), torch.randn(tokens, heads, rope)
    valid = torch.arange(tokens) != 2  # the torch twins attend by the work's own lengths
    one_pass = mla_decode(q_latent, q_rope, cache, meta, 0.3, block_n=16)
    assert (one_pass - mla_attention(q_latent, q_rope, cache, meta, 0.3))[valid].abs().max() < 1e-5
    g_cache = torch.randn(blocks * size, 2, 2, 16)
    q = torch.randn(tokens, 6, 16)
    g_one_pass = gqa_decode(q, g_cache, meta, 0.25, block_n=16)
    for splits in (2, 4, 8):
        split = dataclasses.replace(meta, kv_splits=splits)
        got = mla_decode(q_latent, q_rope, cache, split, 0.3, block_n=16, block_h=2, split_rows=8)
        assert (got - one_pass).abs().max() < 1e-5, splits
        assert torch.equal(got[2], torch.zeros_like(got[2]))
        g_got = gqa_decode(q, g_cache, split, 0.25, block_n=16, split_rows=8)
        assert (g_got - g_one_pass).abs().max() < 1e-5, splits
        assert torch.equal(g_got[2], torch.zeros_like(g_got[2]))
    want = gqa_attention(q, g_cache, meta, 0.25, None)
    assert (g_one_pass[valid] - want[valid]).abs().max() < 1e-5


def test_decode_kernels_equal_their_torch_twins_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_attention_kernels", "check_kernels_on_cpu")


def test_kv_splits_only_where_few_programs_meet_a_long_context() -> None:
    """The split policy on an H200's 132 SMs: one pass for short contexts and for launches that fill
    the SMs already (256 decodes — what the measured benchmark runs); otherwise enough splits for
    about two programs per SM, no more than the context holds, a power of two, at most MAX_KV_SPLITS."""
    from vexpert_runtime.serve.attention_kernels import (
        MAX_KV_SPLITS,
        SPLIT_ROWS,
        kv_splits,
        mla_programs_per_row,
    )

    sms = 132
    assert mla_programs_per_row(256, 128) == 2 and mla_programs_per_row(16, 128) == 4
    assert kv_splits(256, 2, 163_840, sms) == 1  # 512 programs: the SMs are full
    assert kv_splits(16, 4, 2 * SPLIT_ROWS - 1, sms) == 1  # too short to split
    assert kv_splits(16, 4, 96, sms) == 1
    assert kv_splits(16, 4, 32_768, sms) == 4  # 64 programs → 264 wanted → 4.1 → 4
    assert kv_splits(1, 4, 32_768, sms) == MAX_KV_SPLITS  # 66 wanted, 128 the context holds
    assert kv_splits(1, 4, 5 * SPLIT_ROWS, sms) == 4  # the context holds 5 splits
    assert kv_splits(1, 4, 1_000_000, sms) == MAX_KV_SPLITS
    assert kv_splits(32, 4, 4096, sms) == 2  # 128 programs: 2.06 wanted
    assert kv_splits(33, 4, 4096, sms) == 1  # 132 programs fill the SMs
    for rows in (1, 2, 5, 16, 31):
        for longest in (SPLIT_ROWS, 700, 5000, 70_000):
            splits = kv_splits(rows, 4, longest, sms)
            assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_KV_SPLITS
            assert splits == 1 or splits * SPLIT_ROWS <= 2 * longest
