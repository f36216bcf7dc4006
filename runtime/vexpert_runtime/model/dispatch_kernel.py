"""The per-iteration dispatch's shares in one GPU kernel (Triton): :func:`fused_cum_shares`.

:func:`vexpert_runtime.model.dispatch.level_shares` followed by ``cumulative_shares`` is ~140 small
kernels per layer over the dense [E, R] table (a sort, a cumsum, an ``index_add`` and element-wise
chains per sweep); at DeepSeek-V3 shape (E = 256, R = 64) that table is 16 Ki entries of which
~400 are copies. Replayed from a CUDA graph it still costs ~0.5 ms per layer, far from issue #14's
≤ 30 µs. Here one program of one thread block does it all over the *list* of the replicated experts'
copies (:class:`~vexpert_runtime.model.dispatch.ReplicaCopies`, C ≤ 2·N·S entries, built with the
plan on the host):

* each GPU's base load from the experts with one copy (their whole count), once;
* per Jacobi sweep, all in registers, pairwise over the list ([C, C] tiles, or [32, C] tiles whose
  rows come through shared memory for longer lists): each copy's GPU load and so its floor (the
  GPU without it), and its expert's water level min_k (count + Σ_{i≤k} floor_(i)) / k computed
  without sorting — for copy j, k_j = #{copies i of its expert with floor_i ≤ floor_j} and the sum
  of those floors (ties give the level at the end of their run, the same minimum) — then the
  minimum over the expert's copies;
* the shares normalised and cumulated per expert (pairwise again) and written over the plan's
  rows without replicas ([1, inf, …]: one copy takes everything).

No atomics and no scratch memory: the sums run in a fixed order, so a graph replay computes bit for
bit what an eager call does. The arithmetic is :func:`level_shares`' step for step (its torch code
is the CPU twin, and the reference the tests compare with); sums in another order, so results
agree to float32 rounding. This module imports Triton: :mod:`dispatch` imports it only where it runs
(:func:`~vexpert_runtime.model.dispatch.fused_dispatch_runs`).

Shapes: ``E`` experts, ``R`` copy slots per expert in the dense table, ``N`` GPUs, ``C`` listed copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from vexpert_runtime.model.dispatch import ReplicaCopies

FULL_TILE = 256  # lists up to this long are compared all against all in one [C, C] tile
_CHUNK = 32  # else [CHUNK, C] tiles, their rows gathered from the registers through shared memory


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def rows(v, i0: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Entries i0 .. i0 + CHUNK of the register vector v [BLOCK] (through shared memory)."""
    if CHUNK == BLOCK:
        return v
    else:
        return tl.gather(v, i0 + tl.arange(0, CHUNK), 0)


@triton.jit
def level_cum_shares(counts_ptr, single_gpu_ptr, expert_ptr, gpu_ptr, col_ptr, step_ptr, cum_ptr, out_ptr,
                     E, R, C, TABLE, SWEEPS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                     CHUNK: tl.constexpr, COPY_BLOCK: tl.constexpr, TABLE_CHUNKS: tl.constexpr,
                     MOMENTUM: tl.constexpr):
    # rows without replicas: the plan's [1, inf, inf, …] (written, not copied: stores do not wait)
    for chunk in tl.static_range(TABLE_CHUNKS):  # TABLE = E·R entries in TABLE_CHUNKS blocks
        offs = chunk * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
        tl.store(out_ptr + offs, tl.where(offs % R == 0, 1.0, float("inf")).to(tl.float64), mask=offs < TABLE)

    c = tl.arange(0, BLOCK_C)
    expert = tl.load(expert_ptr + c, mask=c < C, other=-1)
    valid = expert >= 0
    x = tl.where(valid, expert, 0)
    gpu = tl.load(gpu_ptr + c, mask=valid, other=-1)
    col = tl.load(col_ptr + c, mask=valid, other=0)
    step = tl.load(step_ptr + c, mask=valid, other=0.0)
    hi = tl.load(cum_ptr + x * R + col, mask=valid, other=1.0)
    lo = tl.load(cum_ptr + x * R + col - 1, mask=valid & (col > 0), other=0.0)
    share = tl.where(valid, (tl.minimum(hi, 1.0) - tl.minimum(lo, 1.0)).to(tl.float32), 0.0)
    w = tl.load(counts_ptr + x, mask=valid, other=0).to(tl.float32)
    inv_w = 1.0 / tl.maximum(w, 1e-6)

    # each copy's GPU's load from the experts with one copy (the whole count lands there)
    ee = tl.arange(0, BLOCK_E)
    single = tl.load(single_gpu_ptr + ee, mask=ee < E, other=-1)
    w_single = tl.load(counts_ptr + ee, mask=(ee < E) & (single >= 0), other=0).to(tl.float32)
    base = tl.zeros([BLOCK_C], dtype=tl.float32)
    for e0 in tl.static_range(0, BLOCK_E, CHUNK):
        on = (rows(single, e0, CHUNK, BLOCK_E)[:, None] == gpu[None, :]) & valid[None, :]
        base += tl.sum(tl.where(on, rows(w_single, e0, CHUNK, BLOCK_E)[:, None], 0.0), axis=0)

    previous = share
    for _sweep in tl.static_range(SWEEPS):
        mine = share * w
        load = base
        for i0 in tl.static_range(0, BLOCK_C, CHUNK):  # + the replicated copies' tokens on the GPU
            same_gpu = rows(gpu, i0, CHUNK, BLOCK_C)[:, None] == gpu[None, :]
            load += tl.sum(tl.where(same_gpu, rows(mine, i0, CHUNK, BLOCK_C)[:, None], 0.0), axis=0)
        floor = load - mine  # the GPU without this copy
        # water level min_k (count + Σ_{i≤k} floor_(i)) / k: k_j = copies of j's expert with floor ≤ floor_j
        wet = tl.zeros([BLOCK_C], dtype=tl.float32)
        below = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i0 in tl.static_range(0, BLOCK_C, CHUNK):
            f_i = rows(floor, i0, CHUNK, BLOCK_C)
            low = ((rows(expert, i0, CHUNK, BLOCK_C)[:, None] == expert[None, :]) & valid[None, :]
                   & (f_i[:, None] <= floor[None, :]))
            wet += tl.sum(low.to(tl.float32), axis=0)
            below += tl.sum(tl.where(low, f_i[:, None], 0.0), axis=0)
        level_j = (w + below) / tl.maximum(wet, 1.0)
        level = tl.full([BLOCK_C], float("inf"), dtype=tl.float32)
        for i0 in tl.static_range(0, BLOCK_C, CHUNK):
            same = rows(expert, i0, CHUNK, BLOCK_C)[:, None] == expert[None, :]
            level = tl.minimum(level, tl.min(tl.where(same, rows(level_j, i0, CHUNK, BLOCK_C)[:, None],
                                                      float("inf")), axis=0))
        target = tl.maximum(level - floor, 0.0) * inv_w
        stepped = tl.maximum(share + step * (target - share) + MOMENTUM * (share - previous), 0.0)
        previous = share
        share = stepped

    # normalise per expert (an expert without tokens: an even split) and cumulate by column
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    upto = tl.zeros([BLOCK_C], dtype=tl.float32)
    copies = tl.zeros([BLOCK_C], dtype=tl.float32)
    rank = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i0 in tl.static_range(0, BLOCK_C, CHUNK):
        s_i = rows(share, i0, CHUNK, BLOCK_C)[:, None]
        same = (rows(expert, i0, CHUNK, BLOCK_C)[:, None] == expert[None, :]) & valid[None, :]
        before = same & (rows(col, i0, CHUNK, BLOCK_C)[:, None] <= col[None, :])
        total += tl.sum(tl.where(same, s_i, 0.0), axis=0)
        upto += tl.sum(tl.where(before, s_i, 0.0), axis=0)
        copies += tl.sum(same.to(tl.float32), axis=0)
        rank += tl.sum(before.to(tl.float32), axis=0)
    cum = tl.where(total > 1e-6, upto.to(tl.float64) / tl.maximum(total, 1e-12).to(tl.float64),
                   rank.to(tl.float64) / tl.maximum(copies, 1.0).to(tl.float64))
    cum = tl.where(rank == copies, 1.0, cum)  # the last copy exactly 1: a draw never passes it
    tl.store(out_ptr + x * R + col, cum, mask=valid)



def fused_cum_shares(counts: torch.Tensor, copies: ReplicaCopies, plan_cum_share: torch.Tensor, num_gpus: int,
                     sweeps: int, num_warps: int = 8, chunk: int | None = None) -> torch.Tensor:
    """``cumulative_shares(level_shares(counts, gpu, N, sweeps, start=plan_shares(plan_cum_share)), gpu)``
    in one kernel launch (no host sync, no scratch; capturable in a CUDA graph).

    Args:
        counts: [E] tokens (pairs) routed to each expert (integer or float).
        copies: the layer's :class:`ReplicaCopies` (the dense table's replicated rows, listed).
        plan_cum_share: [E, R] float64 the plan's cumulative shares (padding inf).
        num_gpus: N (the list carries the GPUs; kept for the twin's signature). sweeps: Jacobi sweeps.
        num_warps: threads of the block / 32. chunk: rows of each pairwise tile (default: the whole
            list up to :data:`FULL_TILE` copies, else :data:`_CHUNK`).
    Tensors on a CUDA device (CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``).
    Returns [E, R] float64 cumulative shares, as ``choose_replicas`` draws from.
    """
    from vexpert_runtime.model.dispatch import _MOMENTUM, MAX_FUSED_COPIES  # (dispatch imports this module)

    del num_gpus
    num_experts, width = plan_cum_share.shape
    listed = copies.expert.shape[0]
    if listed > MAX_FUSED_COPIES:
        raise ValueError(f"fused dispatch takes up to {MAX_FUSED_COPIES} listed copies, got {listed}")
    block_e, block_c = _pow2(num_experts), max(_CHUNK, _pow2(listed))
    tile = chunk or (block_c if block_c <= FULL_TILE else _CHUNK)
    tile = min(tile, block_c, block_e)
    out = torch.empty(num_experts, width, dtype=torch.float64, device=plan_cum_share.device)
    level_cum_shares[(1,)](counts.contiguous(), copies.single_gpu, copies.expert, copies.gpu, copies.col, copies.step,
                    plan_cum_share.to(torch.float64).contiguous(), out,
                    num_experts, width, listed, num_experts * width,
                    SWEEPS=sweeps, BLOCK_E=block_e, BLOCK_C=block_c, CHUNK=tile,
                    COPY_BLOCK=1024, TABLE_CHUNKS=-(-num_experts * width // 1024), MOMENTUM=_MOMENTUM,
                    num_warps=num_warps)
    return out
