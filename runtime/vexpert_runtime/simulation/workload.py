"""Synthetic decode load for a node without a serving frontend, and the built-in demo model.

Each EP rank draws its own tokens per iteration from a seeded generator (so the coordinator can
regenerate any rank's batch to verify it). A tiny random model routes almost uniformly, so to replay
*real* skew the workload can add a per-layer router logit bias ``log p_l`` (``p_l``: a bundled
DeepSeek-V3 per-layer expert distribution, subsampled to the model's layer and expert counts);
switching between bundled distributions makes the load drift the way the paper's phased traces do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vexpert_runtime.model.checkpoint import DEEPSEEK, MoESpec

DEMO_PHASES: tuple[tuple[str, int], ...] = (
    ("decode_in1000out1000", 14),
    ("prefill_in4096", 13),
    ("decode_in500out1500", 13),
)


def demo_model_spec() -> MoESpec:
    """The built-in DeepSeek-shaped demo model: 6 MoE layers (after one dense layer), 32 routed
    experts in 8 groups (4 of them chosen per token), top-4, one shared expert, H=64, I=32."""
    return MoESpec(
        architecture=DEEPSEEK,
        hidden_size=64,
        intermediate_size=32,
        num_experts=32,
        top_k=4,
        moe_layers=tuple(range(1, 7)),
        scoring="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        correction_bias=True,
        shared_intermediate_size=32,
    )


@dataclass(frozen=True)
class LoadPhase:
    """One phase of router skew: from ``start`` on, add ``bias`` [L, E] to the router logits."""

    name: str
    start: int
    bias: np.ndarray


@dataclass(frozen=True)
class Workload:
    """Per-iteration input of every rank, plus optional drifting router skew (cycling phases)."""

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


def subsample_distribution(dist: np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:
    """Pick ``num_layers`` evenly spaced layers and every (E_real/num_experts)-th expert of a real
    [L_real, E_real] distribution; rows renormalised. Returns [num_layers, num_experts]."""
    layers = np.linspace(0, dist.shape[0] - 1, num_layers).round().astype(int)
    stride = max(1, dist.shape[1] // num_experts)
    experts = (np.arange(num_experts) * stride) % dist.shape[1]
    sub = dist[layers][:, experts] + 1e-9
    out: np.ndarray = sub / sub.sum(1, keepdims=True)
    return out


def drifting_workload(
    phases: tuple[tuple[str, int], ...],
    num_layers: int,
    num_experts: int,
    tokens_per_worker: int,
    seed: int = 0,
    strength: float = 1.0,
) -> Workload:
    """A workload whose router skew replays bundled DeepSeek-V3 distributions phase by phase.

    ``phases``: (bundled name, iterations). Bias = ``strength · log p`` per layer (strength 1
    reproduces the real distribution's skew on the demo model).
    """
    from vexpert_runtime.simulation.trace import load_bundled_distribution

    out = []
    start = 0
    for name, iterations in phases:
        dist = subsample_distribution(load_bundled_distribution(name), num_layers, num_experts)
        bias = (strength * np.log(dist)).astype(np.float32)
        out.append(LoadPhase(name, start, bias - bias.mean(1, keepdims=True)))
        start += iterations
    return Workload(tokens_per_worker=tokens_per_worker, seed=seed, phases=tuple(out), cycle=start)
