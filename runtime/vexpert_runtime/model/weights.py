"""One MoE layer's weights in memory, as the checkpoint reader returns them and the expert math uses
them: the router, the shared expert, and routed experts as packed rows.

A packed expert row is one flat ``[gate (I·H) | up (I·H) | down (H·I)]`` per expert: the layout of the
L2 pool and the L1 slots (one copy per expert fill) in dense storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterWeights:
    """One MoE layer's router: weight [E, H] fp32, correction bias [E] fp32 or None."""

    weight: torch.Tensor
    correction_bias: torch.Tensor | None


@dataclass
class SharedExpertWeights:
    """One layer's shared expert: gate/up [Is, H], down [H, Is]; Qwen2's output gate [1, H] or None."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    output_gate: torch.Tensor | None


def pack_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """gate [I, H], up [I, H], down [H, I] → one flat row [3·I·H]."""
    return torch.cat([gate.reshape(-1), up.reshape(-1), down.reshape(-1)])


def unpack_expert(row: torch.Tensor, intermediate: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (gate [I, H], up [I, H], down [H, I]) into a packed row [3·I·H] (no copy)."""
    n = intermediate * hidden
    return row[:n].view(intermediate, hidden), row[n : 2 * n].view(intermediate, hidden), row[2 * n :].view(hidden, intermediate)
