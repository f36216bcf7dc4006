"""Drifting synthetic load from the bundled real-load traces, and the built-in demo model.

A tiny random model routes almost uniformly, so to replay *real* skew a
:class:`~vexpert_runtime.workload.Workload` can add a per-layer router logit bias ``log p_l``
(``p_l``: a bundled DeepSeek-V3 per-layer expert distribution, subsampled to the model's layer and
expert counts); switching between bundled distributions makes the load drift the way the paper's
phased traces do. The workload type itself lives outside this package, so the node runs it without
importing the simulation.
"""

from __future__ import annotations

import numpy as np

from vexpert_runtime.model.families import DEEPSEEK
from vexpert_runtime.model.moe_spec import MoESpec
from vexpert_runtime.workload import LoadPhase, Workload

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
