"""A slot probe for tests (``NodeOptions(probe=SlotAudit)``, :mod:`vexpert_runtime.node.slot_probe`):
every worker checksums each slot a layer computes with, and reports them with the rows it computed
per resident expert and slot. The class is the probe's factory (the workers import this module: the
test directory is on the spawned processes' ``sys.path``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vexpert_runtime.node.protocol import WorkerSlots
from vexpert_runtime.node.slots import row_checksum


@dataclass(frozen=True)
class SlotAuditDetails:
    """One rank's iteration: ``computed`` [L][E/N + S] rows per resident expert and slot,
    ``slot_checksums`` per layer, per slot, the content hash of what the layer computed with."""

    computed: list[list[int]]
    slot_checksums: list[list[str]]


class SlotAudit:
    def __init__(self) -> None:
        self._layers: list[list[str]] = []

    def layer_held(self, layer: int, slots: WorkerSlots) -> None:
        self._layers.append([row_checksum(slots.slot(s)) for s in range(slots.buffers.slots.shape[0])])

    def iteration_done(self, computed: torch.Tensor) -> SlotAuditDetails:
        details = SlotAuditDetails(computed.tolist(), self._layers)
        self._layers = []
        return details


def slot_checksums(details: dict[int, SlotAuditDetails]) -> dict[int, list[list[str]]]:
    """rank → per layer, per slot checksums of one iteration's record."""
    return {rank: d.slot_checksums for rank, d in details.items()}


def computed_rows(details: dict[int, SlotAuditDetails]) -> dict[int, list[list[int]]]:
    """rank → [L][E/N + S] rows computed, of one iteration's record."""
    return {rank: d.computed for rank, d in details.items()}
