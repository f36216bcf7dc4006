"""L1 vExpert slots (workers): per worker a ping-pong buffer ``[2, S, D]`` with ``S = G·vmax``
slots per buffer and ``D = 3·I·H`` (one packed expert per slot).

Group ``j`` of iteration ``t`` (layers ``jG .. jG+G−1``) is sequence ``q = t·⌈L/G⌉ + j`` and uses
buffer ``q mod 2``: while the workers compute from one buffer the coordinator fills the other. Layers
of a group use disjoint slot indices (the allocator's ``slot_expert`` layout).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .transport import BUFFERS


@dataclass(frozen=True)
class SlotLayout:
    """Shape of one worker's slot buffers."""

    slots: int  # S = G·vmax per buffer
    numel: int  # D, elements per packed expert
    dtype: torch.dtype

    @property
    def bytes_per_worker(self) -> int:
        """Memory of one worker's two buffers: 2 · S · D · itemsize."""
        return BUFFERS * self.slots * self.numel * torch.empty((), dtype=self.dtype).element_size()


def sequence(iteration: int, group: int, num_groups: int) -> int:
    """Global sequence number of a (iteration, group) fill."""
    return iteration * num_groups + group


def buffer_of(seq: int) -> int:
    """Ping-pong buffer used by sequence ``seq``."""
    return seq % BUFFERS


def group_layers(num_layers: int, group_size: int) -> list[list[int]]:
    """Layers of each group: [[0..G−1], [G..2G−1], ...] (the last group may be shorter)."""
    return [list(range(start, min(start + group_size, num_layers))) for start in range(0, num_layers, group_size)]


def row_checksum(row: torch.Tensor) -> str:
    """Content hash of one packed expert (bit-exact; what the checksum tests compare)."""
    data = row.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()
