"""The synthetic decode load of a node without a serving frontend: what every EP rank computes each
iteration (:class:`Workload`) and the router skew that drifts between phases (:class:`LoadPhase`).

Both sides use it: the node (:mod:`vexpert_runtime.node`) runs it and verifies against it, and the
simulation package (:mod:`vexpert_runtime.simulation.workload`) builds drifting workloads from the
bundled real-load traces. It depends on neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class LoadPhase:
    """One phase of router skew: from ``start`` on, add ``bias`` [L, E] to the router logits."""

    name: str
    start: int
    bias: np.ndarray


@dataclass(frozen=True)
class Workload:
    """Per-iteration input of every rank, plus optional drifting router skew (cycling phases).

    Each EP rank draws its own tokens per iteration from a seeded generator, so the supervisor can
    regenerate any rank's batch to verify it."""

    tokens_per_worker: int = 64
    seed: int = 0
    phases: tuple[LoadPhase, ...] = field(default_factory=tuple)
    cycle: int = 0  # phases repeat every ``cycle`` iterations (0 = last phase lasts forever)

    def inputs(self, iteration: int, rank: int, hidden: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rank ``rank``'s tokens at ``iteration``: [B, H], standard normal, reproducible."""
        state = np.random.SeedSequence([self.seed, iteration, rank]).generate_state(1, dtype=np.uint64)[0]
        gen = torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))
        return torch.randn(self.tokens_per_worker, hidden, generator=gen).to(dtype)

    def _phase(self, iteration: int) -> LoadPhase | None:
        if not self.phases:
            return None
        t = iteration % self.cycle if self.cycle else iteration
        current = self.phases[0]
        for phase in self.phases:
            if phase.start <= t:
                current = phase
        return current

    def logit_bias(self, iteration: int) -> torch.Tensor | None:
        """[L, E] fp32 router skew at ``iteration`` or None."""
        phase = self._phase(iteration)
        return None if phase is None else torch.from_numpy(phase.bias).to(torch.float32)

    def phase_name(self, iteration: int) -> str:
        phase = self._phase(iteration)
        return "uniform" if phase is None else phase.name
