"""FP8 numbers shared by expert rows and activations: e4m3's dtype and range, the per-token-group quantisation
of activations that W8A8 expert GEMMs multiply (``model.expert_compute: w8a8``), and the wire rows that carry
quantised activations through the dispatch all-to-all (each row its FP8 values, then its float32 scales, as
bytes: DeepEP's FP8 dispatch). Pure torch, no other import of this package: the Triton kernel's caller, the CPU
twin and the reference all quantise with these functions.
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
    wide = x.to(torch.float32)
    if cols % group == 0:  # whole groups (DeepSeek-V3's widths): one view of tiles
        tiles = wide.view(rows, cols // group, group)
        scale = tiles.abs().amax(dim=2).clamp(min=1e-12) / FP8_MAX
        return (tiles / scale[:, :, None]).to(FP8_DTYPE).view(rows, cols), scale
    # A partial last group, group by group: inductor (CPU, torch 2.13) compiled the padded-tile, indexed and
    # repeat_interleave forms into reads of garbage here (benchmarks/inductor_partial_group.py)
    parts = _column_groups(wide, group)
    scale = torch.stack([part.abs().amax(dim=1) for part in parts], dim=1).clamp(min=1e-12) / FP8_MAX
    return torch.cat([(part / scale[:, i, None]).to(FP8_DTYPE) for i, part in enumerate(parts)], dim=1), scale


def _column_groups(x: torch.Tensor, group: int) -> list[torch.Tensor]:
    """x [M, K]'s column groups of ``group`` (the last may be partial), as views."""
    return [x[:, start:start + group] for start in range(0, x.shape[1], group)]


def fp8_activation_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] quantised as :func:`quantize_activation_groups` does and dequantised, in x's dtype: the
    activations a W8A8 GEMM multiplies."""
    quantised, scale = quantize_activation_groups(x, group)
    return dequantize_activation_groups(quantised, scale, group, x.dtype)


def _values_bytes(cols: int) -> int:
    """A wire row's bytes before its scales: ``cols`` FP8 values padded to 4 bytes (float32-aligned scales)."""
    return -(-cols // 4) * 4


def wire_row_bytes(cols: int, group: int) -> int:
    """Bytes of one wire row of ``cols`` quantised activations: the FP8 values padded to 4 bytes (so the scales
    after them are float32-aligned), then ⌈cols/group⌉ float32 scales."""
    return _values_bytes(cols) + 4 * -(-cols // group)


def pack_wire_rows(quantised: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(fp8 [M, K], float32 scales [M, G]) → uint8 wire rows [M, :func:`wire_row_bytes`]: one tensor, so the
    dispatch moves, gathers and exchanges a token's quantised activations as one row (half a bf16 row's bytes
    and G·4 more)."""
    rows, cols = quantised.shape
    padded = _values_bytes(cols)
    wire = quantised.new_zeros(rows, padded + 4 * scales.shape[1], dtype=torch.uint8)
    wire[:, :cols] = quantised.view(torch.uint8)
    wire[:, padded:] = scales.to(torch.float32).contiguous().view(torch.uint8)
    return wire


def unpack_wire_rows(wire: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy) of wire rows [M, B] uint8 (:func:`pack_wire_rows`, any row stride that keeps float32
    alignment): (fp8 [M, cols], float32 scales [M, G])."""
    padded = _values_bytes(cols)
    if wire.dtype != torch.uint8 or wire.stride(-1) != 1 or wire.stride(0) % 4 or wire.storage_offset() % 4:
        raise ValueError(f"wire rows must be uint8 [M, B] with 4-byte-aligned rows, got {wire.dtype} "
                         f"{tuple(wire.shape)} strides {wire.stride()} offset {wire.storage_offset()}")
    return wire[:, :cols].view(FP8_DTYPE), wire[:, padded:].view(torch.float32)


def dequantize_activation_groups(quantised: torch.Tensor, scales: torch.Tensor, group: int,
                                 dtype: torch.dtype) -> torch.Tensor:
    """fp8 [M, K] · float32 scales [M, ⌈K/group⌉] in float32, cast to ``dtype``: what
    :func:`fp8_activation_round_trip` returns for the rows these were quantised from (whole groups as tiles, a
    partial one group by group, as :func:`quantize_activation_groups` does, for its reason)."""
    rows, cols = quantised.shape
    if cols % group == 0:
        tiles = quantised.to(torch.float32).view(rows, cols // group, group) * scales[:, :, None]
        return tiles.view(rows, cols).to(dtype)
    parts = _column_groups(quantised, group)
    return torch.cat([part.to(torch.float32) * scales[:, i, None] for i, part in enumerate(parts)], dim=1).to(dtype)


def quantized_wire_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] quantised per row and ``group`` columns (:func:`quantize_activation_groups`) as wire rows
    (:func:`pack_wire_rows`): what a W8A8 rank sends the dispatch all-to-all."""
    return pack_wire_rows(*quantize_activation_groups(x, group))
