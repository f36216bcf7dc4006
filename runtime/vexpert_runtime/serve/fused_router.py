"""MoE routers on a GPU in two kernels: the logits GEMM and one selection kernel.

transformers' ``DeepseekV3TopkRouter`` casts the bf16 hidden state and gate weight to fp32 and multiplies
them on CUDA cores (an H200 at 256 tokens: ``cutlass_80_simt_sgemm``, 15 µs per layer for 8 experts —
about 32× the FLOPs at the release's 256 experts, on 58 layers), then selects experts in ~12 small
kernels (:mod:`~vexpert_runtime.model.routing_kernel`). The products of two bf16 (or fp16) numbers are
exact in fp32, so a tensor-core GEMM with fp32 accumulation and output computes the same logits up to
summation order (SGLang's ``dsv3_router_gemm`` does this); :func:`deepseek_v3_select` then does the
selection in one launch.

Qwen-MoE's routers already multiply in the model's dtype; their softmax, ``torch.topk`` and renormalisation
become one kernel (:class:`FusedSoftmaxRouter`).

:func:`fuse_model_routers` swaps each such router for its stand-in holding the same parameters and buffers
under the same names (the state dict is unchanged); the serving model does it on a CUDA device with
Triton. The output is transformers' tuple ``(logits, weights, ids)``, ids best first.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vexpert_runtime.model import routing_kernel
from vexpert_runtime.model.routing import router_logits
from vexpert_runtime.serve.sparse_blocks import decoder_layers, is_sparse_block

# transformers' routers whose forward is DeepSeek-V3's noaux_tc selection / Qwen's softmax top-k as
# :mod:`~vexpert_runtime.model.routing_kernel` computes them
_DEEPSEEK_V3_ROUTERS = frozenset({"DeepseekV3TopkRouter"})
_SOFTMAX_ROUTERS = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter"})


@functools.cache
def _mm_out_dtype_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs for ``dtype`` inputs on ``device`` (CUDA
    builds of torch ≥ 2.8 for fp16 / bf16; not on CPU)."""
    try:
        a = torch.ones((2, 8), dtype=dtype, device=device)
        return bool(torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def fp32_logits(x: torch.Tensor, weight: torch.Tensor, tensor_cores: bool) -> torch.Tensor:
    """x [T, H] @ weight [E, H]ᵀ → fp32 [T, E]: with ``tensor_cores`` (16-bit inputs where
    :func:`tensor_core_logits_run`) a GEMM with fp32 accumulation and output (the same products as in fp32:
    exact), else transformers' fp32 ``linear``."""
    if tensor_cores:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return router_logits(x, weight)


def tensor_core_logits_run(weight: torch.Tensor) -> bool:
    """Whether :func:`fp32_logits` may take the tensor-core GEMM for inputs of ``weight``'s dtype and device
    (asked once, when the router is built: never inside a graph capture)."""
    return weight.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype_runs(weight.device, weight.dtype)


class FusedDeepseekV3Router(nn.Module):
    """A ``DeepseekV3TopkRouter`` whose forward is :func:`fp32_logits` + :func:`deepseek_v3_select`; the
    router's own ``weight`` parameter and ``e_score_correction_bias`` buffer, under the same names."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, router: Any) -> None:
        super().__init__()
        self.weight = router.weight
        self.register_buffer("e_score_correction_bias", router.e_score_correction_bias)
        self.hidden_dim = int(router.hidden_dim)
        self.top_k = int(router.top_k)
        self.num_group = int(router.num_group)
        self.topk_group = int(router.topk_group)
        self.norm_topk_prob = bool(router.norm_topk_prob)
        self.routed_scaling_factor = float(router.routed_scaling_factor)
        self.tensor_cores = tensor_core_logits_run(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = hidden_states.view(-1, self.hidden_dim)
        logits = fp32_logits(x, self.weight, self.tensor_cores and x.dtype == self.weight.dtype)
        ids, weights = routing_kernel.deepseek_v3_select(
            logits, self.e_score_correction_bias, self.top_k, self.num_group, self.topk_group,
            self.routed_scaling_factor, self.norm_topk_prob)
        return logits, weights, ids


class FusedSoftmaxRouter(nn.Module):
    """A Qwen-MoE router (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``) whose selection after its logits
    GEMM (already in the model's dtype, as transformers') is :func:`softmax_topk_select`; the router's
    own ``weight`` parameter."""

    def __init__(self, router: Any) -> None:
        super().__init__()
        self.weight = router.weight
        self.hidden_dim = int(router.hidden_dim)
        self.top_k = int(router.top_k)
        self.norm_topk_prob = bool(router.norm_topk_prob)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        ids, weights = routing_kernel.softmax_topk_select(logits, self.top_k, self.norm_topk_prob, logits.dtype)
        return logits, weights, ids


FusedRouter = FusedDeepseekV3Router | FusedSoftmaxRouter


def stand_in_for(router: Any) -> FusedRouter | None:
    """The fused stand-in for ``router``, or None where the kernel does not take it (another router class,
    or a DeepSeek-V3 routing :func:`~vexpert_runtime.model.routing_kernel.supports` refuses)."""
    name = type(router).__name__
    if name in _SOFTMAX_ROUTERS:
        return FusedSoftmaxRouter(router)
    if name in _DEEPSEEK_V3_ROUTERS and routing_kernel.supports(
            int(router.weight.shape[0]), int(router.num_group), int(router.topk_group), int(router.top_k)):
        return FusedDeepseekV3Router(router)
    return None


def fuse_model_routers(model: Any) -> int:
    """Swap every sparse block's router for its fused stand-in (:func:`stand_in_for`) in place; returns how many
    (0 where Triton is absent)."""
    if not routing_kernel.available():
        return 0
    count = 0
    for layer in decoder_layers(model):
        if is_sparse_block(layer.mlp) and (stand_in := stand_in_for(layer.mlp.gate)) is not None:
            layer.mlp.gate = stand_in
            count += 1
    return count
