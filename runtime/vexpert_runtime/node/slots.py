"""L1 vExpert slots (workers): per worker one buffer ``[S, D]`` with ``S = G·vmax`` slots and
``D = 3·I·H`` (one packed expert per slot) — the paper's L1 memory.

Layer ``l`` of iteration ``t`` is the *layer sequence* ``q = t·L + l``: the coordinator fills ``q``'s
slots while the workers compute ``q − 1``. The allocator lays adjacent layers out on disjoint slots
(even layers from slot 0 up, odd layers from slot S − 1 down, ``V_l + V_{l+1} ≤ S``), so the fill of
the next layer never waits for the current one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotLayout:
    """Shape of one worker's slot buffer."""

    slots: int  # S = G·vmax
    numel: int  # D, elements per packed expert
    dtype: torch.dtype

    @property
    def bytes_per_worker(self) -> int:
        """Memory of one worker's slots: S · D · itemsize."""
        return self.slots * self.numel * torch.empty((), dtype=self.dtype).element_size()


def sequence(iteration: int, layer: int, num_layers: int) -> int:
    """Global layer sequence number of layer ``layer`` in ``iteration``."""
    return iteration * num_layers + layer


def group_layers(num_layers: int, group_size: int) -> list[list[int]]:
    """Layers of each group: [[0..G−1], [G..2G−1], ...] (the last group may be shorter)."""
    return [list(range(start, min(start + group_size, num_layers))) for start in range(0, num_layers, group_size)]


def row_checksum(row: torch.Tensor) -> str:
    """Content hash of one packed expert (bit-exact; what the checksum tests compare)."""
    data = row.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()
