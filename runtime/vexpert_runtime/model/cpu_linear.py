"""fp32 linear layers on the CPU through oneDNN instead of the BLAS ``F.linear`` calls.

A CPU worker's step is mostly small-M fp32 GEMMs: the attention projections over a batch of
16–512 tokens, the experts' SwiGLU over a few rows each. ATen sends an fp32 ``F.linear`` to its
BLAS (MKL in the PyTorch wheels), which on this project's CI kind of machine (an AVX-512 AMD EPYC)
ran them at half the speed of oneDNN's JIT kernels. Measured with ``benchmarks/cpu_linear.py``
(torch 2.13 CPU, one thread; ``benchmarks/results/cpu_linear/``):

* ``[48, 512] × [512, 512]ᵀ``: BLAS 277 µs, oneDNN 146 µs; 128 rows 702 vs 327 µs;
* a whole iteration of the compare checkpoint (Qwen3-MoE, 4 layers, hidden 512, 32 experts
  top-4) on one rank, interleaved A/B: a 4 × 64-token prefill 94.5 → 69.8 ms (1.35×); a
  16-sequence decode 31.5 → 30.4 ms (its expert GEMMs have ~2 rows each: no gain there).

The BLAS stays where it is cheaper — fewer than :data:`MIN_ROWS` rows, or fewer than
:data:`MIN_OUT_FEATURES` output features (oneDNN's fixed cost per call, ~12 µs, shows there).

The op is ``torch.ops.mkldnn._linear_pointwise`` — what inductor emits for a CPU linear — over
the plain weight (no prepacked copy, so no extra memory and the expert slots the coordinator
rewrites stay valid). Where oneDNN is not built in, for other dtypes and devices, and inside
``torch.compile`` (inductor picks its own kernels there), this is ``F.linear``.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

# Below these sizes the BLAS call is cheaper (oneDNN's ~12 µs fixed cost per call shows): one row of
# 512 × 512 15 vs 27 µs, 16 rows of the 32 × 512 router 8.5 vs 17 µs (benchmarks/cpu_linear.py).
MIN_ROWS = 16
MIN_OUT_FEATURES = 128


@functools.cache
def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_runs(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` sends a product with ``weight`` to oneDNN (fp32 on the CPU)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [N, K], bias [N] or None → [..., N]."""
    # Inside torch.compile inductor chooses the kernel (its lowering of this op wants a frozen weight).
    if (not torch.compiler.is_compiling() and x.dtype == torch.float32 and weight.shape[0] >= MIN_OUT_FEATURES
            and x.numel() >= MIN_ROWS * x.shape[-1] and onednn_runs(weight)):
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def route_linears_to_onednn(model: nn.Module) -> int:
    """Make every fp32 CPU ``nn.Linear`` of ``model`` compute through :func:`linear` (its ``forward``
    replaced on the instance; weights and state dict unchanged). Returns how many. Inference only:
    the oneDNN op has no backward."""
    if not _onednn_available():
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear and onednn_runs(module.weight):
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
            routed += 1
    return routed

