"""Single-process reference MoE forward: every expert local, no placement, no replicas.

It is the oracle the EP forward must equal (fp32: max relative error ≤ 1e-5) for any plan, and what
``vexpert demo --verify`` checks every step against. The stacked model is the demo's: a residual MoE
block per layer, ``h ← h + MoE_l(rms_norm(h))`` (attention is out of scope for this runtime).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vexpert_runtime.model.checkpoint import CheckpointReader
from vexpert_runtime.model.expert_format import w8a8_swiglu
from vexpert_runtime.model.grouped_moe import packed_views
from vexpert_runtime.model.moe_math import combine, packed_ffn, rms_norm, shared_forward
from vexpert_runtime.model.moe_spec import MoESpec
from vexpert_runtime.model.routing import expert_counts, route_logits, router_logits, routing_margin
from vexpert_runtime.model.weights import RouterWeights, SharedExpertWeights

# Largest relative error a --verify run accepts, per weight dtype (low precision accumulates
# differently in the EP split than in one process).
VERIFY_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}

# Tokens whose routing is this close to a tie in some layer (routing_margin) are left out of a
# --verify comparison: in low precision their expert choice follows the summation order (another
# GEMM kernel or device), and either choice is right. On the GPU node test's bf16 inputs, computing
# the same reference in fp32 instead of bf16 flipped tokens with margins up to 0.0025 (per-token
# errors 0.25-0.50); 0.005 leaves out ~8 % of them there (benchmarks/README.md, run 15).
VERIFY_TIE_MARGIN = {"float32": 0.0, "bfloat16": 5e-3, "float16": 1e-3}


@dataclass
class ModelWeights:
    """All MoE weights of a model in one process. experts[l]: [E, 3·I·H] dense packed rows (a
    block-FP8 checkpoint's experts dequantised exactly as the workers dequantise their rows)."""

    spec: MoESpec
    routers: list[RouterWeights]
    experts: list[torch.Tensor]
    shared: list[SharedExpertWeights | None]

    @classmethod
    def load(cls, reader: CheckpointReader, dtype: torch.dtype = torch.float32) -> ModelWeights:
        spec = reader.spec
        layers = range(spec.num_layers)
        return cls(
            spec=spec,
            routers=[reader.router(i) for i in layers],
            experts=[spec.expert_format(dtype).dense_rows(reader.experts(i, list(range(spec.num_experts)), dtype))
                     for i in layers],
            shared=[reader.shared(i, dtype) for i in layers],
        )


def reference_moe_layer(
    x: torch.Tensor, weights: ModelWeights, layer: int, logit_bias: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer on all tokens: x [B, H] → (y [B, H], expert counts [E] int64). ``logits``: the
    layer's router logits of x (:func:`~.routing.router_logits` with ``logit_bias``), if already made."""
    spec = weights.spec
    if logits is None:
        logits = router_logits(x, weights.routers[layer].weight, logit_bias)
    ids, topk_weights = route_logits(logits, weights.routers[layer], spec)
    batch, top_k = ids.shape
    outputs = x.new_zeros(batch, top_k, spec.hidden_size)
    group = spec.storage_block[1] if spec.fp8_activations and spec.storage_block else None
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        row = weights.experts[layer][expert]
        if group is None:
            outputs[token, slot] = packed_ffn(x[token], row, spec.intermediate_size, spec.hidden_size)
        else:  # W8A8 (model.expert_compute): each GEMM's activations quantised per token and block column first
            w13, w2 = packed_views(row.unsqueeze(0), spec.intermediate_size, spec.hidden_size)
            offs = torch.tensor([len(token)], dtype=torch.int32)
            outputs[token, slot] = w8a8_swiglu(x[token], w13, w2, offs, group)
    y = combine(topk_weights, outputs, shared_forward(x, weights.shared[layer]))
    return y, expert_counts(ids, spec.num_experts)


@dataclass(frozen=True)
class ReferenceOutput:
    """The reference model's output on a batch: ``h`` [B, H], expert counts [L, E] int64 and each
    token's routing margin [B] (its smallest :func:`~.routing.routing_margin` over the layers)."""

    h: torch.Tensor
    counts: torch.Tensor
    margins: torch.Tensor


def reference_outputs(x: torch.Tensor, weights: ModelWeights, logit_bias: torch.Tensor | None = None) -> ReferenceOutput:
    """The stacked model on x [B, H] (``logit_bias`` [L, E] or None is added to each layer's router
    logits), with each token's routing margin."""
    h = x
    counts = []
    margins = torch.full((x.shape[0],), float("inf"), device=x.device)
    for layer in range(weights.spec.num_layers):
        bias = None if logit_bias is None else logit_bias[layer]
        normed = rms_norm(h)
        logits = router_logits(normed, weights.routers[layer].weight, bias)
        margins = torch.minimum(margins, routing_margin(logits, weights.routers[layer], weights.spec))
        y, c = reference_moe_layer(normed, weights, layer, logits=logits)
        h = h + y
        counts.append(c)
    return ReferenceOutput(h, torch.stack(counts), margins)


def reference_forward(
    x: torch.Tensor, weights: ModelWeights, logit_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked model on x [B, H]: returns (h [B, H], expert counts [L, E] int64).

    ``logit_bias`` [L, E] (or None) is added to each layer's router logits.
    """
    out = reference_outputs(x, weights, logit_bias)
    return out.h, out.counts
