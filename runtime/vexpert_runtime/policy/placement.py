"""Base expert placements and load/balance metrics (pure functions over tensors).

A *base placement* says which GPU holds the one resident (HBM) copy of each logical expert:
``base_gpu [L, E]`` int64 with values in ``[0, N)`` and exactly ``E / N`` experts per GPU.
A *share* tensor ``[L, E, N]`` says which fraction of each expert's tokens each GPU computes;
every policy (static, EPLB, vExpert) is evaluated through it.
"""

from __future__ import annotations

import torch

from vexpert_runtime.errors import VExpertInputError


def static_placement(num_layers: int, num_experts: int, num_gpus: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Contiguous placement: GPU g holds experts [g·E/N, (g+1)·E/N). Returns base_gpu [L, E] int64."""
    check_divisible(num_experts, num_gpus)
    per_gpu = num_experts // num_gpus
    row = torch.arange(num_experts, device=device) // per_gpu
    return row.unsqueeze(0).expand(num_layers, num_experts).contiguous()


def check_divisible(num_experts: int, num_gpus: int) -> None:
    if num_gpus <= 0:
        raise VExpertInputError("--gpus", f"must be positive, got {num_gpus}")
    if num_experts % num_gpus != 0:
        raise VExpertInputError(
            "--gpus",
            f"{num_experts} experts cannot be split evenly over {num_gpus} GPUs",
            "use a GPU count that divides the expert count",
        )


def validate_base_placement(base_gpu: torch.Tensor, num_gpus: int) -> None:
    """Every GPU must hold exactly E / N base experts in every layer."""
    if base_gpu.dim() != 2:
        raise VExpertInputError("base_gpu", f"must be [layers, experts], got shape {tuple(base_gpu.shape)}")
    num_experts = base_gpu.shape[1]
    check_divisible(num_experts, num_gpus)
    if base_gpu.numel() and (int(base_gpu.min()) < 0 or int(base_gpu.max()) >= num_gpus):
        raise VExpertInputError("base_gpu", f"GPU ids must be in [0, {num_gpus})")
    per_gpu = torch.zeros(base_gpu.shape[0], num_gpus, dtype=torch.int64, device=base_gpu.device)
    per_gpu.scatter_add_(1, base_gpu, torch.ones_like(base_gpu))
    if bool((per_gpu != num_experts // num_gpus).any()):
        raise VExpertInputError("base_gpu", f"each GPU must hold exactly {num_experts // num_gpus} experts per layer")


def base_gpu_loads(counts: torch.Tensor, base_gpu: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Tokens per GPU when every expert runs only on its base GPU.

    Args: counts [..., L, E]; base_gpu [L, E]. Returns [..., L, N] float32.
    """
    counts = counts.to(torch.float32)
    index = base_gpu.expand(counts.shape)
    out = torch.zeros(*counts.shape[:-1], num_gpus, dtype=torch.float32, device=counts.device)
    return out.scatter_add_(-1, index, counts)


def share_from_base(base_gpu: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """One-hot share [L, E, N] float32 of a placement without replicas."""
    return torch.nn.functional.one_hot(base_gpu, num_gpus).to(torch.float32)


def gpu_loads(counts: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """Tokens per GPU given per-expert GPU shares. counts [..., L, E], share [L, E, N] → [..., L, N]."""
    return torch.einsum("...le,len->...ln", counts.to(torch.float32), share)


def balance_ratio(loads: torch.Tensor) -> torch.Tensor:
    """SGLang's balancedness per layer: mean GPU load / max GPU load. loads [..., N] → [...].

    A layer with no tokens counts as perfectly balanced (1.0).
    """
    peak = loads.amax(dim=-1)
    mean = loads.mean(dim=-1)
    return torch.where(peak > 0, mean / peak.clamp(min=1e-12), torch.ones_like(peak))
