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
    check_query_rotary_on_cpu(meta, blocks * size, tokens)
    check_mla_cache_rows_on_cpu()
    check_gqa_cache_rows_on_cpu()
    check_split_kernels_on_cpu()
    check_fp8_caches_on_cpu(work, size, blocks, tokens)
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


def check_query_rotary_on_cpu(meta: object, slots: int, tokens: int) -> None:
    """The MLA kernels rotate the rotary queries themselves (``rope=QueryRotary``): fed the projection's rotary part
    as it comes — a strided view of the [T, nh, dn + R] query — they equal the kernel fed the queries rotated by
    ``apply_rotary`` first, both of its forms (DeepSeek's interleaved pairs, transformers' halves), one pass and
    in splits; cos / sin of another width are refused."""
    import dataclasses

    from vexpert_runtime.serve.attention_kernels import QueryRotary, mla_decode
    from vexpert_runtime.serve.attention_layers import apply_rotary

    torch.manual_seed(3)
    latent, rope, heads, nope = 32, 16, 5, 24
    cache = torch.randn(slots, latent + rope)
    q_latent = torch.randn(tokens, heads, latent)
    q = torch.randn(tokens, heads, nope + rope)
    raw = q[..., nope:]  # strided: the projection's rotary part, not copied
    angles = torch.rand(tokens, rope // 2) * 6.0
    for interleave in (True, False):
        doubled = torch.cat([angles, angles], dim=-1)
        cos, sin = doubled.cos(), doubled.sin()
        rotated = apply_rotary(raw, cos, sin, interleave)
        want = mla_decode(q_latent, rotated.contiguous(), cache, meta, 0.3, block_n=16)
        got = mla_decode(q_latent, raw, cache, meta, 0.3, block_n=16, rope=QueryRotary(cos, sin, interleave))
        assert (got - want).abs().max() < 1e-5, interleave
        assert (got - mla_decode(q_latent, raw.contiguous(), cache, meta, 0.3, block_n=16)).abs().max() > 1e-3
        split = dataclasses.replace(meta, kv_splits=4)
        got = mla_decode(q_latent, raw, cache, split, 0.3, block_n=2, split_rows=2, rope=QueryRotary(cos, sin, interleave))
        assert (got - want).abs().max() < 1e-5, interleave
    with pytest.raises(ValueError, match="QueryRotary wants cos and sin"):
        mla_decode(q_latent, raw, cache, meta, 0.3, rope=QueryRotary(cos[:, :8], sin[:, :8], False))


def check_mla_cache_rows_on_cpu() -> None:
    """The MLA layer's inputs between its projections in one kernel (:func:`mla_queries_by_kernel`): against the torch
    code the compiled step runs otherwise (:func:`inputs_written` over :func:`mla_inputs_unrotated`) on a transformers
    DeepSeek-V3 attention module with q_a and kv_a fused — powers of two and widths the kernel pads, both rotary
    forms, tokens written to scattered slots — the same queries and the same cache rows (to float32 rounding: the
    norms' sums run in another order), every other slot untouched; a pad row's scratch slot written by several rows."""
    import transformers

    import test_serve_model as serve_model
    from vexpert_runtime.serve.attention_input_kernels import mla_cache_rows, mla_cache_rows_runs
    from vexpert_runtime.serve.attention_layers import (
        inputs_written,
        mla_inputs_unrotated,
        mla_queries_by_kernel,
    )
    from vexpert_runtime.serve.fused_projections import fuse_model_projections

    tokens, slots_total = 7, 40
    # powers of two with DeepSeek's interleaved rotary form, padded widths with transformers' halves
    for widths, interleave in (({}, True), ({"q_lora_rank": 24, "kv_lora_rank": 20, "qk_rope_head_dim": 6}, False)):
        torch.manual_seed(11)
        config = serve_model._config("deepseek_v3")
        for key, value in {**widths, "rope_interleave": interleave}.items():
            setattr(config, key, value)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        fuse_model_projections(model)
        attn = model.model.layers[0].self_attn
        for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):  # weights that matter
            norm.weight.data.normal_(1.0, 0.3)
        rope = int(config.qk_rope_head_dim)
        x = torch.randn(tokens, int(config.hidden_size))
        angles = torch.rand(tokens, rope // 2) * 6.0
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        slots = torch.tensor([5, 17, 0, 33, 8, 0, 21])  # two rows on slot 0: a graph's pad rows
        want_cache = torch.randn(slots_total, int(config.kv_lora_rank) + rope)
        got_cache = want_cache.clone()
        assert mla_cache_rows_runs(attn, x, got_cache)
        with torch.no_grad():
            want = inputs_written(mla_inputs_unrotated, attn, x, cos, sin, want_cache, slots)
            got = mla_queries_by_kernel(attn, x, cos, sin, got_cache, slots)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and (g - w).abs().max() < 1e-4, (widths, interleave)
        assert (got_cache - want_cache).abs().max() < 1e-5, (widths, interleave)
        untouched = torch.ones(slots_total, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(got_cache[untouched], want_cache[untouched])
    assert not mla_cache_rows_runs(attn, x, got_cache.to(torch.float8_e4m3fn))  # an FP8 cache: the torch code
    with pytest.raises(ValueError, match="mla_cache_rows wants cos and sin"):
        mla_cache_rows(attn, attn.fused_a_proj(x), cos[:, :2], sin[:, :2], got_cache, slots)


def check_gqa_cache_rows_on_cpu() -> None:
    """A GQA layer's inputs after its fused q / k / v GEMM in one kernel (:func:`gqa_cache_rows`): against the torch code
    the compiled step runs otherwise (:func:`inputs_written` over :func:`gqa_inputs`) on transformers' Qwen3-MoE
    (per-head norms, at head counts and widths the kernel pads) and Qwen2-MoE (biases, no norms, powers of two)
    attention modules — the same queries and cache rows (to float32 rounding), every other slot untouched."""
    import transformers

    import test_serve_model as serve_model
    from vexpert_runtime.serve.attention_input_kernels import gqa_cache_rows, gqa_cache_rows_runs
    from vexpert_runtime.serve.attention_layers import gqa_inputs, inputs_written
    from vexpert_runtime.serve.fused_projections import fuse_model_projections

    tokens, slots_total = 6, 30
    # Qwen3's norms at widths the kernel pads; Qwen2's biases at powers of two
    for family, widths in (("qwen3_moe", {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 12}),
                           ("qwen2_moe", {})):
        torch.manual_seed(13)
        config = serve_model._config(family)
        for key, value in widths.items():
            setattr(config, key, value)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        fuse_model_projections(model)
        attn = model.model.layers[0].self_attn
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None:
                norm.weight.data.normal_(1.0, 0.3)
        head_dim, kv_heads = int(attn.head_dim), int(config.num_key_value_heads)
        x = torch.randn(tokens, int(config.hidden_size))
        angles = torch.rand(tokens, head_dim // 2) * 6.0
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        slots = torch.tensor([4, 0, 19, 0, 7, 28])
        want_cache = torch.randn(slots_total, 2, kv_heads, head_dim)
        got_cache = want_cache.clone()
        assert gqa_cache_rows_runs(attn, x, got_cache), family
        with torch.no_grad():
            (want,) = inputs_written(gqa_inputs, attn, x, cos, sin, want_cache, slots)
            got = gqa_cache_rows(attn, attn.fused_qkv_proj(x), cos, sin, got_cache, slots)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4, (family, widths)
        assert (got_cache - want_cache).abs().max() < 1e-4, (family, widths)
        untouched = torch.ones(slots_total, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(got_cache[untouched], want_cache[untouched])
    with pytest.raises(ValueError, match="gqa_cache_rows wants a cache"):
        gqa_cache_rows(attn, attn.fused_qkv_proj(x), cos, sin, got_cache[:, :1], slots)


def check_fp8_caches_on_cpu(work: list, size: int, blocks: int, tokens: int) -> None:
    """An FP8 cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``), written by :func:`write_rows`: both kernels — one pass
    and in splits — widen its rows as their torch twins do (the same result, to float32 rounding: the rows reach ±20), and that result is the one over the
    cache's values widened beforehand (what FP8 costs is the rows' rounding, nothing else)."""
    import dataclasses

    from vexpert_runtime.serve.attention import build_metadata, gqa_attention, mla_attention
    from vexpert_runtime.serve.attention_kernels import gqa_decode, mla_decode
    from vexpert_runtime.serve.kv_cache import write_rows

    meta = build_metadata(work, size, [None], "cpu")
    split = dataclasses.replace(meta, kv_splits=4)
    slots = torch.arange(blocks * size)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.empty(blocks * size, 48, dtype=dtype)
        write_rows(cache, slots, torch.randn(blocks * size, 48) * 3)
        q_latent, q_rope = torch.randn(tokens, 5, 32), torch.randn(tokens, 5, 16)
        want = mla_attention(q_latent, q_rope, cache, meta, 0.3)
        assert (want - mla_attention(q_latent, q_rope, cache.float(), meta, 0.3)).abs().max() < 1e-6
        assert (mla_decode(q_latent, q_rope, cache, meta, 0.3, block_n=16) - want).abs().max() < 1e-4, dtype
        assert (mla_decode(q_latent, q_rope, cache, split, 0.3, block_n=2, split_rows=2) - want).abs().max() < 1e-4
        cache = torch.empty(blocks * size, 2, 2, 16, dtype=dtype)
        write_rows(cache, slots, torch.randn(blocks * size, 2, 2, 16))
        q = torch.randn(tokens, 6, 16)
        want = gqa_attention(q, cache, meta, 0.25, None)
        assert (want - gqa_attention(q, cache.float(), meta, 0.25, None)).abs().max() < 1e-6
        assert (gqa_decode(q, cache, meta, 0.25, block_n=16) - want).abs().max() < 1e-4, dtype
        assert (gqa_decode(q, cache, split, 0.25, block_n=2, split_rows=2) - want).abs().max() < 1e-4


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


def check_model_with_kernels_on_cpu() -> None:
    """The GPU path's eager step on CPU: ``HFStepModel`` attending with the Triton kernels (in the
    interpreter, as a GPU rank would with them) and the split policy of a 132-SM GPU — with splits of
    32 rows instead of 256, so that a 72-token prompt splits as long contexts do — beside a short
    prompt: DeepSeek-V3 (MLA) and Qwen3-MoE with a 40-token sliding window, their routers fused and their attention
    inputs through the input kernels (:mod:`~vexpert_runtime.serve.attention_input_kernels`), give
    generate's greedy tokens, and some launches split their contexts."""
    import tempfile

    import transformers

    import test_serve_model as serve_model
    from vexpert_runtime.serve import attention_kernels
    from vexpert_runtime.serve.fused_router import fuse_model_routers
    from vexpert_runtime.serve.hf_model import HFStepModel

    attention_kernels.SPLIT_ROWS = 32  # read by the policy and the kernels' launches at call time
    prompts = [[(7 * i + 3) % 120 + 1 for i in range(72)], [(5 * i + 2) % 120 + 1 for i in range(30)]]
    new_tokens, joins = (3, 2), (0, 2)
    # two layers (DeepSeek-V3: one dense, one MoE): a second layer's cache offsets are what a third would add, and
    # each layer costs ~10 s in the interpreter
    for family, extra in (("deepseek_v3", {"num_hidden_layers": 2}),
                          ("qwen3_moe", {"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 40})):
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(5)
            config = serve_model._config(family)
            for key, value in extra.items():
                setattr(config, key, value)
            path = Path(tmp) / family
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
            expected, _ = serve_model._reference(path, prompts, new_tokens)
            model = HFStepModel(path, dtype=torch.float32, kv_cache_tokens=512)
            # the routers fused, as the constructor does on a CUDA device
            assert fuse_model_routers(model.model) == len(model.moe_layers)
            kernel = attention_kernels.mla_decode if model.layout.mla else attention_kernels.gqa_decode
            splits: list[int] = []
            meta_at = 3 if model.layout.mla else 2  # (q_latent, q_rope, cache, meta) / (q, cache, meta)

            def recording(*args: object, _kernel: object = kernel, _at: int = meta_at, _seen: list[int] = splits,
                          **kwargs: object) -> torch.Tensor:
                _seen.append(args[_at].kv_splits)  # type: ignore[attr-defined]
                return _kernel(*args, **kwargs)  # type: ignore[operator]

            # what the constructor picks on a CUDA device with Triton (test_serve_gpu.py runs it there)
            model._attention_kernel = recording
            model._sm_count = 132
            assert serve_model.drive(model, prompts, new_tokens, joins, 16) == expected, family
            assert max(splits) > 1 and min(splits) == 1, (family, sorted(set(splits)))


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


def test_mla_splits_aim_at_one_program_per_sm_of_the_split_kernel() -> None:
    """MLA's policy: whether to split is the one-pass grid's question (32-head blocks below 128 rows,
    64 from 128); how many splits, the split kernel's — 64-head blocks, one program per SM (what an
    H200 ran fastest at 1 / 4 / 16 sequences of 32,768 tokens: 64 / 16 / 4 splits)."""
    from vexpert_runtime.serve.attention_kernels import (
        MAX_KV_SPLITS,
        SPLIT_ROWS,
        kv_splits,
        mla_kv_splits,
        mla_launch_config,
        mla_split_launch_config,
    )

    sms = 132
    assert [mla_kv_splits(rows, 128, 32_768, sms) for rows in (1, 4, 16)] == [MAX_KV_SPLITS, 16, 4]
    assert mla_kv_splits(2, 128, 32_768, sms) == 32  # 4 split programs → 33 wanted
    assert mla_kv_splits(32, 128, 32_768, sms) == 2  # one pass: 128 programs < 132; split: 64 per split
    # one pass: 132 programs fill the SMs — but with 32-head blocks, each cached row read by 4 programs: a long
    # context goes to the split kernel's 64-head blocks (2 splits); a short one stays one pass
    assert mla_kv_splits(33, 128, 32_768, sms) == mla_kv_splits(64, 128, 2 * SPLIT_ROWS, sms) == 2
    assert mla_kv_splits(64, 128, 2 * SPLIT_ROWS - 1, sms) == mla_kv_splits(127, 128, 96, sms) == 1
    assert mla_kv_splits(256, 128, 163_840, sms) == mla_kv_splits(128, 128, 4096, sms) == 1  # 64-head one pass
    assert mla_kv_splits(16, 128, 2 * SPLIT_ROWS - 1, sms) == 1
    # the split kernel's programs per SM, not the one pass's, decide the count: at 2 per SM with the
    # one-pass grid's 32-head blocks, 16 rows would take as many splits — but 8 at 2 per SM of 64-head blocks
    assert kv_splits(16, 4, 32_768, sms, split_programs_per_row=2) == 8
    assert mla_split_launch_config(16)[0] == 64 and mla_launch_config(16)[0] == 32
    assert mla_split_launch_config(1)[3] == 2 and mla_split_launch_config(4)[3] == 3


def test_the_eager_gpu_step_with_its_kernels_matches_generate_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_attention_kernels", "check_model_with_kernels_on_cpu")
