"""The per-iteration dispatch's shares in one GPU kernel (Triton): :func:`fused_cum_shares`.

:func:`vexpert_runtime.model.dispatch.level_shares` followed by ``cumulative_shares`` is ~140 small
kernels per layer over the dense [E, R] table (a sort, a cumsum, an ``index_add`` and element-wise
chains per sweep); at DeepSeek-V3 shape (E = 256, R = 64) that table is 16 Ki entries of which
~240 are copies. Replayed from a CUDA graph it still costs 401 µs per layer on an H200, far from
issue #14's ≤ 30 µs. Here one program of one thread block does it all over the *list* of the
replicated experts' copies (:class:`~vexpert_runtime.model.levelling.ReplicaCopies`, C ≤ 2·N·S
entries, built with the plan on the host), one thread per copy:

* an expert's copies are adjacent in the list, in column order (a *run*), so every per-expert sum
  or minimum is a loop over the run — k < the longest run, a few copies, found on the device from
  the list, so a plan switch changes it without a recompile or a new CUDA-graph capture;
* the experts with one copy add their whole counts to their GPUs' base loads once; per Jacobi
  sweep only the replicated copies' tokens are added (integer atomics into a few hundred bytes of
  scratch, relaxed at block scope: the barrier after them orders them, and nothing outside the
  block reads the scratch), each copy's floor (its GPU's load without it) read back, and its
  expert's water level min_k (count + Σ_{i≤k} floor_(i)) / k computed without sorting: for copy j,
  k_j = #{copies i of its run with floor_i ≤ floor_j} and the sum of those floors (ties give the
  level at the end of their run of equal floors, the same minimum), then the least over the run;
* the shares normalised and cumulated over the run and written over the plan's rows without
  replicas ([1, inf, …]: one copy takes everything).

Loads add up in fixed point (int64, 2⁻²⁴ of a token): integer atomics are associative, so a graph
replay computes bit for bit what an eager call does. The arithmetic is :func:`level_shares`' step
for step (its torch code is the CPU twin, and the reference the tests compare with): results
agree to float32 rounding. This module imports Triton: :mod:`dispatch` imports it only where it
runs (:func:`~vexpert_runtime.model.dispatch.fused_dispatch_runs`).

Measured on an H200 at that shape (benchmarks/dispatch_cost.py; benchmarks/README, "Cost per layer
on an H200"): the kernel alone 8.8–9.2 µs replayed from a CUDA graph (an empty replay: ~4 µs),
15.6 µs with the layer's counts; the replica choice after it 14.4 µs slower than after the plan's
shares. Two earlier kernels over pairwise [32, C] tiles and [C, R] bands took 61 µs and 119 µs
alone (block-wide reductions per tile; wide gathers for runs of ~2).

Shapes: ``E`` experts, ``R`` copy slots per expert in the dense table, ``N`` GPUs, ``C`` listed copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vexpert_runtime.model.levelling import MAX_FUSED_COPIES, MOMENTUM, ReplicaCopies

_FIXED = float(2**24)  # fixed-point scale of token loads


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _write_single_copy_rows(out_ptr, R, TABLE, COPY_BLOCK: tl.constexpr, TABLE_CHUNKS: tl.constexpr):
    """Rows without replicas: the plan's [1, inf, inf, …] (written, not copied: stores do not wait).
    TABLE = E·R entries in TABLE_CHUNKS blocks of COPY_BLOCK."""
    for chunk in tl.static_range(TABLE_CHUNKS):
        offs = chunk * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
        tl.store(out_ptr + offs, tl.where(offs % R == 0, 1.0, float("inf")).to(tl.float64), mask=offs < TABLE)


@triton.jit
def _load_copies(counts_ptr, single_gpu_ptr, expert_ptr, gpu_ptr, col_ptr, step_ptr, cum_ptr, E, R, C,
                 BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, FIXED: tl.constexpr):
    """The listed copies [BLOCK_C] with their start shares (the plan's) and tokens, and the
    single-copy experts [BLOCK_E] with their GPU and fixed-point counts."""
    c = tl.arange(0, BLOCK_C)
    expert = tl.load(expert_ptr + c, mask=c < C, other=-1)
    valid = expert >= 0
    x = tl.where(valid, expert, 0)
    gpu = tl.load(gpu_ptr + c, mask=valid, other=0)
    col = tl.load(col_ptr + c, mask=valid, other=0)
    step = tl.load(step_ptr + c, mask=valid, other=0.0)
    hi = tl.load(cum_ptr + x * R + col, mask=valid, other=1.0)
    lo = tl.load(cum_ptr + x * R + col - 1, mask=valid & (col > 0), other=0.0)
    share = tl.where(valid, (tl.minimum(hi, 1.0) - tl.minimum(lo, 1.0)).to(tl.float32), 0.0)
    w = tl.load(counts_ptr + x, mask=valid, other=0).to(tl.float32)
    ee = tl.arange(0, BLOCK_E)
    single = tl.load(single_gpu_ptr + ee, mask=ee < E, other=-1)
    w_single = (tl.load(counts_ptr + ee, mask=(ee < E) & (single >= 0), other=0).to(tl.float32) * FIXED + 0.5).to(tl.int64)
    return c, expert, valid, x, gpu, col, step, share, w, single, w_single


@triton.jit
def _jacobi_step(share, previous, step, level, floor, inv_w, MOMENTUM: tl.constexpr):
    """level_shares' damped update towards the water-filling target, with momentum."""
    target = tl.maximum(level - floor, 0.0) * inv_w
    return tl.maximum(share + step * (target - share) + MOMENTUM * (share - previous), 0.0)


@triton.jit
def _store_cumulative(out_ptr, x, R, col, valid, total, upto, copies, rank):
    """Normalised cumulative shares (an expert without tokens: an even split), the last copy exactly
    1 so a draw never passes it."""
    cum = tl.where(total > 1e-6, upto.to(tl.float64) / tl.maximum(total, 1e-12).to(tl.float64),
                   rank.to(tl.float64) / tl.maximum(copies, 1.0).to(tl.float64))
    cum = tl.where(rank == copies, 1.0, cum)
    tl.store(out_ptr + x * R + col, cum, mask=valid)


@triton.jit
def level_cum_shares(counts_ptr, single_gpu_ptr, expert_ptr, gpu_ptr, col_ptr, step_ptr, cum_ptr, out_ptr,
                     iscratch_ptr, fscratch_ptr, E, R, C, TABLE, SWEEPS: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, COPY_BLOCK: tl.constexpr,
                     TABLE_CHUNKS: tl.constexpr, MOMENTUM: tl.constexpr, FIXED: tl.constexpr):
    """One layer's cumulative shares (the module's docstring says how). Copy j's run is the list
    entries j − col_j + k for k < ``copies`` (its expert's copy count)."""
    # int64 scratch: base loads [BN] | loads per sweep [SWEEPS, BN];
    # float32: floors, levels [SWEEPS, BC] each | shares [BC]. A row per sweep: nothing is re-zeroed.
    base_s = iscratch_ptr
    loads_s = iscratch_ptr + BLOCK_N
    floor_s = fscratch_ptr
    level_s = fscratch_ptr + SWEEPS * BLOCK_C
    share_s = fscratch_ptr + 2 * SWEEPS * BLOCK_C

    _write_single_copy_rows(out_ptr, R, TABLE, COPY_BLOCK, TABLE_CHUNKS)
    nn = tl.arange(0, BLOCK_N)
    tl.store(base_s + nn, tl.zeros([BLOCK_N], dtype=tl.int64))
    for s in tl.static_range(SWEEPS):
        tl.store(loads_s + s * BLOCK_N + nn, tl.zeros([BLOCK_N], dtype=tl.int64))
    c, expert, valid, x, gpu, col, step, share, w, single, w_single = _load_copies(
        counts_ptr, single_gpu_ptr, expert_ptr, gpu_ptr, col_ptr, step_ptr, cum_ptr, E, R, C, BLOCK_E, BLOCK_C, FIXED)
    inv_w = 1.0 / tl.maximum(w, 1e-6)
    first = c - col  # the list entry of copy j's expert's first copy
    longest = tl.max(tl.where(valid, col + 1, 0), axis=0)
    copies = tl.zeros([BLOCK_C], dtype=tl.int32)
    k = 0
    while k < longest:  # (a while: Triton's interpreter takes no tensor range bound)
        sibling = first + k
        same = valid & (sibling < C)
        copies += (same & (tl.load(expert_ptr + sibling, mask=same, other=-1) == expert)).to(tl.int32)
        k += 1
    tl.debug_barrier()  # the zeroed scratch before any atomic
    tl.atomic_add(base_s + single, w_single, mask=single >= 0, sem="relaxed", scope="cta")
    tl.debug_barrier()
    base = tl.load(base_s + gpu, mask=valid, other=0, volatile=True)

    previous = share
    for s in tl.static_range(SWEEPS):
        mine = share * w
        tl.atomic_add(loads_s + s * BLOCK_N + gpu, (mine * FIXED + 0.5).to(tl.int64), mask=valid,
                      sem="relaxed", scope="cta")
        tl.debug_barrier()
        load = base + tl.load(loads_s + s * BLOCK_N + gpu, mask=valid, other=0, volatile=True)
        floor = load.to(tl.float32) * (1.0 / FIXED) - mine
        tl.store(floor_s + s * BLOCK_C + c, floor)
        tl.debug_barrier()
        # k_j and Σ floors of the copies of j's expert at or below floor_j
        wet = tl.zeros([BLOCK_C], dtype=tl.float32)
        below = tl.zeros([BLOCK_C], dtype=tl.float32)
        k = 0
        while k < longest:
            inrun = valid & (k < copies)
            f_k = tl.load(floor_s + s * BLOCK_C + first + k, mask=inrun, other=0.0)
            low = inrun & (f_k <= floor)
            wet += low.to(tl.float32)
            below += tl.where(low, f_k, 0.0)
            k += 1
        tl.store(level_s + s * BLOCK_C + c, (w + below) / tl.maximum(wet, 1.0))
        tl.debug_barrier()
        level = tl.full([BLOCK_C], float("inf"), dtype=tl.float32)
        k = 0
        while k < longest:
            inrun = valid & (k < copies)
            level = tl.minimum(level, tl.load(level_s + s * BLOCK_C + first + k, mask=inrun, other=float("inf")))
            k += 1
        level = tl.where(valid, tl.maximum(level, 0.0), 0.0)  # padding: no run, keep it finite
        previous, share = share, _jacobi_step(share, previous, step, level, floor, inv_w, MOMENTUM)

    tl.store(share_s + c, share)
    tl.debug_barrier()
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    upto = tl.zeros([BLOCK_C], dtype=tl.float32)
    k = 0
    while k < longest:
        s_k = tl.load(share_s + first + k, mask=valid & (k < copies), other=0.0)
        total += s_k
        upto += tl.where(k <= col, s_k, 0.0)  # siblings at or before j: columns ≤ col_j
        k += 1
    _store_cumulative(out_ptr, x, R, col, valid, total, upto, copies.to(tl.float32), (col + 1).to(tl.float32))


def fused_cum_shares(counts: torch.Tensor, copies: ReplicaCopies, plan_cum_share: torch.Tensor, num_gpus: int,
                     sweeps: int, num_warps: int = 8) -> torch.Tensor:
    """``cumulative_shares(level_shares(counts, gpu, N, sweeps, start=plan_shares(plan_cum_share)), gpu)``
    in one kernel launch (no host sync; capturable in a CUDA graph).

    Args:
        counts: [E] tokens (pairs) routed to each expert (integer or float).
        copies: the layer's :class:`ReplicaCopies` (the dense table's replicated rows, listed).
        plan_cum_share: [E, R] float64 the plan's cumulative shares (padding inf).
        num_gpus: N. sweeps: Jacobi sweeps (0: the plan's shares, normalised).
        num_warps: threads of the block / 32 (8 measured fastest at DeepSeek-V3 shape on H200:
            one thread per listed copy).
    Tensors on a CUDA device (CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``).
    Returns [E, R] float64 cumulative shares, as ``choose_replicas`` draws from.
    """
    num_experts, width = plan_cum_share.shape
    listed = copies.expert.shape[0]
    if listed > MAX_FUSED_COPIES:
        raise ValueError(f"fused dispatch takes up to {MAX_FUSED_COPIES} listed copies, got {listed}")
    block_n, block_e, block_c = _pow2(num_gpus + 1), _pow2(num_experts), _pow2(max(listed, 1))
    device = plan_cum_share.device
    out = torch.empty(num_experts, width, dtype=torch.float64, device=device)
    # int64: base loads and loads per sweep [1 + SWEEPS, BN]; float32: floors, levels [SWEEPS, BC] | shares [BC]
    iscratch = torch.empty((1 + sweeps) * block_n, dtype=torch.int64, device=device)
    fscratch = torch.empty((2 * sweeps + 1) * block_c, dtype=torch.float32, device=device)
    level_cum_shares[(1,)](
        counts.contiguous(), copies.single_gpu, copies.expert, copies.gpu, copies.col, copies.step,
        plan_cum_share.to(torch.float64).contiguous(), out, iscratch, fscratch,
        num_experts, width, listed, num_experts * width,
        SWEEPS=sweeps, BLOCK_E=block_e, BLOCK_C=block_c, BLOCK_N=block_n, COPY_BLOCK=1024,
        TABLE_CHUNKS=-(-num_experts * width // 1024), MOMENTUM=MOMENTUM, FIXED=_FIXED, num_warps=num_warps)
    return out
