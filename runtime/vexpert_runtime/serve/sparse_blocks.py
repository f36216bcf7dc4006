"""A transformers MoE model's sparse blocks: finding them, and standing in for their routed experts.

A sparse block is any decoder ``mlp`` with a ``gate`` (router) and an ``experts`` module called as
``experts(x [T, H], top_k_index [T, K], top_k_weights [T, K])`` — transformers 5's layout for
DeepSeek-V3, Qwen3-MoE and Qwen2-MoE. Both the step model (:mod:`.hf_model`, which replaces each
block's ``experts`` with an :class:`ExecutorExperts`) and the rank-local loader (:mod:`.model_loading`,
which leaves the experts unread) ask this module which blocks those are.
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


def decoder_layers(model: Any) -> Any:
    """The decoder layers (transformers modules are typed ``Any`` here: their attributes are dynamic)."""
    return model.model.layers


def sparse_layers(model: Any) -> list[int]:
    """Decoder layer indices of the sparse MoE blocks (the checkpoint's ``moe_layers``), ascending."""
    return [i for i, layer in enumerate(decoder_layers(model)) if is_sparse_block(layer.mlp)]
