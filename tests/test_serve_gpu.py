"""The serving engine on a GPU (issue #21): decode attention kernels and graphed decode steps.

GPU only (marker ``gpu``; skipped without CUDA or Triton). The CPU twins of the same pieces are tested
in test_serve_model.py (batched paged attention == transformers' generate) and
test_attention_kernels.py (the Triton kernels in Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from serve_support import IdText, id_text_tokens  # noqa: E402
from test_serve_model import CHUNK, JOINS, NEW_TOKENS, PROMPTS, _write, drive  # noqa: E402
from vexpert_runtime.serve.attention import build_metadata, gqa_attention, mla_attention  # noqa: E402
from vexpert_runtime.serve.attention_kernels import (  # noqa: E402
    gqa_decode,
    kv_splits,
    mla_decode,
    mla_kv_splits,
)
from vexpert_runtime.serve.hf_model import HFStepModel  # noqa: E402
from vexpert_runtime.serve.moe_executors import EPExperts  # noqa: E402
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork  # noqa: E402

T = TypeVar("T")


def _decode_batch(lengths: list[int], block_size: int) -> list[SequenceWork]:
    """One decode token per sequence at position len−1, blocks scattered over the pool."""
    work, next_block = [], 1
    for seq, length in enumerate(lengths):
        blocks = -(-length // block_size)
        table = tuple(range(next_block, next_block + 2 * blocks, 2))  # every other block: not contiguous
        next_block += 2 * blocks
        work.append(SequenceWork(seq, (1,), length - 1, table))
    return work


@pytest.mark.parametrize("batch", [1, 16, 64, 256])
def test_mla_decode_kernel_matches_the_torch_twin_at_deepseek_shapes(batch: int) -> None:
    torch.manual_seed(batch)
    lengths = torch.randint(1, 300, (batch,)).tolist()
    work = _decode_batch(lengths, 16)
    meta = build_metadata(work, 16, [None], "cuda")
    slots = (max(max(w.blocks) for w in work) + 1) * 16
    cache = torch.randn(slots, 512 + 64, device="cuda", dtype=torch.bfloat16)
    q_latent = torch.randn(batch, 128, 512, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, 128, 64, device="cuda", dtype=torch.bfloat16)
    want = mla_attention(q_latent.float(), q_rope.float(), cache.float(), meta, 0.1)
    got = mla_decode(q_latent, q_rope, cache, meta, 0.1).float()
    assert (got - want).abs().max() < 3e-2 * want.abs().max()
    # the served form: q_b's output unrotated ([T, nh, 128 + 64], its rotary part a strided view), the kernel applying
    # DeepSeek-V3's interleaved rotary embedding as it loads it — the same bf16 roundings as apply_rotary, so the same
    # queries; the output to a bf16 rounding (the score GEMM takes its rotary operand from registers, not shared
    # memory, and may sum in another order)
    from vexpert_runtime.serve.attention_kernels import QueryRotary
    from vexpert_runtime.serve.attention_layers import apply_rotary

    raw = torch.randn(batch, 128, 128 + 64, device="cuda", dtype=torch.bfloat16)[..., 128:]
    angles = torch.rand(batch, 32, device="cuda") * 100.0
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    rotated = apply_rotary(raw, cos, sin, True).contiguous()
    by_kernel = mla_decode(q_latent, raw, cache, meta, 0.1, rope=QueryRotary(cos, sin, True)).float()
    pre_rotated = mla_decode(q_latent, rotated, cache, meta, 0.1).float()
    gap = (by_kernel - pre_rotated).abs().max().item()
    assert gap <= 2 ** -7 * pre_rotated.abs().max().item(), gap  # (a second float32 twin: 21 GB more at 256)


@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_mla_cache_rows_kernel_matches_the_torch_code_at_deepseek_shapes(tokens: int) -> None:
    """The MLA layer's norms, rotary key and cache write in one kernel (:func:`mla_queries_by_kernel`) against the
    code it replaces (:func:`inputs_written` over :func:`mla_inputs_unrotated`, eager: the roundings of transformers'
    formulas), on a bf16 DeepSeek-V3 attention module at its real sizes (hidden 7168, q_lora 1536, latent 512, rope 64, 128 heads):
    the rotary key bit for bit (the same bf16 roundings), the normed latent and the queries to a bf16 rounding or two
    (the norms' float32 sums run in another order); the other slots untouched."""
    from vexpert_runtime.serve.attention_layers import (
        inputs_written,
        mla_inputs_unrotated,
        mla_queries_by_kernel,
    )
    from vexpert_runtime.serve.fused_projections import fuse_model_projections

    torch.manual_seed(tokens)
    config = transformers.DeepseekV3Config(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                           v_head_dim=128, num_hidden_layers=1, first_k_dense_replace=1,
                                           intermediate_size=64, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    fuse_model_projections(model)
    attn = model.model.layers[0].self_attn
    for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
        norm.weight.data.normal_(1.0, 0.3)
    x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(tokens, 32, device="cuda") * 100.0
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    slots = torch.randperm(4 * tokens, device="cuda")[:tokens]
    want_cache = torch.randn(4 * tokens, 576, device="cuda", dtype=torch.bfloat16)
    got_cache = want_cache.clone()
    with torch.inference_mode():
        want = inputs_written(mla_inputs_unrotated, attn, x, cos, sin, want_cache, slots)
        got = mla_queries_by_kernel(attn, x, cos, sin, got_cache, slots)
    assert torch.equal(got_cache[slots, 512:], want_cache[slots, 512:])
    assert ((got_cache[slots, :512].float() - want_cache[slots, :512].float()).abs()
            <= 2 ** -6 * want_cache[slots, :512].float().abs() + 1e-6).all()
    for g, w in zip(got, want, strict=True):
        assert (g.float() - w.float()).abs().max() < 2e-2 * w.float().abs().max()
    untouched = torch.ones(4 * tokens, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(got_cache[untouched], want_cache[untouched])


@pytest.mark.parametrize(("family", "tokens"), [("qwen3_moe", 1), ("qwen3_moe", 256), ("qwen2_moe", 37)])
def test_gqa_cache_rows_kernel_matches_the_torch_code_at_qwen_shapes(family: str, tokens: int) -> None:
    """A GQA layer's norms, rotary embedding and cache write in one kernel (:func:`gqa_cache_rows`) against the code it
    replaces (:func:`inputs_written` over :func:`gqa_inputs`, eager) on a bf16 attention module at Qwen3-30B-A3B's
    sizes (hidden 2048, 32 query heads, 4 KV heads, head dim 128; Qwen2-MoE at Qwen1.5-MoE-A2.7B's: 16 heads of 128,
    its biases, no norms): the values bit for bit, queries and keys to a bf16 rounding or two (the norms' float32 sums
    run in another order); other slots untouched."""
    from vexpert_runtime.serve.attention_input_kernels import gqa_cache_rows
    from vexpert_runtime.serve.attention_layers import gqa_inputs, inputs_written
    from vexpert_runtime.serve.fused_projections import fuse_model_projections

    torch.manual_seed(tokens)
    sizes = dict(hidden_size=2048, num_hidden_layers=1, vocab_size=64, intermediate_size=64, moe_intermediate_size=64,
                 num_experts=2, num_experts_per_tok=1)
    config = (transformers.Qwen3MoeConfig(head_dim=128, num_attention_heads=32, num_key_value_heads=4, **sizes)
              if family == "qwen3_moe" else
              transformers.Qwen2MoeConfig(num_attention_heads=16, num_key_value_heads=16,
                                          shared_expert_intermediate_size=64, **sizes))
    kv_heads = int(config.num_key_value_heads)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    fuse_model_projections(model)
    attn = model.model.layers[0].self_attn
    for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
        if norm is not None:
            norm.weight.data.normal_(1.0, 0.3)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(tokens, 64, device="cuda") * 100.0
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    slots = torch.randperm(4 * tokens, device="cuda")[:tokens]
    assert int(attn.head_dim) == 128
    want_cache = torch.randn(4 * tokens, 2, kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    got_cache = want_cache.clone()
    with torch.inference_mode():
        (want,) = inputs_written(gqa_inputs, attn, x, cos, sin, want_cache, slots)
        got = gqa_cache_rows(attn, attn.fused_qkv_proj(x), cos, sin, got_cache, slots)
    assert torch.equal(got_cache[slots, 1], want_cache[slots, 1])
    for g, w in ((got, want), (got_cache[slots, 0], want_cache[slots, 0])):
        assert (g.float() - w.float()).abs().max() <= 2 ** -5 * w.float().abs().max()
    untouched = torch.ones(4 * tokens, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(got_cache[untouched], want_cache[untouched])


def test_gqa_decode_kernel_matches_the_torch_twin() -> None:
    torch.manual_seed(0)
    lengths = torch.randint(1, 200, (32,)).tolist()
    work = _decode_batch(lengths, 16)
    meta = build_metadata(work, 16, [None], "cuda")
    slots = (max(max(w.blocks) for w in work) + 1) * 16
    cache = torch.randn(slots, 2, 4, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
    want = gqa_attention(q.float(), cache.float(), meta, 0.088, None)
    got = gqa_decode(q, cache, meta, 0.088).float()
    assert (got - want).abs().max() < 3e-2 * want.abs().max()
    windowed = build_metadata(work, 16, [None, 64], "cuda")  # a sliding window of 64 tokens
    want = gqa_attention(q.float(), cache.float(), windowed, 0.088, 64)
    got = gqa_decode(q, cache, windowed, 0.088, window=64).float()
    assert (got - want).abs().max() < 3e-2 * want.abs().max()


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_split_decode_kernels_match_the_torch_twins_at_long_contexts(batch: int) -> None:
    """Split-KV at DeepSeek-V3's MLA and Qwen3-30B-A3B's GQA shapes: a few long contexts (and one short,
    which stays one pass inside a split launch) against the torch twins, with the splits the product's
    policy picks for this GPU (64 sequences: MLA in 2 splits for its 64-head blocks, GQA's grid full in one pass)."""
    import dataclasses

    torch.manual_seed(batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lengths = [*torch.randint(3000, 9000, (batch - 1,)).tolist(), 37] if batch > 1 else [8191]
    work = _decode_batch(lengths, 16)
    meta = build_metadata(work, 16, [None], "cuda")
    slots = (max(max(w.blocks) for w in work) + 1) * 16
    splits = mla_kv_splits(batch, 128, max(lengths), sms)
    assert splits > 1
    cache = torch.randn(slots, 512 + 64, device="cuda", dtype=torch.bfloat16)
    q_latent = torch.randn(batch, 128, 512, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, 128, 64, device="cuda", dtype=torch.bfloat16)
    # the twins a query at a time: they pad every query to the longest context (16 × 9,000 tokens: 39 GiB at once)
    rows = [build_metadata(work[row:row + 1], 16, [None], "cuda") for row in range(batch)]
    wide = cache.float()
    want = torch.cat([mla_attention(q_latent[row:row + 1].float(), q_rope[row:row + 1].float(), wide, rows[row], 0.1)
                      for row in range(batch)])
    got = mla_decode(q_latent, q_rope, cache, dataclasses.replace(meta, kv_splits=splits), 0.1).float()
    assert (got - want).abs().max() < 3e-2 * want.abs().max()
    gqa_splits = kv_splits(batch, 4, max(lengths), sms)
    assert gqa_splits > 1 or batch * 4 >= sms
    g_cache = torch.randn(slots, 2, 4, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    wide = g_cache.float()
    want = torch.cat([gqa_attention(q[row:row + 1].float(), wide, rows[row], 0.088, None) for row in range(batch)])
    got = gqa_decode(q, g_cache, dataclasses.replace(meta, kv_splits=gqa_splits), 0.088).float()
    assert (got - want).abs().max() < 3e-2 * want.abs().max()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_graphed_long_contexts_split_and_equal_the_eager_step(family: str, tmp_path: Path) -> None:
    """Two sequences with 700-token prompts in 32-token chunks (a 2,048-token context): their steps replay
    graphs captured with split contexts, and the tokens equal the eager step's (which splits the same way)."""
    import json

    path = _write(family, tmp_path / family)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    prompts = [[(7 * i + 3) % 120 + 1 for i in range(700)], [(11 * i + 5) % 120 + 1 for i in range(690)]]
    # ≤ 64 tokens a step: the EP layer's capacity
    eager, graphed, model = _eager_and_graphed(path, lambda m: drive(m, prompts, (8, 6), (0, 2), 32), 2048)
    assert model.graphs is not None
    assert any(key.splits > 1 for key in model.graphs.graphs), sorted(model.graphs.graphs)
    assert eager == graphed


def test_graphed_sliding_window_model_equals_the_eager_step(tmp_path: Path) -> None:
    """A Qwen2-MoE with 4-token sliding windows on two of its three layers now takes the kernels and
    CUDA graphs (it could not capture them before): graphed tokens equal the eager step's."""
    import json

    path = _write("qwen2_moe", tmp_path / "qwen2_moe")
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    (path / "config.json").write_text(json.dumps(config))
    eager, graphed, _ = _eager_and_graphed(path, lambda m: (m.windows, drive(m, PROMPTS, NEW_TOKENS, JOINS, CHUNK)))
    assert eager[0] == graphed[0] == [4, None, 4]
    assert eager == graphed


@pytest.mark.parametrize(("family", "fused"), [("deepseek_v3", False), ("qwen3_moe", False), ("qwen2_moe", False),
                                               ("deepseek_v3", True), ("qwen3_moe", True)])
def test_graphed_decode_equals_the_eager_step(family: str, fused: bool, tmp_path: Path) -> None:
    """bf16 on the GPU, the EP layer on one rank (grouped GEMMs, no host sync): the tokens of a
    continuous batch (joins, chunked prompts, leaves) are the same with CUDA graphs as eager — also
    with the step's small pieces compiled by inductor into the graphs (``fused``) — and every
    iteration replayed a graph."""
    path = _write(family, tmp_path / family)
    eager, graphed, model = _eager_and_graphed(path, lambda m: drive(m, PROMPTS, NEW_TOKENS, JOINS, CHUNK), fused=fused)
    assert model.graphs is not None and model.graphs.replays >= 10  # prompt chunks and decodes
    assert eager == graphed


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_graphed_decode_over_an_fp8_kv_cache_equals_the_eager_step(family: str, tmp_path: Path) -> None:
    """``--kv-cache-dtype fp8``: the Triton kernels (graphed, compiled) widen the FP8 rows as the eager step's torch
    path does for its prompt chunks and the kernels for its decodes — the same tokens; the cache is FP8, half the
    bf16 cache's bytes."""
    path = _write(family, tmp_path / family)
    eager, graphed, model = _eager_and_graphed(path, lambda m: drive(m, PROMPTS, NEW_TOKENS, JOINS, CHUNK), fused=True,
                                               kv_cache_dtype="fp8")
    assert model.kv_cache is not None and model.kv_cache.layers[0].dtype == torch.float8_e4m3fn
    assert model.graphs is not None and model.graphs.replays >= 10
    assert eager == graphed


@pytest.mark.parametrize(("compute", "fp8_linears"), [("w8a16", False), ("w8a8", False), ("w8a16", True),
                                                      ("w8a8", True)])
def test_a_block_fp8_checkpoint_graphed_equals_the_eager_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               compute: str, fp8_linears: bool) -> None:
    """DeepSeek-V3's own format (every projection block-FP8), loaded as a serving rank loads it: its experts stay
    FP8 rows that the grouped GEMM reads in place (never dequantised), graphed == eager; W8A8 too (32-wide blocks:
    FP8 dots want K tiles of 32 or more); and with the other linears kept FP8 (``--linear-format fp8_block``),
    compiled pieces and graphs calling their op."""
    from serve_support import block_fp8_copies
    from vexpert_runtime.model.expert_format import ExpertFormat
    from vexpert_runtime.serve.moe_executors import checkpoint_reader

    block = (32, 32) if compute == "w8a8" else (16, 16)
    fp8, _ = block_fp8_copies(_write("deepseek_v3", tmp_path / "deepseek_v3"), tmp_path, block)
    monkeypatch.setattr(ExpertFormat, "stack_weights", lambda *_: pytest.fail("FP8 rows were dequantised"))
    results = []
    for graphs in (False, True):
        reader = checkpoint_reader(fp8, "auto", compute)
        assert reader.spec.fp8_activations == (compute == "w8a8")
        executor = EPExperts.from_checkpoint(reader, reader.spec.num_layers, torch.bfloat16, 0, 1, None, "cuda",
                                             max_tokens=64)
        assert executor.resident[0].dtype == torch.uint8  # type: ignore[union-attr]
        model = HFStepModel(fp8, device="cuda", dtype=torch.bfloat16, kv_cache_tokens=512, load_experts=False,
                            executor=executor, fp8_linears=fp8_linears, fp8_activations=compute == "w8a8")
        assert any(type(m).__name__ == "Fp8Linear" for m in model.model.modules()) == fp8_linears
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            if graphs:
                if fp8_linears:  # the compiled pieces call the FP8 linears' op (opaque to dynamo)
                    assert model.compile_pieces() > 0
                model.enable_cuda_graphs(64, 8, stream)
            results.append(drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK))
    assert model.graphs is not None and model.graphs.replays >= 10
    assert results[0] == results[1]


@pytest.mark.parametrize("batch", [16, 256])
def test_mla_decode_kernel_over_an_fp8_cache_matches_the_torch_twin(batch: int) -> None:
    """DeepSeek-V3's shapes (128 heads, 512 + 64 latent), bf16 queries over an FP8 (e4m3) cache written by
    :func:`write_rows`: the kernel's widened rows give the twin's result."""
    from vexpert_runtime.serve.kv_cache import write_rows

    torch.manual_seed(batch)
    work = _decode_batch([96 + i % 40 for i in range(batch)], 16)
    meta = build_metadata(work, 16, [None], "cuda")
    slots = (max(max(w.blocks) for w in work) + 1) * 16
    cache = torch.empty(slots, 576, dtype=torch.float8_e4m3fn, device="cuda")
    write_rows(cache, torch.arange(slots, device="cuda"), torch.randn(slots, 576, device="cuda"))
    q_latent = torch.randn(batch, 128, 512, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, 128, 64, device="cuda", dtype=torch.bfloat16)
    want = mla_attention(q_latent.float(), q_rope.float(), cache, meta, 0.07)
    got = mla_decode(q_latent, q_rope, cache, meta, 0.07).float()
    assert (got - want).abs().max() < 3e-2 * want.abs().max()


def test_graphed_truncated_sampling_equals_the_eager_step(tmp_path: Path) -> None:
    """Seeded sampling with min-p, top-k and top-p (the truncated-sampling graphs, whose top_k and
    min_p come from the graph's input buffer) draws the same tokens graphed as eager."""
    path = _write("qwen3_moe", tmp_path / "qwen3_moe")
    spec = SamplingSpec(temperature=0.9, top_p=0.9, seed=17, top_k=6, min_p=0.02)
    eager, graphed, model = _eager_and_graphed(path, lambda m: drive(m, PROMPTS, NEW_TOKENS, JOINS, CHUNK, sampling=spec))
    assert model.graphs is not None and any(key.truncate for key in model.graphs.graphs)
    assert eager == graphed
    assert len({token for out in eager for token in out}) > 3  # sampled, not one repeated token


def test_graphed_logprobs_equal_the_eager_step(tmp_path: Path) -> None:
    """Seeded sampling that asks for log-probabilities (the graphs that report them: log-softmax and
    top-20 over the vocabulary, three more device→host copies) gives the same tokens and, within bf16's
    reach, the same log-probabilities and most likely tokens graphed as eager."""
    path = _write("deepseek_v3", tmp_path / "ds3")
    spec = SamplingSpec(temperature=0.9, seed=5, logprobs=True)

    def run(model: HFStepModel) -> tuple[list[list[int]], list[list[tuple[float, list[float], list[int]]]]]:
        collected: list[list[tuple[float, list[float], list[int]]]] = [[] for _ in PROMPTS]
        return drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, sampling=spec, logprobs=collected), collected

    (eager, eager_lp), (graphed, graphed_lp), model = _eager_and_graphed(path, run)
    assert model.graphs is not None and any(key.logprobs for key in model.graphs.graphs)
    assert eager == graphed
    for eager_seq, graphed_seq in zip(eager_lp, graphed_lp, strict=True):
        assert len(eager_seq) == len(graphed_seq) > 0
        for (sampled, top, ids), (g_sampled, g_top, g_ids) in zip(eager_seq, graphed_seq, strict=True):
            assert g_sampled == pytest.approx(sampled, abs=2e-2) and sampled <= 0.0
            assert g_top == pytest.approx(top, abs=2e-2) and g_ids[0] == ids[0]


def test_graphed_penalties_equal_the_eager_step(tmp_path: Path) -> None:
    """Sampled with a logit bias and repetition, presence and frequency penalties beside an unpenalized sequence
    (the graphs that track tokens in the penalty tables and apply them; the bias rows written eagerly ahead of
    a replay), then a second batch taking the rows the first freed: the same tokens graphed as eager."""
    path = _write("qwen3_moe", tmp_path / "qwen3_moe")
    spec = SamplingSpec(temperature=0.8, seed=2, repetition=1.3, presence=0.5, frequency=0.4,
                        logit_bias=((7, 2.0), (11, -3.0)))

    def run(model: HFStepModel) -> tuple[list[list[int]], list[list[int]]]:
        return (drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, sampling=[spec, None, spec]),
                drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, seq_base=10, sampling=spec))

    eager, graphed, model = _eager_and_graphed(path, run)
    assert model.graphs is not None and any(key.penalties for key in model.graphs.graphs)
    assert eager == graphed


def test_prompt_logprobs_on_a_graphed_model_equal_the_eager_models(tmp_path: Path) -> None:
    """A step that reports prompt log-probabilities (``echo`` with ``logprobs``) runs eagerly on a model that
    replays graphs otherwise, and gives what the eager model gives."""
    from vexpert_runtime.serve.kv_cache import BlockPool

    path = _write("deepseek_v3", tmp_path / "ds3")
    prompt = PROMPTS[1]

    def run(model: HFStepModel) -> tuple[list[float], list[int]]:
        pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
        pool.add(0)
        work = [SequenceWork(0, tuple(prompt), 0, tuple(pool.grow(0, len(prompt))), SamplingSpec(),
                             prompt_targets=(*prompt[1:], -1))]
        pending = model.launch(work)
        pending.result()
        reported = pending.prompt_logprobs()
        assert reported is not None
        target_lp, top_ids, _ = reported.items[0]
        return target_lp.tolist(), top_ids[:, 0].tolist()

    eager, graphed, model = _eager_and_graphed(path, run)
    assert model.graphs is not None and len(eager[0]) == len(prompt) - 1
    assert graphed[0] == pytest.approx(eager[0], abs=2e-2) and graphed[1] == eager[1]


def _eager_and_graphed(path: Path, run: Callable[[HFStepModel], T], kv_cache_tokens: int = 512, fused: bool = False,
                       kv_cache_dtype: str = "auto", max_seqs: int = 8) -> tuple[T, T, HFStepModel]:
    """``run`` on a fresh one-rank model stepping eagerly, then on another replaying CUDA graphs of up to ``max_seqs``
    sequences (its small pieces compiled by inductor first when ``fused``): both results and the graphed model."""
    results = []
    for graphs in (False, True):
        model = _one_rank_model(path, kv_cache_tokens, kv_cache_dtype=kv_cache_dtype)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            if graphs:
                if fused:
                    assert model.compile_pieces() > 0
                model.enable_cuda_graphs(64, max_seqs, stream)
            results.append(run(model))
    return results[0], results[1], model


def _served_texts(model: HFStepModel, tokenizer: Any, requests: list[Any]) -> dict[str, list[str]]:
    """Each of ``requests``' event texts (an error's message in its place), served to the end by a scheduler of 16
    sequences and 64 tokens an iteration over ``model`` (overlapped where it replays graphs)."""
    from vexpert_runtime.serve.sampling import eos_token_ids
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=64, max_running=16),
                          eos_token_ids(tokenizer))
    for request in requests:
        scheduler.submit(request, lambda e, out=texts[request.request_id]: out.append(e.error or e.text))
    while scheduler.has_work():
        scheduler.run_iteration()
    return texts


def _one_rank_model(path: Path, kv_cache_tokens: int = 2048, overlap_shared_experts: bool = True,
                    kv_cache_dtype: str = "auto") -> HFStepModel:
    """The batched model on the GPU with its experts in one rank's EP layer (64-token dispatch capacity)."""
    model = HFStepModel(path, device="cuda", dtype=torch.bfloat16, kv_cache_tokens=kv_cache_tokens,
                        overlap_shared_experts=overlap_shared_experts, kv_cache_dtype=kv_cache_dtype)
    model.executor = EPExperts.for_model(model, 0, 1, None, max_tokens=64)
    model.drop_expert_weights()
    return model


def _kernel_streams(model: HFStepModel, work: list[SequenceWork], tmp_path: Path) -> set[int]:
    """The CUDA streams the kernels of one eager step ran on (a profiler trace)."""
    import json

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.step(work)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return {int(e["args"]["stream"]) for e in events if e.get("cat") == "kernel" and "stream" in e.get("args", {})}


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_shared_experts_on_a_side_stream_serve_the_tokens_of_one_stream(family: str, tmp_path: Path) -> None:
    """The shared expert on its side stream — graphed and compiled, the fork and join inside each graph — gives the
    tokens of the eager one-stream model (joins, chunked prompts, leaves); the eager step's kernels run on two
    streams with the side stream, on one without."""
    path = _write(family, tmp_path / family)
    results, streams = [], []
    for overlap in (False, True):
        model = _one_rank_model(path, 512, overlap_shared_experts=overlap)
        assert (model.shared_expert_stream is not None) == overlap
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            work = [SequenceWork(0, (3, 4, 5), 0, (0,), SamplingSpec()), SequenceWork(1, (6, 7), 0, (1,), SamplingSpec())]
            streams.append(_kernel_streams(model, work, tmp_path))
            model.release(0)
            model.release(1)
            if overlap:
                assert model.compile_pieces() > 0
                model.enable_cuda_graphs(64, 8, stream)
            results.append(drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK))
        if overlap:
            assert model.graphs is not None and model.graphs.replays >= 10
    assert len(streams[0]) == 1 and len(streams[1]) == 2
    assert results[0] == results[1]


def test_overlapped_graphed_scheduler_equals_the_eager_one(tmp_path: Path) -> None:
    """The scheduler over graphed steps launches step i+1 before reading step i (decodes fed from
    the device): every request's greedy tokens equal those of the eager, sequential scheduler."""
    from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    path = _write("deepseek_v3", tmp_path / "ds3")
    results = []
    for graphs in (False, True):
        model = _one_rank_model(path)
        stream = torch.cuda.Stream()
        texts: dict[str, list[str]] = {}
        with torch.cuda.stream(stream):
            if graphs:
                model.enable_cuda_graphs(64, 16, stream)
            assert model.overlaps_steps == graphs
            scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=64,
                                                                   max_running=16))
            for i in range(12):
                rid = f"r{i}"
                texts[rid] = []
                prompt = tuple(range(3 + i, 10 + 3 * i))
                scheduler.submit(GenerationRequest(rid, prompt, SamplingParams(max_tokens=5 + i, temperature=0,
                                                                               ignore_eos=True)),
                                 lambda e, out=texts[rid]: out.append(e.text))
            while scheduler.has_work():
                scheduler.run_iteration()
            if graphs:  # an idle rank's lockstep step replays the pad-row bucket, not an eager pass
                assert model.graphs is not None and model.graphs.replays >= 10
                before = model.graphs.replays
                scheduler.run_iteration()
                assert model.graphs.replays == before + 1
        results.append({r: id_text_tokens("".join(t)) for r, t in texts.items()})
    assert results[0] == results[1]
    assert all(len(tokens) == 5 + i for i, tokens in enumerate(results[1].values()))


def test_structured_output_on_graphed_overlapped_steps_equals_the_eager_one(tmp_path: Path) -> None:
    """Grammar-constrained sequences (a JSON schema, a regex, choices; greedy and seeded sampling) beside free
    ones on the GPU path (CUDA graphs, overlapped steps: the grammar's mask written into the bias rows ahead
    of each replay, a constrained sequence sitting out the step that samples its token): the same text as the
    eager sequential scheduler, and every constrained text follows its grammar."""
    import json
    import re

    from serve_support import build_tiny_checkpoint, load_tokenizer
    from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
    from vexpert_runtime.serve.structured_output import GrammarRequest, compile_grammar

    path = tmp_path / "ds3"
    build_tiny_checkpoint(path, "deepseek_v3")
    tokenizer = load_tokenizer(path)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    grammars = {"json": compile_grammar(GrammarRequest("json", schema, "t", whitespace_flexible=False)),
                "regex": compile_grammar(GrammarRequest("regex", r"[a-c]{3}-[0-9]{2}", "t")),
                "choice": compile_grammar(GrammarRequest("choice", ["yes", "no", "maybe so"], "t"))}
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    requests = [GenerationRequest(f"{name}-{temperature}", prompt, SamplingParams(
        max_tokens=40, temperature=temperature, seed=3, grammar=grammar))
        for name, grammar in grammars.items() for temperature in (0.0, 1.0)]
    requests += [GenerationRequest(f"free{i}", prompt[i:], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                 for i in range(4)]
    eager, graphed, model = _eager_and_graphed(path, lambda m: _served_texts(m, tokenizer, requests), 2048, max_seqs=16)
    assert model.graphs is not None and any(key.penalties for key in model.graphs.graphs)
    results = [{r: "".join(t) for r, t in texts.items()} for texts in (eager, graphed)]
    assert results[0] == results[1]
    for temperature in (0.0, 1.0):
        assert set(json.loads(results[1][f"json-{temperature}"])) == {"n", "ok"}
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", results[1][f"regex-{temperature}"])
        assert results[1][f"choice-{temperature}"] in ("yes", "no", "maybe so")


def test_a_thinking_budget_on_graphed_overlapped_steps_equals_the_eager_one(tmp_path: Path) -> None:
    """vLLM's ``thinking_token_budget`` on the GPU path: reasoning sequences with ``</think>`` biased away and budgets
    of 0, 2 and 5 tokens beside free ones — the forced ``</think>`` a mask in the bias rows of graphed overlapped
    steps, a sequence near its budget sitting out the step that samples its token — give the eager sequential
    scheduler's tokens, with ``</think>`` right after each budget."""
    from serve_support import build_tiny_checkpoint, load_tokenizer
    from vexpert_runtime.serve.events import GenerationRequest, SamplingParams

    path = tmp_path / "ds3"
    build_tiny_checkpoint(path, "deepseek_v3", added_tokens=["<think>", "</think>"])
    tokenizer = load_tokenizer(path)
    end = tokenizer.convert_tokens_to_ids("</think>")
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    budgets = {"b0": 0, "b2": 2, "b5": 5}
    requests = [GenerationRequest(f"{name}-{temperature}", prompt, SamplingParams(
        max_tokens=12, temperature=temperature, seed=5, ignore_eos=True, logit_bias=((end, -100.0),),
        reasoning_end=end, thinking_budget=budget))
        for name, budget in budgets.items() for temperature in (0.0, 1.0)]
    requests += [GenerationRequest(f"free{i}", prompt[i:], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                 for i in range(4)]
    results = _eager_and_graphed(path, lambda m: _served_texts(m, tokenizer, requests), 2048, max_seqs=16)[:2]
    assert results[0] == results[1]
    for name, budget in budgets.items():
        for temperature in (0.0, 1.0):
            texts = results[1][f"{name}-{temperature}"]  # one event per token
            assert texts.index("</think>") == budget and texts.count("</think>") == 1, texts


def test_a_grammar_mask_and_a_logit_bias_are_written_without_waiting_for_the_device() -> None:
    """The bias rows' writes ahead of a step (a logit bias, a grammar's mask) upload from pinned memory: the host
    does not wait for the step in flight (a pageable upload would, and the overlap be lost); the row holds −inf
    exactly where the mask allows nothing."""
    from vexpert_runtime.serve.penalties import PenaltyState

    vocab = 1000
    state = PenaltyState(vocab, "cuda")
    state.reserve(4)
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    words[0] = 0b1011  # tokens 0, 1 and 3
    spec = SamplingSpec(logit_bias=((1, 2.0),), allowed=words)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = state.rows_for([SequenceWork(0, (5,), 3, (1,), spec, penalty_prompt_len=3)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows is not None and state.bias is not None
    bias = state.bias[rows.rows[0]].cpu()
    assert bias[[0, 1, 3]].tolist() == [0.0, 2.0, 0.0] and torch.isinf(bias).sum() == vocab - 3


def test_prefix_caching_on_graphed_overlapped_steps_serves_the_same_tokens(tmp_path: Path) -> None:
    """--prefix-caching on the GPU path (CUDA graphs, overlapped steps): requests sharing a 40-token prefix
    (two whole 16-token blocks) with the first already served attach its blocks; every request's greedy
    tokens equal those without the cache, and the cache served the shared blocks."""
    from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    path = _write("deepseek_v3", tmp_path / "ds3")
    shared = tuple(range(3, 43))
    results, hits = [], []
    for caching in (False, True):
        model = _one_rank_model(path)
        stream = torch.cuda.Stream()
        texts: dict[str, list[str]] = {}
        with torch.cuda.stream(stream):
            model.enable_cuda_graphs(64, 16, stream)
            scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=64,
                                                                   max_running=16, prefix_caching=caching))
            for wave in (range(1), range(1, 10)):  # the first alone: its blocks are published before the rest
                for i in wave:
                    rid = f"r{i}"
                    texts[rid] = []
                    scheduler.submit(GenerationRequest(rid, (*shared, 50 + i, 60 + i), SamplingParams(
                        max_tokens=6, temperature=0, ignore_eos=True)), lambda e, out=texts[rid]: out.append(e.text))
                while scheduler.has_work():
                    scheduler.run_iteration()
        results.append({r: id_text_tokens("".join(t)) for r, t in texts.items()})
        hits.append(scheduler.load().prefix_hit_tokens)
    assert results[0] == results[1]
    assert hits == [0, 9 * 32]  # the nine later requests attached both whole blocks


def test_preemption_on_graphed_overlapped_steps_serves_the_same_tokens(tmp_path: Path) -> None:
    """A KV cache of one context (256 tokens) on the GPU path (CUDA graphs, overlapped steps): six
    requests of 40 + 40 tokens outgrow it, the newest are preempted (the step in flight read first)
    and re-admitted; every request's greedy tokens equal those on a cache with room for all."""
    from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    path = _write("deepseek_v3", tmp_path / "ds3")
    results, preemptions = [], []
    for kv_tokens in (2048, 256):
        model = _one_rank_model(path, kv_tokens)
        stream = torch.cuda.Stream()
        texts: dict[str, list[str]] = {}
        with torch.cuda.stream(stream):
            model.enable_cuda_graphs(64, 16, stream)
            scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=64,
                                                                   max_running=16))
            for i in range(6):
                rid = f"r{i}"
                texts[rid] = []
                scheduler.submit(GenerationRequest(rid, tuple(range(3 + 5 * i, 43 + 5 * i)), SamplingParams(
                    max_tokens=40, temperature=0, ignore_eos=True)), lambda e, out=texts[rid]: out.append(e.text))
            while scheduler.has_work():
                scheduler.run_iteration()
        results.append({r: id_text_tokens("".join(t)) for r, t in texts.items()})
        preemptions.append(scheduler.load().preemptions)
        assert scheduler.pool.used_blocks == 0
    assert preemptions[0] == 0 and preemptions[1] >= 1
    assert all(len(tokens) == 40 for tokens in results[1].values())
    assert results[0] == results[1]


@pytest.mark.parametrize(("experts", "groups", "kept", "top_k"), [(256, 8, 4, 8), (8, 4, 2, 2)])
def test_fused_router_equals_transformers_router_on_the_gpu(experts: int, groups: int, kept: int, top_k: int) -> None:
    """bf16 at DeepSeek-V3's hidden size, 256 tokens: the tensor-core logits (fp32 accumulation and output)
    equal transformers' fp32 GEMM up to summation order, and the selection kernel picks the same experts
    with the same weights wherever the top-k is not a near tie."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from vexpert_runtime.serve.fused_router import FusedDeepseekV3Router

    torch.manual_seed(experts)
    config = transformers.DeepseekV3Config(n_routed_experts=experts, n_group=groups, topk_group=kept,
                                           num_experts_per_tok=top_k, hidden_size=7168, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.02)
    router.e_score_correction_bias.normal_(0, 0.01)
    fused = FusedDeepseekV3Router(router)
    assert fused.tensor_cores  # torch.mm(..., out_dtype=torch.float32) runs here
    x = torch.randn(256, 7168, device="cuda", dtype=torch.bfloat16)
    want_logits, want_weights, want_ids = router(x)
    logits, weights, ids = fused(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    same = (ids.sort(1).values == want_ids.sort(1).values).all(1)
    assert same.float().mean() >= 0.98
    order, want_order = ids[same].argsort(1), want_ids[same].argsort(1)
    torch.testing.assert_close(weights[same].gather(1, order), want_weights[same].gather(1, want_order),
                               rtol=1e-4, atol=1e-5)


def test_fused_softmax_router_equals_qwen3_router_on_the_gpu() -> None:
    """bf16 at Qwen3-30B-A3B's shapes (H 2048, 128 experts, top-8), 256 tokens: the same logits, top-k
    weights equal as sorted values, the same experts wherever the k-th and (k+1)-th probabilities differ."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from vexpert_runtime.serve.fused_router import FusedSoftmaxRouter

    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, hidden_size=2048)
    router = Qwen3MoeTopKRouter(config).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    want_logits, want_weights, want_ids = router(x)
    logits, weights, ids = FusedSoftmaxRouter(router)(x)
    assert torch.equal(logits, want_logits)
    torch.testing.assert_close(weights.sort(1).values, want_weights.sort(1).values, rtol=8e-3, atol=1e-5)
    probs = logits.float().softmax(-1).sort(1, descending=True).values
    decided = probs[:, 7] > probs[:, 8]
    assert torch.equal(ids[decided].sort(1).values, want_ids[decided].sort(1).values)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "qwen2_moe"])
def test_a_model_on_the_gpu_routes_with_the_fused_router(family: str, tmp_path: Path) -> None:
    path = _write(family, tmp_path / family)
    model = HFStepModel(path, device="cuda", dtype=torch.bfloat16, kv_cache_tokens=512)
    assert model.fused_routers == len(model.moe_layers) > 0
