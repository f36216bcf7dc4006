"""An attention layer's inputs between its projections and its attention kernel in one Triton kernel per layer:
:func:`mla_cache_rows` (DeepSeek-V3's MLA), :func:`gqa_cache_rows` (Qwen3-MoE's and Qwen2-MoE's GQA).

After the fused q_a + kv_a GEMM (:mod:`.fused_projections`) a DeepSeek-V3 layer norms q_a's output for q_b, norms the
compressed latent, rotates the rotary key and writes (latent, key) into the paged cache. Compiled by inductor
(:func:`~.attention_layers.inputs_written` over :func:`~.attention_layers.mla_inputs_unrotated`) that is five kernels a
layer — two norms of different widths, the rotary key, the concatenation, the cache's ``index_copy`` — 18 µs a layer
at 256 decode tokens on an H100 for ~1 MB of rows (run 33b's Nsight Compute table of the step, benchmarks/README §10).
Here one program per token row does all of it, the way vLLM's and SGLang's fused norm / rotary / cache-write kernels
do: the row's q_a part normed into ``q_normed``, its latent normed and its rotary key rotated straight into the
token's cache slot.

The arithmetic is transformers' ``DeepseekV3RMSNorm`` (float32 mean of squares, the normed row rounded to the input's
dtype, then times the weight) and :func:`~.attention_layers.apply_rotary` (each product and the sum rounded), so the
outputs equal the torch code's up to the order of the mean's sum (the CPU tests run it in Triton's interpreter).
Runs where :func:`mla_cache_rows_runs` says (the attention kernels run, q_a and kv_a fused, a cache in the
activations' dtype); elsewhere the torch code. Shapes: ``T`` token rows, ``Q`` q_lora_rank, ``C`` latent, ``R``
rotary head dim.

A GQA layer likewise (:func:`gqa_cache_rows`, after the fused q / k / v GEMM): per token, Qwen3's per-head RMSNorm
of the queries and keys, the rotary embedding of both, the queries written for the decode kernel and (keys, values)
into the token's cache slot — transformers' ``Qwen3MoeRMSNorm`` and :func:`~.attention_layers.apply_rotary`'s
roundings (:func:`~.attention_layers.gqa_inputs` is the torch code). Shapes: ``nh`` query heads, ``kvh`` KV heads,
``d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from vexpert_runtime.serve import attention_kernels

if attention_kernels.available():
    import triton
    import triton.language as tl

    from vexpert_runtime.serve.attention_kernels import rotary_indices, rotated

    @triton.jit
    def _rms_rstd(x, count, eps, AXIS: tl.constexpr):
        """transformers' RMSNorm's 1 / √(mean of squares + eps) along AXIS of float32 ``x`` (zeros past its ``count``
        real columns)."""
        return tl.rsqrt(tl.sum(x * x, AXIS) / count + eps)

    @triton.jit
    def _rms_normed(x, rstd, weight, DTYPE: tl.constexpr):
        """transformers' RMSNorm's output from ``x`` and its :func:`_rms_rstd`: x · rstd rounded to the input's dtype
        DTYPE, then times the weight (a float32 product; the caller rounds it)."""
        return weight.to(tl.float32) * (x.to(tl.float32) * rstd).to(DTYPE).to(tl.float32)

    @triton.jit
    def _mla_cache_rows_kernel(a, q_weight, kv_weight, cos, sin, slots, cache, q_normed, q_eps, kv_eps,
                               stride_a, stride_rope, stride_cache, stride_q,
                               Q: tl.constexpr, C: tl.constexpr, R: tl.constexpr, QP: tl.constexpr,
                               CP: tl.constexpr, RP: tl.constexpr, INTERLEAVE: tl.constexpr):
        """One program per token row t. a [T, Q + C + R] (row stride ``stride_a``): q_a's output, the latent, the
        rotary key. Writes q_normed[t] = norm_q(a[t, :Q]) and cache[slots[t]] = (norm_kv(a[t, Q:Q+C]),
        rotary(a[t, Q+C:])) at cos / sin [T, R] row t."""
        t = tl.program_id(0).to(tl.int64)
        row = a + t * stride_a
        offs_q = tl.arange(0, QP)
        qmask = offs_q < Q
        x = tl.load(row + offs_q, mask=qmask, other=0.0).to(tl.float32)
        w = tl.load(q_weight + offs_q, mask=qmask, other=0.0)
        tl.store(q_normed + t * stride_q + offs_q,
                 _rms_normed(x, _rms_rstd(x, Q, q_eps, 0), w, a.dtype.element_ty).to(q_normed.dtype.element_ty),
                 mask=qmask)
        slot = tl.load(slots + t).to(tl.int64)
        dest = cache + slot * stride_cache
        offs_c = tl.arange(0, CP)
        cmask = offs_c < C
        c = tl.load(row + Q + offs_c, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(kv_weight + offs_c, mask=cmask, other=0.0)
        normed = _rms_normed(c, _rms_rstd(c, C, kv_eps, 0), w, a.dtype.element_ty).to(kv_weight.dtype.element_ty)
        tl.store(dest + offs_c, normed.to(cache.dtype.element_ty), mask=cmask)
        offs_r = tl.arange(0, RP)
        rmask = offs_r < R
        pair, own, partner, upper = rotary_indices(offs_r, R, INTERLEAVE)
        key = tl.load(row + Q + C + own, mask=rmask, other=0.0)
        other = tl.load(row + Q + C + partner, mask=rmask, other=0.0)
        cs = tl.load(cos + t * stride_rope + pair, mask=rmask, other=0.0)
        sn = tl.load(sin + t * stride_rope + pair, mask=rmask, other=0.0)
        tl.store(dest + C + offs_r, rotated(key, other, cs, sn, upper).to(cache.dtype.element_ty), mask=rmask)


    @triton.jit
    def _gqa_heads(row, weight, cos, sin, heads, offs, t, stride_rope, eps, NUM: tl.constexpr, D: tl.constexpr,
                   NORM: tl.constexpr):
        """Heads ``heads`` [HP] (NUM real) of one token's projection ``row`` ([NUM, D] from there): Qwen3's RMSNorm
        over each head (where NORM, weight [D]), then the rotary embedding (transformers' halves) at cos / sin row t —
        [HP, DP] in the row's dtype."""
        pair, own, partner, upper = rotary_indices(offs, D, False)
        dmask = offs < D
        mask = (heads < NUM)[:, None] & dmask[None, :]
        x = tl.load(row + heads[:, None] * D + own[None, :], mask=mask, other=0.0)
        other = tl.load(row + heads[:, None] * D + partner[None, :], mask=mask, other=0.0)
        if NORM:  # own is every column once: the head's sum of squares
            rstd = _rms_rstd(x.to(tl.float32), D, eps, 1)[:, None]
            w_own = tl.load(weight + own, mask=dmask, other=0.0)[None, :]
            w_partner = tl.load(weight + partner, mask=dmask, other=0.0)[None, :]
            dtype = x.dtype
            x = _rms_normed(x, rstd, w_own, dtype).to(dtype)
            other = _rms_normed(other, rstd, w_partner, dtype).to(dtype)
        c = tl.load(cos + t * stride_rope + pair, mask=dmask, other=0.0)
        s = tl.load(sin + t * stride_rope + pair, mask=dmask, other=0.0)
        return rotated(x, other, c[None, :], s[None, :], upper[None, :])

    @triton.jit
    def _gqa_cache_rows_kernel(qkv, q_weight, k_weight, cos, sin, slots, cache, q_out, eps,
                               stride_qkv, stride_rope, stride_cache, stride_kv, stride_head, stride_qt, stride_qh,
                               NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, NHP: tl.constexpr,
                               KVHP: tl.constexpr, DP: tl.constexpr, NORM: tl.constexpr):
        """One program per token row t. qkv [T, (nh + 2·kvh)·d] (row stride ``stride_qkv``): queries, keys, values.
        Writes q_out[t] [nh, d] (normed where NORM, rotated) and cache[slots[t]] = (keys normed and rotated,
        values) [2, kvh, d]."""
        t = tl.program_id(0).to(tl.int64)
        row = qkv + t * stride_qkv
        offs = tl.arange(0, DP)
        heads = tl.arange(0, NHP)
        q = _gqa_heads(row, q_weight, cos, sin, heads, offs, t, stride_rope, eps, NH, D, NORM)
        tl.store(q_out + t * stride_qt + heads[:, None] * stride_qh + offs[None, :], q.to(q_out.dtype.element_ty),
                 mask=(heads < NH)[:, None] & (offs < D)[None, :])
        kv_heads = tl.arange(0, KVHP)
        kv_mask = (kv_heads < KVH)[:, None] & (offs < D)[None, :]
        dest = cache + tl.load(slots + t).to(tl.int64) * stride_cache + kv_heads[:, None] * stride_head + offs[None, :]
        k = _gqa_heads(row + NH * D, k_weight, cos, sin, kv_heads, offs, t, stride_rope, eps, KVH, D, NORM)
        tl.store(dest, k.to(cache.dtype.element_ty), mask=kv_mask)
        v = tl.load(row + (NH + KVH) * D + kv_heads[:, None] * D + offs[None, :], mask=kv_mask, other=0.0)
        tl.store(dest + stride_kv, v.to(cache.dtype.element_ty), mask=kv_mask)


def gqa_cache_rows_runs(attn: Any, x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether :func:`gqa_cache_rows` serves this layer's inputs: Triton is there, q, k and v are one GEMM
    (``attn.fused_qkv_proj``), Qwen3's per-head norms (if any) share one epsilon, the cache holds the activations'
    dtype and there is a row to write."""
    if not attention_kernels.available() or getattr(attn, "fused_qkv_proj", None) is None \
            or cache.dtype != x.dtype or x.shape[0] == 0:
        return False
    return not hasattr(attn, "q_norm") or float(attn.q_norm.variance_epsilon) == float(attn.k_norm.variance_epsilon)


def gqa_cache_rows(attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """The queries [T, nh, d] — Qwen3's per-head norm (where the module has one) and the rotary embedding applied —
    with each token's (keys, values) written into ``cache`` [slots, 2, kvh, d] at ``slots`` [T]: what
    :func:`~.attention_layers.inputs_written` over :func:`~.attention_layers.gqa_inputs` computes after the
    projections, in one kernel. ``qkv`` [T, (nh + 2·kvh)·d]: the fused q / k / v GEMM's output (unit column stride);
    cos / sin [T, d]."""
    heads, kv_heads = int(attn.config.num_attention_heads), int(attn.config.num_key_value_heads)
    head_dim = int(attn.head_dim)
    tokens = qkv.shape[0]
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"gqa_cache_rows wants the fused q / k / v output [T, {(heads + 2 * kv_heads) * head_dim}] "
                         f"with unit column stride, got {list(qkv.shape)} strides {qkv.stride()}")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"gqa_cache_rows wants cos and sin [{tokens}, {head_dim}] alike with unit column stride, got "
                         f"{list(cos.shape)} {cos.stride()} and {list(sin.shape)} {sin.stride()}")
    if cache.shape[1:] != (2, kv_heads, head_dim) or cache.stride(3) != 1 or slots.shape != (tokens,):
        raise ValueError(f"gqa_cache_rows wants a cache [slots, 2, {kv_heads}, {head_dim}] and slots [{tokens}], got "
                         f"{list(cache.shape)} and {list(slots.shape)}")
    norm = hasattr(attn, "q_norm")
    q_weight = attn.q_norm.weight if norm else qkv  # never read without the norms
    k_weight = attn.k_norm.weight if norm else qkv
    q = qkv.new_empty(tokens, heads, head_dim)
    _gqa_cache_rows_kernel[(tokens,)](
        qkv, q_weight, k_weight, cos, sin, slots, cache, q, float(attn.q_norm.variance_epsilon) if norm else 0.0,
        qkv.stride(0), cos.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), q.stride(0), q.stride(1),
        NH=heads, KVH=kv_heads, D=head_dim, NHP=triton.next_power_of_2(heads), KVHP=triton.next_power_of_2(kv_heads),
        DP=triton.next_power_of_2(head_dim), NORM=norm, num_warps=4,
    )
    return q


def mla_cache_rows_runs(attn: Any, x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether :func:`mla_cache_rows` serves this layer's inputs: Triton is there, q_a and kv_a are one GEMM
    (``attn.fused_a_proj``), the cache holds the activations' dtype (an FP8 cache's saturating cast stays in the torch
    code) and there is a row to write."""
    return (attention_kernels.available() and getattr(attn, "fused_a_proj", None) is not None
            and cache.dtype == x.dtype and x.shape[0] > 0)


def mla_cache_rows(attn: Any, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """q_a's output normed for q_b [T, Q], with each token's cache row — (kv_a's latent normed, its rotary key
    rotated) — written into ``cache`` [slots, C + R] at ``slots`` [T]: what
    :func:`~.attention_layers.inputs_written` over :func:`~.attention_layers.mla_inputs` computes between the two
    projections, in one kernel. ``a`` [T, Q + C + R]: the fused q_a + kv_a GEMM's output (unit column stride);
    cos / sin [T, R]."""
    q_rank, latent, rope = int(attn.q_lora_rank), int(attn.kv_lora_rank), int(attn.qk_rope_head_dim)
    tokens = a.shape[0]
    if a.shape[1] != q_rank + latent + rope or a.stride(1) != 1:
        raise ValueError(f"mla_cache_rows wants the fused q_a + kv_a output [T, {q_rank + latent + rope}] with unit "
                         f"column stride, got {list(a.shape)} strides {a.stride()}")
    if cos.shape != (tokens, rope) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"mla_cache_rows wants cos and sin [{tokens}, {rope}] alike with unit column stride, got "
                         f"{list(cos.shape)} {cos.stride()} and {list(sin.shape)} {sin.stride()}")
    if cache.shape[1] != latent + rope or cache.stride(1) != 1 or slots.shape != (tokens,):
        raise ValueError(f"mla_cache_rows wants a cache [slots, {latent + rope}] and slots [{tokens}], got "
                         f"{list(cache.shape)} and {list(slots.shape)}")
    q_norm, kv_norm = attn.q_a_layernorm, attn.kv_a_layernorm
    q_normed = a.new_empty(tokens, q_rank)
    _mla_cache_rows_kernel[(tokens,)](
        a, q_norm.weight, kv_norm.weight, cos, sin, slots, cache, q_normed,
        float(q_norm.variance_epsilon), float(kv_norm.variance_epsilon),
        a.stride(0), cos.stride(0), cache.stride(0), q_normed.stride(0),
        Q=q_rank, C=latent, R=rope, QP=triton.next_power_of_2(q_rank), CP=triton.next_power_of_2(latent),
        RP=triton.next_power_of_2(rope), INTERLEAVE=bool(getattr(attn.config, "rope_interleave", False)),
        num_warps=4,
    )
    return q_normed
