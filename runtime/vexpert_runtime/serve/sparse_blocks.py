"""A transformers MoE model's sparse blocks: finding them, and standing in for their routed experts.

A sparse block is any decoder ``mlp`` with a ``gate`` (router) and an ``experts`` module called as
``experts(x [T, H], top_k_index [T, K], top_k_weights [T, K])`` — transformers 5's layout for
DeepSeek-V3, Qwen3-MoE and Qwen2-MoE. Both the step model (:mod:`.hf_model`, which replaces each
block's ``experts`` with an :class:`ExecutorExperts`) and the rank-local loader (:mod:`.model_loading`,
which leaves the experts unread) ask this module which blocks those are.

The step model runs a block through :func:`sparse_block_parts` rather than the block's own ``forward``: the
routed and shared experts' outputs, which its compiled residual add sums in transformers' order, with the shared
expert free to run on a side CUDA stream beside the router and the routed experts (SGLang's dual-stream MoE does
this for DeepSeek's shared experts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# (MoE layer index, x [T, H], top-k ids [T, K], top-k weights [T, K]) → routed experts' output [T, H]
RoutedExperts = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExecutorExperts(nn.Module):
    """Stands in for a sparse block's ``experts``: the block's forward calls it with its router's
    output, and it hands the batch to ``route`` (the step model's current executor)."""

    def __init__(self, route: RoutedExperts, moe_layer: int) -> None:
        super().__init__()
        self._route = route  # a plain callable: nn.Module registers only modules and tensors
        self.moe_layer = moe_layer

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self._route(self.moe_layer, x, top_k_index, top_k_weights)


def is_sparse_block(mlp: Any) -> bool:
    """Whether a decoder layer's ``mlp`` is a routed MoE block (router ``gate`` + fused ``experts``)."""
    experts = getattr(mlp, "experts", None)
    return (isinstance(getattr(mlp, "gate", None), nn.Module) and isinstance(experts, nn.Module)
            and (hasattr(experts, "gate_up_proj") or isinstance(experts, ExecutorExperts)))


# Above this many tokens the routed experts' GEMMs fill the GPU on their own, and the shared expert gains
# nothing from a stream of its own (SGLang's DUAL_STREAM_TOKEN_THRESHOLD for DeepSeek's MoE is the same).
SIDE_STREAM_MAX_TOKENS = 1024


def shared_expert(block: Any) -> tuple[Any, Any]:
    """A sparse block's (shared expert, its sigmoid gate): DeepSeek-V3 (``shared_experts``, no gate),
    Qwen2-MoE (``shared_expert`` and ``shared_expert_gate``), or (None, None) where there is none (Qwen3-MoE)."""
    module = getattr(block, "shared_experts", None)
    if module is None:
        module = getattr(block, "shared_expert", None)
    return module, getattr(block, "shared_expert_gate", None) if module is not None else None


def shared_expert_output(block: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The block's shared expert over x [T, H] — Qwen2-MoE's scaled by its sigmoid gate — as transformers'
    forward computes it; None for a block without one."""
    module, gate = shared_expert(block)
    if module is None:
        return None
    out: torch.Tensor = module(x)
    return out if gate is None else torch.sigmoid(gate(x)) * out


def sparse_block_parts(block: Any, x: torch.Tensor, side_stream: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block's routed experts' output over x [T, H] (router ``gate``, then ``experts``) and its shared expert's
    (None without one), both ready on the current stream: transformers' block output is their sum, in that order
    (the step model adds them inside its compiled residual add, :func:`~.hf_model.add_and_norm`: one kernel
    fewer). With ``side_stream`` (a CUDA stream; inside a graph capture too, as a fork joined before returning)
    and at most :data:`SIDE_STREAM_MAX_TOKENS` tokens, the shared expert's GEMMs run there while the router and
    the EP layer's small kernels, which leave most SMs idle, run on the current stream."""
    overlap = (side_stream is not None and x.shape[0] <= SIDE_STREAM_MAX_TOKENS
               and shared_expert(block)[0] is not None)
    if overlap:
        current = torch.cuda.current_stream(x.device)
        side_stream.wait_stream(current)  # x is written on the current stream
        with torch.cuda.stream(side_stream):
            shared = shared_expert_output(block, x)
    else:
        shared = shared_expert_output(block, x)
    _, weights, ids = block.gate(x)
    routed: torch.Tensor = block.experts(x, ids, weights)
    if overlap:
        current.wait_stream(side_stream)  # the join: the sum reads the shared expert's output
    return routed, shared


def decoder_layers(model: Any) -> Any:
    """The decoder layers (transformers modules are typed ``Any`` here: their attributes are dynamic)."""
    return model.model.layers


def sparse_layers(model: Any) -> list[int]:
    """Decoder layer indices of the sparse MoE blocks (the checkpoint's ``moe_layers``), ascending."""
    return [i for i, layer in enumerate(decoder_layers(model)) if is_sparse_block(layer.mlp)]
