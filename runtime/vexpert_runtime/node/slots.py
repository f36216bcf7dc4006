"""L1 vExpert slots (workers): per worker one buffer of ``S = G·vmax`` expert slots — the paper's L1
memory — with the handshake flags that guard them.

Layer ``l`` of iteration ``t`` is the *layer sequence* ``q = t·L + l``: the coordinator fills layer
``l``'s slots while the worker computes layer ``l − 1``. The allocator lays adjacent layers out on
disjoint slots (even layers from slot 0 up, odd layers from slot S − 1 down, ``V_l + V_{l+1} ≤ S``),
so the fill of the next layer never waits for the current one.

Flags (``[L, 2]`` int32, one row per MoE layer, columns :data:`FREE` and :data:`FULL`)::

    coordinator, per layer fill:   wait FREE == 1 · FREE ← 0 · copy experts in · FULL ← 1
    worker, per layer:             wait FULL == 1 · FULL ← 0 · compute with the slots · FREE ← 1

Every wait compares with a constant and every write stores a constant, so on a GPU both sides are
stream operations (no CPU round trip) and a worker's side can be captured in a CUDA graph. Progress
(``[1, 2]`` int32, :data:`STARTED` and :data:`DONE`) counts the layers of the current iteration
whose FULL flag was consumed and whose slot compute finished: what a worker's watchdog reads to know
which layer a stalled GPU waits for.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from vexpert_runtime.node.gpu_sync import FREE, FULL

STARTED, DONE = 0, 1

__all__ = ["DONE", "FREE", "FULL", "STARTED", "SlotBuffers", "SlotLayout", "row_checksum", "sequence"]


@dataclass(frozen=True)
class SlotLayout:
    """Shape of one worker's slot buffer."""

    slots: int  # S = G·vmax
    numel: int  # D, elements per packed expert
    dtype: torch.dtype

    @property
    def bytes_per_worker(self) -> int:
        """Memory of one worker's slots: S · D · itemsize (the flags add 8 bytes per layer)."""
        return self.slots * self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class SlotBuffers:
    """One worker's L1: ``slots`` [S, D], ``flags`` [L, 2] int32 (FREE, FULL per layer) and
    ``progress`` [1, 2] int32 (STARTED, DONE layers of the current iteration), on one device."""

    slots: torch.Tensor
    flags: torch.Tensor
    progress: torch.Tensor

    @classmethod
    def zeros(cls, slots: int, numel: int, dtype: torch.dtype, layers: int, device: torch.device | str) -> SlotBuffers:
        flags = torch.zeros(layers, 2, dtype=torch.int32, device=device)
        flags[:, FREE] = 1
        return cls(
            torch.zeros(max(slots, 1), numel, dtype=dtype, device=device),
            flags,
            torch.zeros(1, 2, dtype=torch.int32, device=device),
        )

    def share_memory_(self) -> SlotBuffers:
        for tensor in (self.slots, self.flags, self.progress):
            tensor.share_memory_()
        return self

    @property
    def nbytes(self) -> int:
        """Device memory of the slots, flags and progress counters."""
        return sum(t.numel() * t.element_size() for t in (self.slots, self.flags, self.progress))


def sequence(iteration: int, layer: int, num_layers: int) -> int:
    """Global layer sequence number of layer ``layer`` in ``iteration``."""
    return iteration * num_layers + layer


def row_checksum(row: torch.Tensor) -> str:
    """Content hash of one packed expert (bit-exact; what the checksum tests compare)."""
    data = row.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()
