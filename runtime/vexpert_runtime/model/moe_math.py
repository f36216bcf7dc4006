"""The arithmetic both the EP forward and the reference share: expert FFN, shared expert, the
weighted combine of a token's K expert outputs and the parameter-free norm between layers.

Keeping one definition means the EP forward and the reference differ only in *where* each
(token, expert) pair is computed, which is exactly what the correctness tests compare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vexpert_runtime.model.weights import SharedExpertWeights, unpack_expert


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert: down(silu(gate·x) ⊙ up·x). x [T, H], gate/up [I, H], down [H, I] → [T, H]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def packed_ffn(x: torch.Tensor, row: torch.Tensor, intermediate: int, hidden: int) -> torch.Tensor:
    """:func:`expert_ffn` with a packed expert row [3·I·H] (a pool row or an L1 slot)."""
    return expert_ffn(x, *unpack_expert(row, intermediate, hidden))


def shared_forward(x: torch.Tensor, shared: SharedExpertWeights | None) -> torch.Tensor | None:
    """Shared expert output [B, H] (Qwen2: times sigmoid(output_gate·x)), or None without one."""
    if shared is None:
        return None
    out = expert_ffn(x, shared.gate, shared.up, shared.down)
    if shared.output_gate is not None:
        out = torch.sigmoid(F.linear(x, shared.output_gate)) * out
    return out


def combine(weights: torch.Tensor, outputs: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """Σ_k weights[:, k] · outputs[:, k] (+ shared). weights [B, K] fp32, outputs [B, K, H] → [B, H]."""
    y = (weights.to(outputs.dtype).unsqueeze(-1) * outputs).sum(1)
    return y if shared is None else y + shared


def rms_norm(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Parameter-free RMS norm per row: h [B, H] → [B, H] (keeps the stacked demo model's scale)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-token relative error max_t ‖y_t − ref_t‖ / ‖ref_t‖. y, ref [B, H]."""
    if ref.numel() == 0:
        return 0.0
    num = (y.to(torch.float64) - ref.to(torch.float64)).norm(dim=-1)
    den = ref.to(torch.float64).norm(dim=-1).clamp(min=1e-12)
    return float((num / den).max())
