"""What the per-iteration dispatch's levelling shares between its torch code (:mod:`dispatch`) and its
fused Triton kernel (:mod:`dispatch_kernel`): the damping and momentum of the Jacobi sweeps and the
list of replicated copies the kernel sweeps over. Both import it; neither imports the other's
internals (``dispatch`` loads the kernel only where it runs).

Shapes: ``L`` layers, ``E`` experts, ``R`` copy slots per expert in the dense table, ``C`` listed copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Damping of the parallel (Jacobi) update: experts sharing a GPU all move at once, so each moves
# 1 / (0.4 · most replicated experts on any of its GPUs) of the way, with heavy-ball momentum 0.3.
# Both measured as dispatch.SWEEPS was (bundled DeepSeek-V3 loads at EP64): 0.4/0.3 beats the
# allocator's 0.6/0.3 by 0.008 at 4 sweeps, 0.3 overshoots.
DAMPING = 0.4
MOMENTUM = 0.3

# Beyond this many listed copies the torch code runs: the kernel keeps the whole list in one thread
# block's registers (C = 2·N·S is 256 at EP64 with 2 slots per GPU; 1024 covers EP256).
MAX_FUSED_COPIES = 1024


@dataclass(frozen=True)
class ReplicaCopies:
    """One layer's replicated experts as a list of their copies: what the fused kernel
    (:mod:`dispatch_kernel`) sweeps over instead of the dense [E, R] table, which at EP64 is
    64 columns wide for ~2 valid copies per replicated row. Built on the host with the plan
    (:func:`list_replica_copies`), loaded into the device table in place like the rest of it.

    Attributes:
        expert, gpu, col: [C] int32 — the logical expert, GPU and table column of each copy of a
            replicated expert (an expert's copies adjacent, in column order), −1 padding.
        step: [C] float32 — the damped Jacobi step of each copy's expert (it depends on the
            placement only: see :func:`~vexpert_runtime.model.dispatch.level_shares`).
        single_gpu: [E] int32 — the GPU of each expert with one copy (its whole load lands there),
            −1 for replicated experts.
    """

    expert: torch.Tensor
    gpu: torch.Tensor
    col: torch.Tensor
    step: torch.Tensor
    single_gpu: torch.Tensor


def copies_capacity(num_gpus: int, slots: int) -> int:
    """C: the most copies of replicated experts one layer can have — every slot holds one copy,
    and each replicated expert has one slot copy at least besides its resident one: 2·N·S."""
    return max(2, 2 * num_gpus * slots)


def list_replica_copies(gpu: np.ndarray, capacity: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The :class:`ReplicaCopies` of every layer of a table (host side, at plan load).

    Args: gpu [L, E, R] int64 (−1 padding, valid copies first); capacity C.
    Returns expert, gpu, col [L, C] int32 (−1 padding), step [L, C] float32, single_gpu [L, E] int32.
    Raises ValueError if a layer has more than C copies of replicated experts.
    """
    valid = gpu >= 0
    layers, experts, width = gpu.shape
    # an expert with two copies or more; with valid copies first that is "copy 1 is valid" — numpy's
    # reductions over a last axis of 2 take ~0.4 ms each at DeepSeek-V3's size, elementwise ops ~20 µs
    if width < 2:
        multi = np.zeros((layers, experts), dtype=bool)
    elif not (valid[..., 1:] & ~valid[..., :-1]).any():
        multi = valid[..., 1]
    else:  # not valid-first: count
        multi = valid.sum(-1) > 1
    replicated = valid & multi[..., None]
    per_layer = replicated.sum((1, 2))
    if per_layer.size and per_layer.max() > capacity:
        layer = int(per_layer.argmax())
        raise ValueError(f"layer {layer} has {int(per_layer[layer])} copies of replicated experts, room for {capacity}")
    # one pass over all layers (a plan switch runs this on the worker's host thread): row-major order
    # keeps each layer's copies together and an expert's copies adjacent, in column order
    lyr, rest = np.divmod(np.flatnonzero(replicated), experts * width)  # np.nonzero, 4x faster here
    rows, cols = np.divmod(rest, width)
    slot = np.arange(lyr.size) - np.repeat(np.cumsum(per_layer) - per_layer, per_layer)
    gpus = gpu[lyr, rows, cols]
    expert = np.full((layers, capacity), -1, dtype=np.int32)
    copy_gpu, col = expert.copy(), expert.copy()
    step = np.zeros((layers, capacity), dtype=np.float32)
    expert[lyr, slot], copy_gpu[lyr, slot], col[lyr, slot] = rows, gpus, cols
    # level_shares' damping: 1 / (damping · most replicated experts on any GPU of the expert)
    degree = np.zeros((layers, max(1, int(gpu.max()) + 1)), dtype=np.int64)
    np.add.at(degree, (lyr, gpus), 1)
    most = np.zeros((layers, experts), dtype=np.int64)
    np.maximum.at(most, (lyr, rows), degree[lyr, gpus])
    step[lyr, slot] = 1.0 / np.maximum(DAMPING * most[lyr, rows], 1.0)
    single_gpu = np.where(multi, -1, gpu[..., 0]).astype(np.int32)
    return expert, copy_gpu, col, step, single_gpu
