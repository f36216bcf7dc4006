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
    # A pad row of a graphed batch: no context, output zeros (not NaN).
    lens = meta.context_lens.clone()
    lens[1] = 0
    pad = meta.__class__(**{**meta.__dict__, "context_lens": lens})
    cache = torch.randn(blocks * size, 2, 2, 16)
    out = gqa_decode(torch.randn(tokens, 6, 16), cache, pad, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()


def test_decode_kernels_equal_their_torch_twins_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_attention_kernels", "check_kernels_on_cpu")
