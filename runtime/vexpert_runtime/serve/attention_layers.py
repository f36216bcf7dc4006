"""A decoder layer's self-attention over a whole iteration's tokens, with transformers' weights.

:func:`attention_forward` runs one transformers attention module (DeepSeek-V3 MLA, Qwen3-MoE or
Qwen2-MoE GQA) for the ``T`` flattened tokens of an iteration: its own projections, norms and rotary
embedding, the new rows written into the paged cache, then one batched attention call
(:mod:`.attention`'s padded SDPA groups, or a kernel from :mod:`.attention_kernels` on a GPU).
The arithmetic of the projections, norms and rotary embeddings is the module's own (the same
formulas, element for element); only the attention sum is batched and, for MLA, absorbed.

Shapes: ``T`` tokens, ``H`` hidden, ``nh`` heads, ``d`` head dim, ``C`` latent (kv_lora_rank), ``R``
rotary dims of MLA, ``dn``/``dv`` MLA's non-rotary query/key and value head dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.model import fusion
from vexpert_runtime.serve.attention import AttentionMetadata, gqa_attention, mla_attention
from vexpert_runtime.serve.attention_input_kernels import (
    gqa_cache_rows,
    gqa_cache_rows_runs,
    mla_cache_rows,
    mla_cache_rows_runs,
)
from vexpert_runtime.serve.attention_kernels import QueryRotary
from vexpert_runtime.serve.kv_cache import KVLayout, write_rows

# An attention kernel: (queries..., cache, metadata, scale) -> output; None: the torch path.
AttentionKernel = Callable[..., torch.Tensor]


def kv_layout(config: Any) -> KVLayout:
    """The cache row of a transformers config: MLA when it has ``kv_lora_rank``, else GQA."""
    layers = int(config.num_hidden_layers)
    if getattr(config, "kv_lora_rank", None):
        return KVLayout(layers, mla=True, latent=int(config.kv_lora_rank), rope=int(config.qk_rope_head_dim))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout(layers, mla=False, kv_heads=int(config.num_key_value_heads), head_dim=int(head_dim))


def sliding_windows(config: Any) -> list[int | None]:
    """Per decoder layer, its sliding window (None: full attention) — transformers' rules: a
    ``layer_types`` list names each layer's kind; without one, a set ``sliding_window`` applies to
    every layer (Qwen3-MoE)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" and window else None for t in types]
    return [int(window) if window else None] * layers


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (−x₂, x₁) over the last dim's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, heads, r] at cos/sin [T, r] (transformers' ``apply_rotary_pos_emb``,
    or DeepSeek's ``apply_rotary_pos_emb_interleave`` when ``interleave``)."""
    if interleave:
        cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
        sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return (x * cos.unsqueeze(1)) + (rotate_half(x) * sin.unsqueeze(1))


@dataclass
class AttentionStep:
    """What every layer's attention shares in one iteration."""

    cos: torch.Tensor  # [T, r]
    sin: torch.Tensor
    meta: AttentionMetadata
    kernel: AttentionKernel | None = None  # the GPU kernel (per-token metadata); None: padded SDPA groups
    compiled: bool = False  # the projections, norms and rotary embedding compiled (:mod:`~vexpert_runtime.model.fusion`)


def attention_forward(attn: Any, x: torch.Tensor, cache: torch.Tensor, step: AttentionStep,
                      window: int | None) -> torch.Tensor:
    """One layer's self-attention of the iteration's normed tokens x [T, H] → [T, H]; writes the
    tokens' cache rows."""
    if hasattr(attn, "kv_a_proj_with_mqa"):
        return _mla_forward(attn, x, cache, step)
    return _gqa_forward(attn, x, cache, step, window)


def _gqa_forward(attn: Any, x: torch.Tensor, cache: torch.Tensor, step: AttentionStep,
                 window: int | None) -> torch.Tensor:
    if step.kernel is not None and gqa_cache_rows_runs(attn, x, cache):  # norms, rotary, cache write: one kernel
        q = gqa_cache_rows(attn, attn.fused_qkv_proj(x), step.cos, step.sin, cache, step.meta.slot_mapping)
    else:
        (q,) = fusion.maybe_compiled(inputs_written, step.compiled)(gqa_inputs, attn, x, step.cos, step.sin, cache,
                                                                     step.meta.slot_mapping)
    if step.kernel is not None:
        out = step.kernel(q, cache, step.meta, float(attn.scaling), window=window)
    else:
        out = gqa_attention(q, cache, step.meta, float(attn.scaling), window)
    return attn.o_proj(out.flatten(1))


def inputs_written(inputs: Callable[..., tuple[torch.Tensor, ...]], attn: Any, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer's queries from ``inputs`` (:func:`gqa_inputs` or :func:`mla_inputs`), its cache rows written into
    ``cache`` at ``slots`` (:func:`~.kv_cache.write_rows`). One function so that, compiled, the kernel producing the
    rows (norm, rotary, concatenation) stores them straight into the cache — inductor turns the in-place
    ``index_copy_`` on the cache argument into that kernel's store — instead of writing them once and then copying
    them with an ``index_copy`` kernel per layer (13 µs a 3-layer step at 256 tokens on an H100: run 29c's profile)."""
    *queries, rows = inputs(attn, x, cos, sin)
    write_rows(cache, slots, rows)
    return tuple(queries)


def gqa_inputs(attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GQA layer's queries q [T, nh, d] and cache rows [T, 2, kv_heads, d] (keys, values) of x [T, H]
    at rotary cos/sin [T, d]: the module's projections, Qwen3's per-head norms, the rotary embedding."""
    tokens, head_dim = x.shape[0], int(attn.head_dim)
    heads, kv_heads = int(attn.config.num_attention_heads), int(attn.config.num_key_value_heads)
    fused = getattr(attn, "fused_qkv_proj", None)  # :mod:`.fused_projections`: one GEMM for the three
    if fused is not None:
        q, k, v = fused(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rotary(q, cos, sin, interleave=False)
    k = apply_rotary(k, cos, sin, interleave=False)
    return q, torch.stack([k, v], dim=1)


def mla_weights(attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj split per head into W_UK [nh, dn, C] and W_UV [nh, dv, C] (views)."""
    dn, dv = int(attn.qk_nope_head_dim), int(attn.v_head_dim)
    weight = attn.kv_b_proj.weight.view(int(attn.num_heads), dn + dv, int(attn.kv_lora_rank))
    return weight[:, :dn], weight[:, dn:]


def mla_inputs(attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_queries: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MLA layer's absorbed query — q_latent [T, nh, C] (W_UK folded in) and q_rope [T, nh, R] — and
    its cache rows [T, C + R] (normed latent, rotary key) of x [T, H] at rotary cos/sin [T, R]. Without
    ``rotate_queries`` q_rope is the projection's rotary part as it comes (a strided view, no copy), for the decode
    kernel to rotate as it loads it (:class:`~.attention_kernels.QueryRotary`)."""
    tokens, heads = x.shape[0], int(attn.num_heads)
    dn, rope, latent = int(attn.qk_nope_head_dim), int(attn.qk_rope_head_dim), int(attn.kv_lora_rank)
    fused = getattr(attn, "fused_a_proj", None)  # :mod:`.fused_projections`: q_a and kv_a as one GEMM
    if fused is not None:
        q_a, compressed = fused(x).split([int(attn.q_lora_rank), latent + rope], dim=-1)
        q = attn.q_b_proj(attn.q_a_layernorm(q_a))
    else:
        q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        compressed = attn.kv_a_proj_with_mqa(x)
    q = q.view(tokens, heads, dn + rope)
    q_nope, q_rope = q[..., :dn], q[..., dn:]
    c, k_rope = compressed[:, :latent], compressed[:, latent:]
    c = attn.kv_a_layernorm(c)
    interleave = bool(getattr(attn.config, "rope_interleave", False))
    if rotate_queries:
        q_rope = apply_rotary(q_rope, cos, sin, interleave)
    k_rope = apply_rotary(k_rope.view(tokens, 1, rope), cos, sin, interleave).view(tokens, rope)
    w_uk, _ = mla_weights(attn)
    q_latent = torch.einsum("tnd,ndc->tnc", q_nope, w_uk)
    return q_latent, q_rope, torch.cat([c, k_rope], dim=-1)


def mla_inputs_unrotated(attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mla_inputs` with the rotary queries left for the decode kernel to rotate: one kernel per layer fewer
    (the queries' rotary embedding wrote [T, nh, R] of its own: 7 µs a layer at 256 tokens on an H100, run 33)."""
    return mla_inputs(attn, x, cos, sin, rotate_queries=False)


def mla_output(attn: Any, out_latent: torch.Tensor) -> torch.Tensor:
    """The layer's output [T, H] of the attention's latent output [T, nh, C]: W_UV, then o_proj.

    The per-head W_UV products are one batched GEMM over heads that writes its [nh, T, dv] result straight into a
    [T, nh, dv] buffer (a batch stride of dv, rows nh·dv apart: cuBLAS takes any row stride), which o_proj reads as
    [T, nh·dv] — an einsum (compiled or not) wrote [nh, T, dv] and then copied it into that order (a transpose kernel
    per layer: 13 µs a 3-layer step at 256 tokens on an H100, run 29c's profile). Eager on purpose: compiled, the ``out=`` write
    would be functionalised back into that copy."""
    _, w_uv = mla_weights(attn)
    values = out_latent.new_empty(out_latent.shape[0], out_latent.shape[1], w_uv.shape[1])
    torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2), out=values.transpose(0, 1))
    return attn.o_proj(values.flatten(1))


def mla_queries_by_kernel(attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                          slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`inputs_written` over :func:`mla_inputs_unrotated` with the norms, the rotary key and the cache write
    between the two projections in one kernel (:func:`~.attention_input_kernels.mla_cache_rows`), eager: the fused
    q_a + kv_a GEMM, that kernel, q_b, then W_UK as one batched GEMM over heads writing q_latent [T, nh, C] in place
    (as :func:`mla_output` writes its values). Returns (q_latent, q_rope as q_b's strided rotary part)."""
    tokens, heads = x.shape[0], int(attn.num_heads)
    dn, rope = int(attn.qk_nope_head_dim), int(attn.qk_rope_head_dim)
    q_normed = mla_cache_rows(attn, attn.fused_a_proj(x), cos, sin, cache, slots)
    q = attn.q_b_proj(q_normed).view(tokens, heads, dn + rope)
    w_uk, _ = mla_weights(attn)
    q_latent = q.new_empty(tokens, heads, w_uk.shape[2])
    torch.bmm(q[..., :dn].transpose(0, 1), w_uk, out=q_latent.transpose(0, 1))
    return q_latent, q[..., dn:]


def _mla_forward(attn: Any, x: torch.Tensor, cache: torch.Tensor, step: AttentionStep) -> torch.Tensor:
    written = fusion.maybe_compiled(inputs_written, step.compiled)
    if step.kernel is not None:  # the kernel applies the queries' rotary embedding itself
        if mla_cache_rows_runs(attn, x, cache):
            q_latent, q_rope = mla_queries_by_kernel(attn, x, step.cos, step.sin, cache, step.meta.slot_mapping)
        else:
            q_latent, q_rope = written(mla_inputs_unrotated, attn, x, step.cos, step.sin, cache,
                                       step.meta.slot_mapping)
        rope = QueryRotary(step.cos, step.sin, bool(getattr(attn.config, "rope_interleave", False)))
        out_latent = step.kernel(q_latent, q_rope, cache, step.meta, float(attn.scaling), rope=rope)
    else:
        q_latent, q_rope = written(mla_inputs, attn, x, step.cos, step.sin, cache, step.meta.slot_mapping)
        out_latent = mla_attention(q_latent, q_rope, cache, step.meta, float(attn.scaling))
    return mla_output(attn, out_latent)
