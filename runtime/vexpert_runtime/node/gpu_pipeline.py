"""The layer-ahead slot pipeline of the GPU path (used by ``benchmarks/gpu_path.py``): a worker-owned
ring of slot buffers and the coordinator's filler. The MoE layer that computes with a ring buffer is
the node's own :func:`~vexpert_runtime.model.ep_moe.ep_moe_layer` (fixed shapes, so a decode
iteration can be one CUDA graph), with the handshake in its ``slot_wait`` / ``after_compute`` hooks.

Memory (per worker): the ring holds ``R`` buffers of ``vmax`` slots; layer ``l`` of iteration ``t``
uses buffer ``(t·L + l) mod R``. With ``R = 2`` the coordinator fills layer ``l+1``'s slots while
layer ``l`` computes — the paper's pipeline — in ``2·vmax`` expert-sized slots (DeepSeek-V3 bf16,
vmax = 1: 2 × 84 MiB), plus 8 bytes of flags per buffer. The allocator's group size G only decides
how the slot *budget* is shared between layers; it does not multiply the memory.

Synchronisation is :mod:`vexpert_runtime.node.gpu_sync`: the filler's copy stream waits on the GPU for
FREE, the worker's compute stream waits on the GPU for FULL; no CPU round trip per layer.

Plan switches change only data, never shapes: the coordinator copies from other pool rows and the
worker loads the new plan into its :class:`~vexpert_runtime.model.ep_moe.DeviceRoutingTable` (the same
tensors) between replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.node.gpu_sync import FlagOps, allocate_flags, produce, ring_buffer


@dataclass
class SlotRing:
    """Worker-owned L1: ``slots`` [R, vmax, D] and ``flags`` [R, 2] int32 on the worker's device."""

    slots: torch.Tensor
    flags: torch.Tensor

    @classmethod
    def allocate(cls, ring: int, vmax: int, numel: int, dtype: torch.dtype, device: torch.device | str) -> SlotRing:
        if ring < 2 or vmax < 1:
            raise ValueError(f"need ring ≥ 2 and vmax ≥ 1, got ring={ring}, vmax={vmax}")
        slots = torch.zeros(ring, vmax, numel, dtype=dtype, device=device)
        if slots.device.type == "cpu":
            slots.share_memory_()
        flags = allocate_flags(ring, slots.device)
        return cls(slots, flags)

    @property
    def ring(self) -> int:
        return int(self.slots.shape[0])

    @property
    def nbytes(self) -> int:
        """HBM the ring takes: slots plus flags."""
        return self.slots.numel() * self.slots.element_size() + self.flags.numel() * self.flags.element_size()


class RingFiller:
    """Coordinator side for one worker: enqueue the fill of each layer's slots from the L2 pool.

    ``pool`` [P, D] is the coordinator's pinned pool; ``ring`` is the worker's :class:`SlotRing` as
    opened in this process (CUDA IPC). ``stream`` is this worker's copy stream (None on CPU).
    """

    def __init__(self, ring: SlotRing, pool: torch.Tensor, ops: FlagOps, stream: Any = None) -> None:
        self.ring = ring
        self.pool = pool
        self.ops = ops
        self.stream = stream
        self.fills = 0

    def fill(self, layer_sequence: int, rows: Sequence[int]) -> None:
        """Fill the buffer of the ``layer_sequence``-th slot use with pool rows ``rows`` (≤ vmax;
        −1 leaves a slot as it is). Returns once enqueued (GPU) or done (CPU)."""
        buffer = ring_buffer(layer_sequence, self.ring.ring)
        slots = self.ring.slots[buffer]

        def copy_in() -> None:
            for slot, row in enumerate(rows):
                if row >= 0:
                    slots[slot].copy_(self.pool[row], non_blocking=True)

        if self.stream is not None:
            with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
                produce(self.ops, self.stream, self.ring.flags, buffer, copy_in)
        else:
            produce(self.ops, None, self.ring.flags, buffer, copy_in)
        self.fills += 1
