"""The per-iteration dispatch's shares in one GPU kernel (Triton): :func:`fused_cum_shares`.

:func:`vexpert_runtime.model.dispatch.level_shares` followed by ``cumulative_shares`` is a few
dozen small kernels per sweep over the dense [E, R] table (a sort, a cumsum, an ``index_add`` and
element-wise chains), ~140 launches per layer at DeepSeek-V3 shape: even replayed from a CUDA graph
that is far from the ≤ 30 µs per layer issue #14 asks for. Here the whole computation — the plan's
shares as the start, the damping, every Jacobi sweep and the cumulative draw table — runs in one
program of one thread block: the table fits its registers, the per-GPU loads go through a few
hundred bytes of scratch with atomics, and ``__syncthreads`` separates a sweep's scatter from its
gather (one block, so no grid-wide barrier is needed). The loads add up in fixed point (int64,
2⁻²⁴ of a token): integer atomics are associative, so the result does not depend on the order the
threads get there and a graph replay computes bit for bit what an eager call does.

The arithmetic is :func:`level_shares`' step for step (its torch code is the CPU twin, and the
reference the GPU test compares with); only the per-GPU loads differ (fixed point instead of float
additions), so results agree to float32 rounding.

Shapes: ``E`` experts, ``R`` copy slots per expert (copy 0 resident, −1 padding), ``N`` GPUs.
"""

from __future__ import annotations

import functools
import os

import torch

# Register budget of the one block: the table's loop-carried tensors (shares, previous shares, bins)
# are E·R elements each; beyond this the kernel would spill heavily, and the torch path is used.
MAX_TABLE_ELEMENTS = 256 * 64


@functools.cache
def triton_available() -> bool:
    """Whether the fused kernel can run: Triton importable (it ships with CUDA builds of torch) and
    not switched off with ``VEXPERT_DISPATCH_KERNEL=torch`` (debugging, comparisons)."""
    if os.environ.get("VEXPERT_DISPATCH_KERNEL", "triton") == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fits(gpu: torch.Tensor) -> bool:
    """Whether the table [E, R] fits the kernel's one block (and has copies to split)."""
    return gpu.shape[1] >= 2 and _pow2(gpu.shape[0]) * _pow2(gpu.shape[1]) <= MAX_TABLE_ELEMENTS


def supports(gpu: torch.Tensor) -> bool:
    """Whether the dispatch runs this table through :func:`fused_cum_shares`: on a CUDA device, with
    Triton, and when it fits (else the torch twin runs, the same arithmetic in many kernels)."""
    return gpu.is_cuda and triton_available() and fits(gpu)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    """Compile-on-first-use: Triton is imported only where the kernel runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def level_cum_shares(counts_ptr, gpu_ptr, cum_ptr, out_ptr, scratch_ptr, E, R, N,
                         SWEEPS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr, DAMPING: tl.constexpr, MOMENTUM: tl.constexpr,
                         DRY: tl.constexpr, FIXED: tl.constexpr):
        e = tl.arange(0, BLOCK_E)[:, None]
        r = tl.arange(0, BLOCK_R)[None, :]
        inside = (e < E) & (r < R)
        gpu = tl.load(gpu_ptr + e * R + r, mask=inside, other=-1)
        valid = gpu >= 0
        nvalid = tl.sum(valid.to(tl.int32), axis=1)[:, None]
        # plan_shares: differences of the capped cumulative table
        hi = tl.load(cum_ptr + e * R + r, mask=inside, other=1.0)
        lo = tl.load(cum_ptr + e * R + r - 1, mask=inside & (r > 0), other=0.0)
        share = tl.where(valid, (tl.minimum(hi, 1.0) - tl.minimum(lo, 1.0)).to(tl.float32), 0.0)
        if SWEEPS > 0:
            w = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.float32)  # [BLOCK_E, 1]
            inv_w = 1.0 / tl.maximum(w, 1e-6)
            bins = tl.where(valid, gpu, N).to(tl.int32)
            replicated = valid & (nvalid > 1)
            n = tl.arange(0, BLOCK_N)
            for row in tl.static_range(SWEEPS + 1):  # row 0: degrees, row s + 1: sweep s's loads
                tl.store(scratch_ptr + row * BLOCK_N + n, tl.zeros([BLOCK_N], dtype=tl.int64))
            tl.debug_barrier()
            tl.atomic_add(scratch_ptr + bins, replicated.to(tl.int64), mask=replicated)
            tl.debug_barrier()
            degree = tl.load(scratch_ptr + bins, mask=replicated, other=0, volatile=True).to(tl.float32)
            step = 1.0 / tl.maximum(DAMPING * tl.max(degree, axis=1), 1.0)[:, None]
            inv_rank = 1.0 / (r + 1).to(tl.float32)
            previous = share
            for s in tl.static_range(SWEEPS):
                mine = share * w
                loads = scratch_ptr + (s + 1) * BLOCK_N
                tl.atomic_add(loads + bins, (mine * FIXED + 0.5).to(tl.int64), mask=valid)
                tl.debug_barrier()
                load = tl.load(loads + bins, mask=valid, other=0, volatile=True).to(tl.float32) * (1.0 / FIXED)
                floor = tl.where(valid, load - mine, DRY)
                # water_fill: the level is min_k (amount + Σ_{i≤k} floor_(i)) / k over the sorted floors
                ordered = tl.sort(floor, dim=1)
                level = tl.min((w + tl.cumsum(ordered, axis=1)) * inv_rank, axis=1)[:, None]
                target = tl.maximum(level - floor, 0.0) * inv_w
                stepped = tl.maximum(share + step * (target - share) + MOMENTUM * (share - previous), 0.0)
                previous = share
                share = stepped
            total = tl.sum(share, axis=1)[:, None]
            even = valid.to(tl.float32) / tl.maximum(nvalid, 1).to(tl.float32)
            share = tl.where(total > 1e-6, share / tl.maximum(total, 1e-12), even)
        # cumulative_shares: the last valid copy exactly 1, padding inf
        cum = tl.cumsum(share.to(tl.float64), axis=1)
        cum = tl.where(r == nvalid - 1, 1.0, cum)
        cum = tl.where(valid, cum, float("inf"))
        tl.store(out_ptr + e * R + r, cum, mask=inside)

    return level_cum_shares


def fused_cum_shares(counts: torch.Tensor, gpu: torch.Tensor, plan_cum_share: torch.Tensor, num_gpus: int,
                     sweeps: int, num_warps: int = 16) -> torch.Tensor:
    """``cumulative_shares(level_shares(counts, gpu, N, sweeps, start=plan_shares(plan_cum_share)), gpu)``
    in one kernel launch (no host sync; capturable in a CUDA graph).

    Args:
        counts: [E] tokens (pairs) routed to each expert (integer or float).
        gpu: [E, R] int64 GPU of each copy, −1 padding (valid copies first in each row).
        plan_cum_share: [E, R] float64 the plan's cumulative shares (padding inf).
        num_gpus: N. sweeps: Jacobi sweeps (0: the plan's shares).
        num_warps: threads of the block / 32 (16 measured fastest at DeepSeek-V3 shape on H200).
    Tensors on a CUDA device (CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``).
    Returns [E, R] float64 cumulative shares, as ``choose_replicas`` draws from.
    """
    if not fits(gpu):
        raise ValueError(f"fused dispatch needs a table [E, R] with R ≥ 2 and E·R ≤ {MAX_TABLE_ELEMENTS} "
                         f"(powers of two); got {tuple(gpu.shape)}")
    from vexpert_runtime.model.dispatch import _DAMPING, _DRY, _MOMENTUM  # (dispatch imports this module)

    num_experts, width = gpu.shape
    block_n = _pow2(num_gpus + 1)
    gpu_c, cum_c, counts_c = gpu.contiguous(), plan_cum_share.to(torch.float64).contiguous(), counts.contiguous()
    out = torch.empty(num_experts, width, dtype=torch.float64, device=gpu.device)
    scratch = torch.empty((sweeps + 1) * block_n, dtype=torch.int64, device=gpu.device)
    _kernel()[(1,)](counts_c, gpu_c, cum_c, out, scratch, num_experts, width, num_gpus,
                    SWEEPS=sweeps, BLOCK_E=_pow2(num_experts), BLOCK_R=_pow2(width), BLOCK_N=block_n,
                    DAMPING=_DAMPING, MOMENTUM=_MOMENTUM, DRY=_DRY, FIXED=float(2**24), num_warps=num_warps)
    return out
