"""MoE gates: DeepSeek-V3 (sigmoid, group-limited top-k, correction bias, routed scaling) and Qwen
(softmax top-k). Pure functions of one batch of tokens; the EP forward and the single-process
reference call the same function, so both route identically.

Shapes: ``B`` tokens, ``H`` hidden, ``E`` experts, ``K`` = top-k.
"""

from __future__ import annotations

import torch

from vexpert_runtime.model.moe_spec import MoESpec
from vexpert_runtime.model.weights import RouterWeights


def router_logits(x: torch.Tensor, weight: torch.Tensor, logit_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H] (any float dtype), weight [E, H] → fp32 logits [B, E].

    ``logit_bias`` [E] is an optional additive skew (the demo uses it to replay real expert loads
    on a tiny random model); real models pass None.
    """
    logits = torch.nn.functional.linear(x.to(torch.float32), weight.to(torch.float32))
    if logit_bias is not None:
        logits = logits + logit_bias.to(torch.float32)
    return logits


def deepseek_v3_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` routing.

    scores = sigmoid(logits); selection uses scores + correction bias, restricted to the ``topk_group``
    groups (of ``n_group``) whose two best biased scores sum highest; weights are the unbiased scores
    of the chosen experts, normalised to sum 1 if ``norm_topk_prob``, times ``routed_scaling_factor``.

    Args: logits [B, E] fp32; correction_bias [E] or None. Returns ids [B, K] int64, weights [B, K] fp32.
    """
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32).unsqueeze(0)
    if n_group > 1 and topk_group < n_group:
        grouped, group_score = _group_scores(choice, n_group)
        choice = _keep_groups(grouped, group_score.topk(topk_group, dim=-1).indices)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def _group_scores(choice: torch.Tensor, n_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """choice [B, E] → (its view [B, n_group, E/n_group], each group's score [B, n_group]: the sum
    of its two best selection scores)."""
    batch, experts = choice.shape
    grouped = choice.view(batch, n_group, experts // n_group)
    return grouped, grouped.topk(min(2, experts // n_group), dim=-1).values.sum(-1)


def _keep_groups(grouped: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """grouped [B, G, E/G] with the groups not in ``keep`` [B, k] set to -inf, as [B, E]."""
    group_mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=grouped.device).scatter_(1, keep, True)
    return grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).flatten(1)


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE routing: softmax over experts, top-k, optionally renormalised.

    Args: logits [B, E] fp32. Returns ids [B, K] int64, weights [B, K] fp32.
    """
    probs = logits.softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def route(
    x: torch.Tensor, router: RouterWeights, spec: MoESpec, logit_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens x [B, H] with ``spec``'s gate. Returns ids [B, K] int64, weights [B, K] fp32."""
    return route_logits(router_logits(x, router.weight, logit_bias), router, spec)


def route_logits(logits: torch.Tensor, router: RouterWeights, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` from the router's fp32 logits [B, E] (:func:`router_logits`)."""
    if spec.scoring == "sigmoid":
        return deepseek_v3_topk(
            logits,
            router.correction_bias,
            spec.top_k,
            spec.n_group,
            spec.topk_group,
            spec.routed_scaling_factor,
            spec.norm_topk_prob,
        )
    return softmax_topk(logits, spec.top_k, spec.norm_topk_prob)


def routing_margin(logits: torch.Tensor, router: RouterWeights, spec: MoESpec) -> torch.Tensor:
    """How far each token's expert choice is from flipping: the router's fp32 logits [B, E]
    (:func:`router_logits`) → [B] fp32, the gap between the k-th chosen and the best unchosen expert's
    selection score (DeepSeek: sigmoid + correction bias; Qwen: softmax probability) and, with
    group-limited routing, between the last kept and the best dropped group's score. A token within
    rounding noise of a tie may route differently under any other summation order (another GEMM
    kernel, another device) — both choices are right."""
    k = spec.top_k
    if spec.scoring != "sigmoid":
        top = logits.softmax(dim=-1).topk(min(k + 1, logits.shape[1]), dim=-1).values
        return top[:, k - 1] - top[:, k] if top.shape[1] > k else torch.full_like(top[:, 0], float("inf"))
    batch, experts = logits.shape
    scores = logits.sigmoid()
    bias = router.correction_bias
    choice = scores if bias is None else scores + bias.to(torch.float32).unsqueeze(0)
    margin = torch.full((batch,), float("inf"), device=logits.device)
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        grouped, group_score = _group_scores(choice, spec.n_group)
        ranked = group_score.topk(spec.topk_group + 1, dim=-1)
        margin = ranked.values[:, spec.topk_group - 1] - ranked.values[:, spec.topk_group]
        choice = _keep_groups(grouped, ranked.indices[:, : spec.topk_group])
    top = choice.topk(min(k + 1, experts), dim=-1).values
    if top.shape[1] > k:
        margin = torch.minimum(margin, top[:, k - 1] - top[:, k])  # (-inf past the kept groups: no margin)
    return margin


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: ids [B, K] → [E] int64."""
    return torch.bincount(ids.reshape(-1), minlength=num_experts)
