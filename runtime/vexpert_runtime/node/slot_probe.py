"""An extension point on a worker's slots: a :class:`SlotProbe` sees every layer's slots while the
layer holds them (after its wait, before its compute) and adds what it found to the iteration's
report (``IterationDone.details``, kept per rank in the supervisor's
:class:`~vexpert_runtime.node.report.IterationRecord`) — for audits of what each slot held, or
debugging. A probe runs on the host at every layer, so a probed worker runs every iteration eagerly
(no CUDA graph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from vexpert_runtime.node.gpu_sync import FlagOps
from vexpert_runtime.node.protocol import Rescue, SharedState, WorkerSlots
from vexpert_runtime.node.slots import SlotBuffers


class SlotProbe(Protocol):
    def layer_held(self, layer: int, slots: WorkerSlots) -> None:
        """``layer``'s slots were acquired: they hold what the layer computes with."""

    def iteration_done(self, computed: torch.Tensor) -> Any:
        """The iteration finished (``computed`` [L, E/N + S]: rows per resident expert and slot);
        what to report for it (picklable)."""


ProbeFactory = Callable[[], SlotProbe]  # picklable: it crosses into every worker process


class ProbedSlots(WorkerSlots):
    """A worker's slots that show each layer to ``probe`` once acquired."""

    def __init__(self, probe: SlotProbe, shared: SharedState, worker: int, buffers: SlotBuffers, timeout_s: float,
                 ops: FlagOps, stream: Any = None) -> None:
        super().__init__(shared, worker, buffers, timeout_s, ops, stream)
        self.probe = probe

    def acquire(self, layer: int, rescue: Rescue | None = None) -> None:
        super().acquire(layer, rescue)
        self.probe.layer_held(layer, self)
