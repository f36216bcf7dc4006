"""The layer-ahead slot pipeline of the GPU path: a worker-owned ring of slot buffers, the
coordinator's filler, and a worker's MoE layer with static shapes (so a decode iteration can be one
CUDA graph).

Memory (per worker): the ring holds ``R`` buffers of ``vmax`` slots; layer ``l`` of iteration ``t``
uses buffer ``(t·L + l) mod R``. With ``R = 2`` the coordinator fills layer ``l+1``'s slots while
layer ``l`` computes — the paper's pipeline — in ``2·vmax`` expert-sized slots (DeepSeek-V3 bf16,
vmax = 1: 2 × 84 MiB), plus 8 bytes of flags per buffer. The allocator's group size G only decides
how the slot *budget* is shared between layers; it does not multiply the memory.

Synchronisation is :mod:`vexpert_runtime.node.gpu_sync`: the filler's copy stream waits on the GPU for
FREE, the worker's compute stream waits on the GPU for FULL; no CPU round trip per layer.

Plan switches change only data, never shapes: the coordinator copies from other pool rows and the
worker copies a new routing (:class:`StaticRouting`) into the same tensors between replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.model.grouped_moe import GROUP_ALIGN, group_layout, grouped_swiglu, packed_views
from vexpert_runtime.node.gpu_sync import FlagOps, acquire, allocate_flags, produce, release, ring_buffer


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


@dataclass
class StaticRouting:
    """One layer's routing on one worker in fixed-shape tensors (graph-capturable).

    Pairs (token, expert) routed here are laid out expert-sorted and group-padded: ``base_gather``
    [Cb] token row of each base-buffer row (padding → the zero row T), ``base_offs`` [E_local] int32
    group ends; likewise ``slot_gather`` [Cs] / ``slot_offs`` [vmax]. ``base_weight`` [Cb] /
    ``slot_weight`` [Cs] combine weights (0 on padding).
    """

    base_gather: torch.Tensor
    base_offs: torch.Tensor
    base_weight: torch.Tensor
    slot_gather: torch.Tensor
    slot_offs: torch.Tensor
    slot_weight: torch.Tensor
    pad: int  # index of the zero row appended to the tokens (= tokens)

    @classmethod
    def empty(cls, base_capacity: int, slot_capacity: int, local_experts: int, vmax: int, tokens: int,
              device: torch.device | str) -> StaticRouting:
        def idx(n: int) -> torch.Tensor:
            return torch.full((n,), tokens, dtype=torch.int64, device=device)

        return cls(idx(base_capacity), torch.zeros(local_experts, dtype=torch.int32, device=device),
                   torch.zeros(base_capacity, device=device), idx(slot_capacity),
                   torch.zeros(vmax, dtype=torch.int32, device=device), torch.zeros(slot_capacity, device=device),
                   tokens)

    def load(self, token: torch.Tensor, local: torch.Tensor, weight: torch.Tensor, local_experts: int) -> None:
        """Write a new routing into the same tensors (a plan switch: data only, no new shapes).

        Args: token [P] int64 token row of each pair; local [P] int64 local index (base experts
        0..E_local−1, then slots); weight [P] float combine weight.
        """
        vmax = self.slot_offs.numel()
        is_slot = local >= local_experts
        staged = []
        # Build both halves before writing either: a plan that does not fit raises with the
        # routing untouched (a half-written one would compute some pairs twice and others never).
        for gather, offs, weights, mask, shift, groups in (
            (self.base_gather, self.base_offs, self.base_weight, ~is_slot, 0, local_experts),
            (self.slot_gather, self.slot_offs, self.slot_weight, is_slot, local_experts, vmax),
        ):
            pos, ends = group_layout((local[mask] - shift).to(gather.device), groups, capacity=gather.numel())
            new_gather = torch.full_like(gather, self.pad)
            new_gather[pos] = token[mask].to(gather.device)
            new_weight = torch.zeros_like(weights)
            new_weight[pos] = weight[mask].to(weights.device, weights.dtype)
            staged.append(((gather, new_gather), (weights, new_weight), (offs, ends)))
        for pairs in staged:
            for target, value in pairs:
                target.copy_(value, non_blocking=True)

    def assign(self, other: StaticRouting) -> None:
        """Take ``other``'s routing (same capacities) into these tensors: a plan switch between replays."""
        for name in ("base_gather", "base_offs", "base_weight", "slot_gather", "slot_offs", "slot_weight"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


def moe_layer(x: torch.Tensor, base_rows: torch.Tensor, ring: SlotRing, buffer: int, route: StaticRouting,
              intermediate: int, hidden: int, ops: FlagOps | None, stream: Any, out: torch.Tensor) -> torch.Tensor:
    """One MoE layer on one worker with fixed shapes: base experts, then the slot buffer once FULL.

    Args:
        x: [T + 1, H] tokens routed here (last row zero: the padding row).
        base_rows: [E_local, D] resident experts.
        ring / buffer: the slot ring and this layer's buffer.
        route: this layer's :class:`StaticRouting`.
        ops / stream: flag operations (None: slots are pre-filled, no handshake) and the stream they
            are ordered on (None: the current one, which is what graph capture needs).
        out: [T + 1, H] written with Σ weight · expert(x) (row T garbage-free: weight 0).
    """
    w13, w2 = packed_views(base_rows, intermediate, hidden)
    y_base = grouped_swiglu(x[route.base_gather], w13, w2, route.base_offs)
    if ops is not None:
        acquire(ops, stream, ring.flags, buffer)  # the base experts ran while the slot was landing
    s13, s2 = packed_views(ring.slots[buffer], intermediate, hidden)
    y_slot = grouped_swiglu(x[route.slot_gather], s13, s2, route.slot_offs)
    if ops is not None:
        release(ops, stream, ring.flags, buffer)
    out.zero_()
    out.index_add_(0, route.base_gather, y_base * route.base_weight.unsqueeze(1).to(y_base.dtype))
    out.index_add_(0, route.slot_gather, y_slot * route.slot_weight.unsqueeze(1).to(y_slot.dtype))
    return out


def capacity_for(pairs: int, groups: int, align: int = GROUP_ALIGN) -> int:
    """Rows a group-padded buffer needs for ``pairs`` pairs over ``groups`` groups (worst case)."""
    return pairs + groups * (align - 1)
