"""Byte layout of one packed expert row, without torch (the operator sizes memory with it).

A packed expert row is what the L2 pool and the L1 slots hold per expert, one copy per fill:

* ``dense``: ``[gate (I·H) | up (I·H) | down (H·I)]`` elements of the model dtype.
* ``fp8_block`` (DeepSeek-V3/R1, Kimi-K2 checkpoints): a byte row ``[gate | up | down]`` of
  ``float8_e4m3fn`` weights, padded to 16 bytes, then their float32 ``weight_scale_inv`` block scales
  ``[gate_s | up_s | down_s]`` (gate/up ``[⌈I/bo⌉, ⌈H/bi⌉]``, down ``[⌈H/bo⌉, ⌈I/bi⌉]``), padded to 16
  bytes so every row of a stack starts aligned. A DeepSeek-V3 expert is 44.05 MB instead of 88.1 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE = "dense"
FP8_BLOCK = "fp8_block"
EXPERT_FORMATS = (DENSE, FP8_BLOCK)
DEFAULT_FP8_BLOCK = (128, 128)  # weight_block_size of every published block-FP8 MoE checkpoint
ROW_ALIGN = 16  # bytes; grouped GEMMs and vectorised copies want 16-byte-aligned rows
SCALE_BYTES = 4  # float32 weight_scale_inv
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# How a CPU rank multiplies its resident expert rows (``grouped_moe``: torch._grouped_mm over the rows, or
# oneDNN-prepacked copies of them); "auto": the faster of the two on the machine, timed at load.
CPU_EXPERT_KERNELS = ("auto", "grouped", "prepacked")


def align_up(n: int, multiple: int = ROW_ALIGN) -> int:
    return -(-n // multiple) * multiple


def blocks(n: int, block: int) -> int:
    """⌈n / block⌉: blocks covering n rows or columns (the last one may be partial)."""
    return -(-n // block)


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the ``weight_scale_inv`` of a [rows, cols] weight quantised in ``block`` tiles."""
    return blocks(rows, block[0]), blocks(cols, block[1])


@dataclass(frozen=True)
class Fp8RowLayout:
    """Byte offsets inside one ``fp8_block`` row of an expert with intermediate I and hidden H."""

    intermediate: int
    hidden: int
    block: tuple[int, int] = DEFAULT_FP8_BLOCK

    @property
    def matrix_bytes(self) -> int:
        """Bytes of one fp8 projection (I·H; gate, up and down are the same size)."""
        return self.intermediate * self.hidden

    @property
    def gate_scale_shape(self) -> tuple[int, int]:
        """Scales of gate and of up: [⌈I/bo⌉, ⌈H/bi⌉]."""
        return scale_shape(self.intermediate, self.hidden, self.block)

    @property
    def down_scale_shape(self) -> tuple[int, int]:
        """Scales of down [H, I]: [⌈H/bo⌉, ⌈I/bi⌉]."""
        return scale_shape(self.hidden, self.intermediate, self.block)

    @property
    def scales_offset(self) -> int:
        """Byte offset of the first scale (after the three fp8 matrices, 16-byte aligned)."""
        return align_up(3 * self.matrix_bytes)

    def scale_range(self, projection: str) -> tuple[int, int]:
        """[start, end) byte range of one projection's float32 scales."""
        gate = self.gate_scale_shape[0] * self.gate_scale_shape[1] * SCALE_BYTES
        down = self.down_scale_shape[0] * self.down_scale_shape[1] * SCALE_BYTES
        start = self.scales_offset + {"gate": 0, "up": gate, "down": 2 * gate}[projection]
        return start, start + (down if projection == "down" else gate)

    def matrix_range(self, projection: str) -> tuple[int, int]:
        """[start, end) byte range of one projection's fp8 weights."""
        start = {"gate": 0, "up": 1, "down": 2}[projection] * self.matrix_bytes
        return start, start + self.matrix_bytes

    @property
    def row_bytes(self) -> int:
        return align_up(self.scale_range("down")[1])


def expert_row_bytes(expert_format: str, intermediate: int, hidden: int, dense_dtype: str = "bfloat16",
                     block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> int:
    """Bytes of one packed expert row (what one slot fill copies)."""
    if expert_format == FP8_BLOCK:
        return Fp8RowLayout(intermediate, hidden, block).row_bytes
    if expert_format == DENSE:
        return 3 * intermediate * hidden * DTYPE_BYTES[dense_dtype]
    raise ValueError(f"unknown expert format {expert_format!r}; expected one of {EXPERT_FORMATS}")
