"""A router's expert selection as one Triton kernel: DeepSeek-V3's ``noaux_tc`` (:func:`deepseek_v3_select`)
and Qwen-MoE's softmax top-k (:func:`softmax_topk_select`).

transformers' ``DeepseekV3TopkRouter`` selects experts in ~12 kernels per layer after its logits GEMM —
sigmoid, the bias, a top-2 per group, a top-k over groups, a scatter into a group mask, the masked fill,
a top-k over experts (three ``torch.topk`` launches, each a ``gatherTopK`` and for some a sort), the gather
of the chosen scores, their normalisation and scale. On an H200 at 256 tokens those were ~0.1 ms of a
0.68 ms-per-layer decode step (``benchmarks/README.md`` §10, run 21: ``gatherTopK`` 9 launches 0.044 ms,
``bitonicSortKVInPlace`` 0.013, scatter / gather 0.028 and the element-wise rest). Here one program takes
``BLOCK_T`` tokens' logits row by row in registers and does all of it (SGLang's ``biased_grouped_topk``
and vLLM's ``grouped_topk`` CUDA kernels do the same).

Selection is :func:`~vexpert_runtime.model.routing.deepseek_v3_topk`'s: scores = sigmoid(logits); choice =
scores + bias; a group's score is the sum of its two best choices; the ``topk_group`` best groups stay;
the ``top_k`` best choices among their experts are the ids; the weights are their scores, normalised to
sum 1 if asked, times the routed scaling factor. Qwen's (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``):
the top-k of softmax(logits) in fp32, renormalised if asked, in the logits' dtype — after a GEMM that is
already bf16, three kernels (softmax, ``torch.topk``, the renormalisation) become one. Ties go to the lower
index (``torch.topk`` leaves that unspecified); ids come best first. The CPU tests run it in Triton's
interpreter against transformers' routers.

Shapes: ``T`` tokens, ``E`` experts (a power of two when groups are used: a group is a contiguous run of
``E / n_group`` experts), ``K`` = top-k.
"""

from __future__ import annotations

import torch

try:  # CUDA builds of torch ship Triton; CPU-only installs may not (transformers' router serves there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def available() -> bool:
    """Whether the kernel can run (Triton is importable)."""
    return triton is not None


def supports(num_experts: int, n_group: int, topk_group: int, top_k: int) -> bool:
    """Whether :func:`deepseek_v3_select` takes this router: groups (``n_group`` > 1 with ``topk_group`` <
    ``n_group``) need a power-of-two expert count split evenly; ``top_k`` must fit in the kept groups."""
    if num_experts < 1 or top_k < 1 or top_k > num_experts or n_group < 1 or num_experts % n_group:
        return False
    if n_group == 1 or topk_group >= n_group:
        return True  # no groups
    per_group = num_experts // n_group
    powers_of_two = not (num_experts & (num_experts - 1) or n_group & (n_group - 1))
    return powers_of_two and per_group >= 2 and top_k <= topk_group * per_group


if triton is not None:

    @triton.jit
    def _select_experts_kernel(logits, bias, ids_out, weights_out, tokens, stride_l, stride_o, scaling,
                               E: tl.constexpr, EP: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
                               K: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                               GROUPED: tl.constexpr, NORMALISE: tl.constexpr, BLOCK_T: tl.constexpr):
        """Scores (sigmoid, or with SOFTMAX the softmax over the experts), the selection (choice = scores
        [+ bias], [the kept groups' experts]), the top-K ids best first and their weights (the scores,
        normalised if NORMALISE, times ``scaling``) written in ``weights_out``'s dtype."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < tokens
        e = tl.arange(0, EP)
        emask = e < E
        rows = t[:, None].to(tl.int64) * stride_l + e[None, :]
        mask = tmask[:, None] & emask[None, :]
        raw = tl.where(emask[None, :], tl.load(logits + rows, mask=mask, other=0.0).to(tl.float32), float("-inf"))
        if SOFTMAX:  # as torch.softmax: exp(x − max) / Σ (padding experts weigh exp(−inf) = 0)
            p = tl.exp(raw - tl.max(raw, 1)[:, None])
            scores = p / tl.sum(p, 1)[:, None]
        else:
            scores = tl.sigmoid(raw)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias + e, mask=emask, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(emask[None, :], choice, float("-inf"))
        if GROUPED:  # keep the TOPK_GROUP groups whose two best choices sum highest
            PER: tl.constexpr = E // G
            grouped = tl.reshape(choice, [BLOCK_T, G, PER])
            member = tl.arange(0, PER)
            best = tl.max(grouped, 2)
            first = tl.min(tl.where(grouped == best[:, :, None], member[None, None, :], PER), 2)
            second = tl.max(tl.where(member[None, None, :] == first[:, :, None], float("-inf"), grouped), 2)
            group_score = best + second
            g = tl.arange(0, G)
            kept = tl.zeros([BLOCK_T, G], dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                top = tl.max(group_score, 1)
                pick = tl.min(tl.where(group_score == top[:, None], g[None, :], G), 1)
                hit = g[None, :] == pick[:, None]
                kept = tl.where(hit, 1, kept)
                group_score = tl.where(hit, float("-inf"), group_score)
            kept_experts = tl.reshape(tl.broadcast_to(kept[:, :, None], [BLOCK_T, G, PER]), [BLOCK_T, EP])
            choice = tl.where(kept_experts != 0, choice, float("-inf"))
        slot = tl.arange(0, KP)
        ids = tl.zeros([BLOCK_T, KP], dtype=tl.int64)
        weights = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        for k in tl.static_range(K):  # best first; ties to the lower expert index
            top = tl.max(choice, 1)
            pick = tl.min(tl.where(choice == top[:, None], e[None, :], EP), 1)
            hit = e[None, :] == pick[:, None]
            weight = tl.sum(tl.where(hit, scores, 0.0), 1)
            ids = tl.where(slot[None, :] == k, pick[:, None].to(tl.int64), ids)
            weights = tl.where(slot[None, :] == k, weight[:, None], weights)
            choice = tl.where(hit, float("-inf"), choice)
        if NORMALISE:
            weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
        out = t[:, None].to(tl.int64) * stride_o + slot[None, :]
        omask = tmask[:, None] & (slot < K)[None, :]
        tl.store(ids_out + out, ids, mask=omask)
        tl.store(weights_out + out, weights * scaling, mask=omask)


def block_tokens(experts: int) -> int:
    """Tokens per program: ~1,024 fp32 choices in the registers of 4 warps (4 tokens of 256 experts,
    64 of 8 — fewer, fuller programs where each row is short)."""
    return max(1, min(64, 1024 // triton.next_power_of_2(experts)))


def deepseek_v3_select(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int,
                       topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, correction_bias [E] or None → (ids [T, K] int64 best first, weights [T, K] fp32);
    the arguments as :func:`~vexpert_runtime.model.routing.deepseek_v3_topk`'s (see :func:`supports`)."""
    experts = logits.shape[1]
    if not supports(experts, n_group, topk_group, top_k):
        raise ValueError(f"deepseek_v3_select does not take {experts} experts in {n_group} groups, "
                         f"topk_group {topk_group}, top_k {top_k} (see supports())")
    return _select(logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
                   softmax=False, weight_dtype=torch.float32)


def softmax_topk_select(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weight_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE's selection: logits [T, E] (any float dtype) → (ids [T, K] int64 best first, weights [T, K]
    ``weight_dtype``): the top-k of softmax(logits) in fp32, renormalised to sum 1 if ``norm_topk_prob``."""
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"softmax_topk_select: top_k {top_k} of {logits.shape[1]} experts")
    return _select(logits, None, top_k, 1, 1, 1.0, norm_topk_prob, softmax=True, weight_dtype=weight_dtype)


def _select(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
            scaling: float, normalise: bool, *, softmax: bool, weight_dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=weight_dtype, device=logits.device)
    if tokens == 0:
        return ids, weights
    shapes = launch_constexprs(experts, n_group, topk_group, top_k, softmax=softmax, has_bias=bias is not None,
                               normalise=normalise)
    _select_experts_kernel[(triton.cdiv(tokens, shapes["BLOCK_T"]),)](
        logits, logits if bias is None else bias, ids, weights, tokens, logits.stride(0), top_k, float(scaling),
        **shapes, num_warps=4)
    return ids, weights


def launch_constexprs(experts: int, n_group: int, topk_group: int, top_k: int, *, softmax: bool, has_bias: bool,
                      normalise: bool) -> dict[str, int | bool]:
    """The selection kernel's compile-time arguments for a routing (what a launch specialises on)."""
    return dict(E=experts, EP=triton.next_power_of_2(experts), G=n_group, TOPK_GROUP=topk_group, K=top_k,
                KP=max(2, triton.next_power_of_2(top_k)), SOFTMAX=softmax, HAS_BIAS=has_bias,
                GROUPED=n_group > 1 and topk_group < n_group, NORMALISE=bool(normalise),
                BLOCK_T=block_tokens(experts))
