"""FP8 numbers shared by expert rows and activations: e4m3's dtype and range, and the per-token-group quantisation
of activations that W8A8 expert GEMMs multiply (``model.expert_compute: w8a8``). Pure torch, no other import of
this package: the Triton kernel's caller, the CPU twin and the reference all quantise with these functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


ActivationQuantizer = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (x, group) → (fp8, scales)


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantisation of activations (DeepSeek-V3's ``activation_scheme: dynamic``, its
    ``act_quant``; vLLM's ``per_token_group_quant_fp8``): x [M, K] → (fp8 [M, K], float32 scales
    [M, ⌈K/group⌉]) with ``q · scale ≈ x`` per row and ``group`` columns, scale = amax / 448. Torch ops only,
    so a GPU rank and its CPU twin quantise alike (IEEE division and round-to-nearest-even on both)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    wide = x.to(torch.float32)
    if cols % group:
        wide = torch.nn.functional.pad(wide, (0, groups * group - cols))
    tiles = wide.view(rows, groups, group)
    scale = tiles.abs().amax(dim=2).clamp(min=1e-12) / FP8_MAX
    quantised = (tiles / scale[:, :, None]).to(FP8_DTYPE).view(rows, groups * group)
    return quantised[:, :cols], scale


def fp8_activation_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] quantised as :func:`quantize_activation_groups` does and dequantised, in x's dtype: the
    activations a W8A8 GEMM multiplies."""
    quantised, scale = quantize_activation_groups(x, group)
    cols = x.shape[1]
    wide = quantised.to(torch.float32) * scale.repeat_interleave(group, dim=1)[:, :cols]
    return wide.to(x.dtype)
