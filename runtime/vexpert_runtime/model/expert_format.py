"""Expert storage formats: how a packed expert row is built from checkpoint tensors and how compute
reads it (layouts in :mod:`~vexpert_runtime.model.expert_layout`).

The pool, the slots and every copy between them move rows in the *storage* format; compute always
runs in the model's compute dtype. For ``dense`` rows the weights are views of the row (no copy);
for ``fp8_block`` rows a GPU's grouped GEMM reads the fp8 weights and their scales in place
(:meth:`ExpertFormat.fp8_stack`, :mod:`~vexpert_runtime.model.grouped_gemm_kernel`); elsewhere they are
dequantised on use (``fp8 · scale_inv`` broadcast over its block) into a scratch stack of the compute
dtype that the grouped GEMM or the per-expert loop reads.

Shapes: ``I`` intermediate, ``H`` hidden, ``E`` rows in a stack, ``D`` row elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vexpert_runtime.model.expert_layout import DENSE, FP8_BLOCK, Fp8RowLayout, scale_shape
from vexpert_runtime.model.fp8_activations import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_activation_groups,
    fp8_activation_round_trip,
)
from vexpert_runtime.model.grouped_moe import packed_views, swiglu_loop
from vexpert_runtime.model.moe_math import expert_ffn


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    """``weight`` [..., R, C] fp8 times ``scale_inv`` [..., ⌈R/bo⌉, ⌈C/bi⌉] broadcast over its
    bo×bi blocks (the last block row/column may be partial) → [..., R, C] of ``dtype``.

    The product is taken in float32, as the checkpoint's own reference dequantiser does, then cast.
    """
    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float32)
    if rows % block[0] == 0 and cols % block[1] == 0:
        # Whole blocks (DeepSeek-V3's shapes): broadcast each scale over its tile, no expanded copy.
        tiles = weight.unflatten(-1, (cols // block[1], block[1])).unflatten(-3, (rows // block[0], block[0]))
        product = tiles.to(torch.float32) * scale[..., :, None, :, None]
        return product.to(dtype).flatten(-2).flatten(-3, -2)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 quantisation (what DeepSeek's converter does): [R, C] float →
    (fp8 [R, C], float32 scale_inv [⌈R/bo⌉, ⌈C/bi⌉]) with ``fp8 · scale_inv ≈ weight``."""
    rows, cols = weight.shape
    nr, nc = scale_shape(rows, cols, block)
    padded = weight.new_zeros(nr * block[0], nc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    tiles = padded.view(nr, block[0], nc, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantised = (tiles / scale[:, None, :, None]).to(FP8_DTYPE).view(nr * block[0], nc * block[1])
    return quantised[:rows, :cols].contiguous(), scale


def w8a8_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, group: int,
                x_scales: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of x [M, H]'s expert groups (ends ``offs``) over dequantised weights (w13 [E, 2I, H], w2 [E, H, I]),
    each GEMM's activations quantised per row and ``group`` columns first (:func:`fp8_activation_round_trip`):
    what the W8A8 grouped GEMM computes, one expert at a time — the CPU ranks' path (no FP8 tensor cores there:
    the same numbers, no speed-up) and the kernel's twin. ``x_scales`` [M, ⌈H/group⌉]: x arrives quantised
    (fp8, the dispatch's wire rows) and is only dequantised. Rows past offs[-1] are zero; the result is w13's dtype."""
    def quantised_linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(fp8_activation_round_trip(a, group), w)

    if x_scales is None:
        return swiglu_loop(x, w13, w2, offs, w2.shape[-1], quantised_linear)
    x = dequantize_activation_groups(x, x_scales, group, w13.dtype)
    return swiglu_loop(x, w13, w2, offs, w2.shape[-1], torch.nn.functional.linear, quantised_linear)


@dataclass(frozen=True)
class Fp8Stack:
    """A stack of block-FP8 expert rows as views a grouped GEMM reads in place (:meth:`ExpertFormat.fp8_stack`):
    ``w13`` [E, 2I, H] and ``w2`` [E, H, I] float8_e4m3fn; ``s13`` [E, 2·⌈I/bo⌉, ⌈H/bi⌉] (gate's scale rows,
    then up's) and ``s2`` [E, ⌈H/bo⌉, ⌈I/bi⌉] float32; ``block`` (bo, bi)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    block: tuple[int, int]


@dataclass(frozen=True)
class ExpertFormat:
    """How one model's packed expert rows are stored and read.

    ``fp8_block`` None: dense rows of ``compute_dtype`` [3·I·H]; else uint8 rows of
    :class:`~vexpert_runtime.model.expert_layout.Fp8RowLayout` with that weight block size, multiplied
    against activations of ``compute_dtype`` (W8A16) or, ``fp8_activations``, against activations quantised
    to FP8 per row and block column (W8A8, ``model.expert_compute``).
    """

    intermediate: int
    hidden: int
    compute_dtype: torch.dtype
    fp8_block: tuple[int, int] | None = None
    fp8_activations: bool = False

    @property
    def name(self) -> str:
        return DENSE if self.fp8_block is None else FP8_BLOCK

    @property
    def layout(self) -> Fp8RowLayout:
        if self.fp8_block is None:
            raise ValueError("dense rows have no FP8 layout")
        return Fp8RowLayout(self.intermediate, self.hidden, self.fp8_block)

    @property
    def row_dtype(self) -> torch.dtype:
        """Element type the pool, slots and transport allocate."""
        return self.compute_dtype if self.fp8_block is None else torch.uint8

    @property
    def row_numel(self) -> int:
        """D: elements of one packed row."""
        return 3 * self.intermediate * self.hidden if self.fp8_block is None else self.layout.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.row_numel * torch.empty((), dtype=self.row_dtype).element_size()

    # -- building rows ---------------------------------------------------------------------------

    def pack_fp8(self, weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> torch.Tensor:
        """One uint8 row [D] from the checkpoint's fp8 ``weights`` (gate/up [I, H], down [H, I]) and
        their float32 ``scales`` (``weight_scale_inv``), keyed by projection name."""
        layout = self.layout
        row = torch.zeros(layout.row_bytes, dtype=torch.uint8)
        for proj in ("gate", "up", "down"):
            start, end = layout.matrix_range(proj)
            row[start:end] = weights[proj].contiguous().view(torch.uint8).reshape(-1)
            start, end = layout.scale_range(proj)
            row[start:end] = scales[proj].to(torch.float32).contiguous().view(torch.uint8).reshape(-1)
        return row

    # -- reading rows ----------------------------------------------------------------------------

    def _fp8_matrix(self, rows: torch.Tensor, proj: str) -> torch.Tensor:
        """fp8 weights [E, I, H] (gate/up) or [E, H, I] (down): a view into rows [E, D] uint8."""
        start, end = self.layout.matrix_range(proj)
        shape = (self.hidden, self.intermediate) if proj == "down" else (self.intermediate, self.hidden)
        return rows[:, start:end].view(FP8_DTYPE).unflatten(1, shape)

    def _scales(self, rows: torch.Tensor, proj: str) -> torch.Tensor:
        """float32 scales [E, ⌈·/bo⌉, ⌈·/bi⌉] of one projection (a copy: rows may be any stride)."""
        start, end = self.layout.scale_range(proj)
        layout = self.layout
        shape = layout.down_scale_shape if proj == "down" else layout.gate_scale_shape
        # .contiguous() first: viewing bytes as float32 needs a 4-byte-aligned, dense last dim.
        return rows[:, start:end].contiguous().view(torch.float32).unflatten(1, shape)

    def fp8_stack(self, rows: torch.Tensor) -> Fp8Stack | None:
        """Views (no copy) of a stack of FP8 rows [E, D] as a kernel reads them in place: the fp8 weights
        and their float32 scales (gate's then up's, as the rows store them). None where the rows'
        strides or alignment leave the scales no float32 view (a kernel then takes :meth:`stack_weights`)."""
        layout = self.layout
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(-1) != 1 or rows.stride(0) % 4 \
                or rows.storage_offset() % 4:
            return None
        si, sk = layout.gate_scale_shape
        start, end = layout.scale_range("gate")[0], layout.scale_range("up")[1]
        s13 = rows[:, start:end].view(torch.float32).unflatten(1, (2 * si, sk))
        start, end = layout.scale_range("down")
        s2 = rows[:, start:end].view(torch.float32).unflatten(1, layout.down_scale_shape)
        w13 = rows[:, : 2 * layout.matrix_bytes].view(FP8_DTYPE).unflatten(1, (2 * self.intermediate, self.hidden))
        return Fp8Stack(w13, s13, self._fp8_matrix(rows, "down"), s2, layout.block)

    def dequantized(self, rows: torch.Tensor, proj: str) -> torch.Tensor:
        """One projection of every row [E, D] in the compute dtype: [E, I, H] or [E, H, I]."""
        assert self.fp8_block is not None
        return dequantize_fp8_block(self._fp8_matrix(rows, proj), self._scales(rows, proj), self.fp8_block,
                                    self.compute_dtype)

    def stack_weights(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) of rows [E, D] in the compute dtype, what
        :func:`~vexpert_runtime.model.grouped_moe.grouped_swiglu` takes. Dense: views (no copy); FP8: a
        dequantised scratch stack (gate and up dequantised separately: with I not a multiple of the
        block their scale grids do not tile [2I, H])."""
        if self.fp8_block is None:
            return packed_views(rows, self.intermediate, self.hidden)
        w13 = torch.cat([self.dequantized(rows, "gate"), self.dequantized(rows, "up")], dim=1)
        return w13, self.dequantized(rows, "down")

    def weights(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) of one row [D] in the compute dtype."""
        w13, w2 = self.stack_weights(row.unsqueeze(0))
        return w13[0, : self.intermediate], w13[0, self.intermediate :], w2[0]

    def ffn(self, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """SwiGLU of tokens x [T, H] through the expert in ``row`` [D] → [T, H]."""
        return expert_ffn(x, *self.weights(row))

    def dense_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [E, D] as dense packed rows [E, 3·I·H] of the compute dtype (the reference's view)."""
        if self.fp8_block is None:
            return rows.to(self.compute_dtype)
        w13, w2 = self.stack_weights(rows)
        return torch.cat([w13.flatten(1), w2.flatten(1)], dim=1)

