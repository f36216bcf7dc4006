"""Expert SwiGLU on a GPU as two Triton grouped GEMMs over the packed expert rows: :func:`triton_swiglu`.

Why our own kernel: a decode step multiplies few rows per expert (256 sequences × top-2 over 8 experts:
~64; 16 sequences: ~4), so the expert GEMMs are bound by reading the experts' weights, and
``torch._grouped_mm`` (CUTLASS, a tile shape it picks for large groups) read them at ~50 % of an
H200's HBM bandwidth at 64 rows per expert — a third of the whole decode step (benchmarks/README.md,
§10, run 12). A grouped GEMM whose tiles fit the row counts, with a long pipelined loop over K, streams
them near bandwidth, and the gate/up GEMM takes SwiGLU in its epilogue (gate and up columns of the same
block in two accumulators), so the [M, 2I] intermediate is never written. Two grids, picked per shape by
the launch table: expert-major (one program per expert, block of output columns and row split, the
expert's rows in blocks of ``BLOCK_M`` shared out over ``SPLIT_M`` programs) and row-tile (one program
per tile of ``BLOCK_M`` rows of one expert and block of columns: however skewed the routing, a hot
expert's tiles all run at once, reading its weights together, mostly from L2).

Layout as :func:`~.grouped_moe.grouped_swiglu`: ``x`` [M, H] sorted by expert, group ``e`` the rows
``[offs[e-1], offs[e])`` (device tensor: no host sync, graph-safe: the grid is a function of the
shapes only); rows past ``offs[-1]`` are not written. Weights are the strided views of packed rows
(``w13`` [E, 2I, H], ``w2`` [E, H, I]); no copy. Launch parameters by rows per expert
(:func:`launch_config`, from ``benchmarks/grouped_gemm_tuning.py`` on an H200). The CPU tests run it
in Triton's interpreter against the per-expert loop.

Block-FP8 experts (DeepSeek-V3's checkpoint format) are read as stored: fp8 weights, widened in the kernel, and
their float32 block scales (:meth:`~.expert_format.ExpertFormat.fp8_stack`; W8A16 — the activations stay bf16),
half the bytes of a bf16 expert and no dequantised copy; their own launch table (:data:`_FP8_CONFIGS`). W8A8
(``model.expert_compute: w8a8``): the activations arrive quantised too — FP8 with a float32 scale per row and
weight scale column, made ahead of the kernel by :func:`~.fp8_activations.quantize_activation_groups` —, and each K
tile's dot runs on the FP8 tensor cores, scaled by both; its own table (:data:`_W8A8_CONFIGS`). (The gate and up
halves' FP8 branches are written out twice on purpose: a shared helper compiles to other SASS than the binaries
run 26 measured.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vexpert_runtime.model.fp8_activations import ActivationQuantizer, quantize_activation_groups


@triton.jit
def _gemm_tile(x, xs, w_expert, s_expert, out, rows, a_rows, rmask, n, nmask, K, UP, UP_S, stride_xm, stride_xsm,
               stride_wn, stride_sn, stride_om, SWIGLU: tl.constexpr, FP8: tl.constexpr, A8: tl.constexpr,
               SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """out[rows, n] = x[a_rows] @ w_expert[n, :]ᵀ (or SwiGLU of the gate column n and the up column UP + n); a_rows
    is rows itself, or the rows of x they gather (:func:`_a_rows`).
    FP8: w_expert is float8_e4m3fn with float32 block scales s_expert [⌈N'/SCALE_N⌉, ⌈K/SCALE_K⌉] (row
    stride stride_sn; the up half's scale rows start at UP_S), and each K tile lies in one scale column
    (BLOCK_K divides SCALE_K). Where the column block lies in one scale row too (BLOCK_N divides SCALE_N:
    DeepSeek-V3's 128-wide blocks), the tile's scale is one number, applied to the activation tile before
    the dot, so the dot accumulates in place as the bf16 one does (one bf16 rounding of x·scale, as
    dequantising the weights rounds w·scale); else each column's scale multiplies its dot product.
    A8 (W8A8): x is FP8 too, with float32 scales xs [M, ⌈K/SCALE_K⌉] (row stride stride_xsm: one per row and
    weight scale column, :func:`~.fp8_activations.quantize_activation_groups`), and each K tile's dot runs on the
    FP8 tensor cores, its product scaled by the row's and the weights' scales — nothing is widened."""
    kk = tl.arange(0, BLOCK_K)
    a_ptr = x + a_rows[:, None].to(tl.int64) * stride_xm + kk[None, :]
    b_ptr = w_expert + n[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BLOCK_K, BLOCK_N]
    ONE_SCALE: tl.constexpr = SCALE_N % BLOCK_N == 0
    if ONE_SCALE:
        s_ptr = s_expert + (tl.min(n, 0) // SCALE_N) * stride_sn  # the column block's scale row
    else:
        s_ptr = s_expert + (n // SCALE_N) * stride_sn  # [BLOCK_N]: each column's scale row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + kk < K
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if A8:
            a_s = tl.load(xs + a_rows.to(tl.int64) * stride_xsm + k0 // SCALE_K, mask=rmask, other=0.0)
            if ONE_SCALE:
                scale = tl.load(s_ptr + k0 // SCALE_K)
                acc += tl.dot(a, b) * (a_s[:, None] * scale)
            else:
                scales = tl.load(s_ptr + k0 // SCALE_K, mask=nmask, other=0.0)
                acc += tl.dot(a, b) * (a_s[:, None] * scales[None, :])
        elif FP8:
            if ONE_SCALE:
                scale = tl.load(s_ptr + k0 // SCALE_K)
                acc = tl.dot((a * scale).to(a.dtype), b.to(a.dtype), acc)
            else:
                scales = tl.load(s_ptr + k0 // SCALE_K, mask=nmask, other=0.0)
                acc += tl.dot(a, b.to(a.dtype)) * scales[None, :]
        else:
            acc = tl.dot(a, b, acc)
        if SWIGLU:
            b_up = tl.load(b_ptr + UP * stride_wn, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if A8:
                if ONE_SCALE:
                    scale_up = tl.load(s_ptr + UP_S * stride_sn + k0 // SCALE_K)
                    acc_up += tl.dot(a, b_up) * (a_s[:, None] * scale_up)
                else:
                    scales_up = tl.load(s_ptr + UP_S * stride_sn + k0 // SCALE_K, mask=nmask, other=0.0)
                    acc_up += tl.dot(a, b_up) * (a_s[:, None] * scales_up[None, :])
            elif FP8:
                if ONE_SCALE:
                    scale_up = tl.load(s_ptr + UP_S * stride_sn + k0 // SCALE_K)
                    acc_up = tl.dot((a * scale_up).to(a.dtype), b_up.to(a.dtype), acc_up)
                else:
                    scales_up = tl.load(s_ptr + UP_S * stride_sn + k0 // SCALE_K, mask=nmask, other=0.0)
                    acc_up += tl.dot(a, b_up.to(a.dtype)) * scales_up[None, :]
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(out + rows[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _a_rows(row_src, rows, rmask, GATHER: tl.constexpr):
    """The rows of x a tile multiplies: its own rows, or (GATHER) the x rows ``row_src`` names for them — the EP
    layer's tokens read in place instead of copied into an expert-sorted buffer first (vLLM's fused MoE kernel
    reads its sorted token ids so)."""
    a_rows = rows.to(tl.int64)  # (one return of one type: Triton's compiler wants that of every branch)
    if GATHER:
        a_rows = tl.load(row_src + rows, mask=rmask, other=0)
    return a_rows


@triton.jit
def _grouped_gemm_kernel(x, xs, w, s, offs, out, row_src, K, N, UP, UP_S, stride_xm, stride_xsm, stride_we, stride_wn,
                         stride_se, stride_sn, stride_om, split_m, SWIGLU: tl.constexpr, FP8: tl.constexpr,
                         A8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr):
    """Expert-major grid. Program (n block, expert, s) takes the expert's row blocks s, s + split_m, …:
    a hot expert's rows spread over split_m programs (which read its weights at the same time, mostly
    from L2)."""
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(offs + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offs + expert)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_expert = w + expert.to(tl.int64) * stride_we
    s_expert = s + expert.to(tl.int64) * stride_se
    for m0 in range(start + split * BLOCK_M, end, BLOCK_M * split_m):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        _gemm_tile(x, xs, w_expert, s_expert, out, rows, _a_rows(row_src, rows, rmask, GATHER), rmask, n, nmask, K,
                   UP, UP_S, stride_xm, stride_xsm, stride_wn, stride_sn, stride_om, SWIGLU, FP8, A8, SCALE_N, SCALE_K,
                   BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _grouped_gemm_row_tile_kernel(x, xs, w, s, offs, out, row_src, K, N, UP, UP_S, stride_xm, stride_xsm, stride_we,
                                  stride_wn, stride_se, stride_sn, stride_om, E: tl.constexpr, EP: tl.constexpr,
                                  SWIGLU: tl.constexpr, FP8: tl.constexpr, A8: tl.constexpr, SCALE_N: tl.constexpr,
                                  SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, GATHER: tl.constexpr):
    """Row-tile grid. Program (t, n block) takes row tile t of the list of every expert's tiles (each
    group cut into tiles of BLOCK_M rows): a hot expert's tiles all run at once, side by side on the
    same columns, so they read its weights together, mostly from L2, however skewed the routing (as
    vLLM's fused MoE kernel does). The tile's expert is found from the group ends on the device;
    programs past the last tile do nothing (the grid is sized for the worst case, from the shapes)."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e_idx = tl.arange(0, EP)
    ends = tl.load(offs + e_idx, mask=e_idx < E, other=0)
    starts = tl.load(offs + e_idx - 1, mask=(e_idx > 0) & (e_idx < E), other=0)
    tiles = tl.where(e_idx < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    after = tl.cumsum(tiles, 0)  # tiles up to and including each expert
    expert = tl.sum((after <= tile).to(tl.int32), 0)
    if expert < E:
        here = e_idx == expert
        start = tl.sum(tl.where(here, starts, 0), 0)
        end = tl.sum(tl.where(here, ends, 0), 0)
        first_tile = tl.sum(tl.where(here, after - tiles, 0), 0)
        rows = start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < end
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _gemm_tile(x, xs, w + expert.to(tl.int64) * stride_we, s + expert.to(tl.int64) * stride_se, out, rows,
                   _a_rows(row_src, rows, rmask, GATHER), rmask, n, n < N, K, UP, UP_S, stride_xm, stride_xsm,
                   stride_wn, stride_sn, stride_om, SWIGLU, FP8, A8, SCALE_N, SCALE_K, BLOCK_M, BLOCK_N, BLOCK_K)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_M) per GEMM ("gate_up", "down"), by rows per expert up
# to the key. SPLIT_M ≥ 1: the expert-major grid with that row split; 0: the row-tile grid. From
# benchmarks/grouped_gemm_tuning.py on an H200 (results/serve_engine/grouped_gemm_tuning_run15.json: the
# least time over even + skewed splits per bucket) and the graphed decode step: at 16 sequences (≤ 24 rows
# per expert in the EP layer's buffer) the expert-major grid took 0.440 ms in the step against the row
# tiles' 0.479 ms (run 15), though the sweep alone favours the tiles there; past that the row tiles win
# (expert GEMMs per graphed step, run 14's table → this one: 64 sequences 0.761 → 0.559 ms, 256: 0.904 → 0.697 ms).
LaunchConfig = tuple[int, int, int, int, int, int]
_CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    "gate_up": ((24, (16, 64, 128, 4, 3, 4)), (40, (16, 64, 128, 4, 3, 0)), (1 << 30, (64, 64, 128, 4, 4, 0))),
    "down": ((24, (16, 64, 128, 4, 3, 4)), (40, (16, 64, 128, 4, 3, 0)), (1 << 30, (64, 128, 64, 4, 4, 0))),
}


# The same over block-FP8 rows (half the bytes per K tile, widened in the kernel), from grouped_gemm_tuning.py --fp8
# on an H100 (results/serve_engine/grouped_gemm_tuning_fp8_run26b_h100.json): gate/up 5 / 14 / 24 % less time than
# the bf16 table's choices per bucket, down 0–7 %.
_FP8_CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    "gate_up": ((24, (16, 64, 128, 8, 3, 1)), (40, (16, 64, 128, 8, 3, 4)), (1 << 30, (64, 64, 128, 4, 3, 0))),
    "down": ((24, (16, 64, 128, 4, 3, 2)), (40, (16, 64, 128, 8, 3, 0)), (1 << 30, (64, 64, 64, 4, 3, 1))),
    "linear": ((24, (16, 64, 128, 4, 3, 2)), (40, (16, 64, 128, 8, 3, 0)), (1 << 30, (64, 128, 128, 8, 3, 0))),
}


# W8A8 (FP8 activations against FP8 rows, every K tile 128 wide: DeepSeek-V3's scale columns), from
# grouped_gemm_tuning.py --w8a8 on an H100 with the activations quantised ahead, as served
# (results/serve_engine/grouped_gemm_tuning_w8a8_run27b_h100.json, the least time over even + skewed splits per
# bucket): 1-8 % less than run 26c's table (swept with in-kernel quantisation); the graphed 256-sequence step
# 1.881 -> 1.847 ms. "linear" (the FP8 linear layers, M rows of one weight) starts as "down"'s choices, which left
# o_proj's 56 column blocks too few programs at 64 rows (run 27: FP8 linears slower than cuBLAS);
# benchmarks/fp8_linear_tuning.py sweeps it over DeepSeek-V3's linear shapes: run 29 on an H100 wrote the "linear" rows
# here and in _FP8_CONFIGS (results/serve_engine/fp8_linear_tuning_run29_h100.json; summed over DeepSeek-V3's ten linear
# shapes: W8A8 at ≤ 40 rows 0.341 → 0.284 ms, W8A16 past 40 rows 1.628 → 1.176 ms — both still slower than cuBLAS bf16,
# 0.19 / 0.39 ms, so dense bf16 stays the linears' default).
_W8A8_CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    "gate_up": ((24, (16, 64, 128, 4, 3, 2)), (40, (16, 64, 128, 4, 3, 4)), (1 << 30, (64, 128, 128, 8, 4, 0))),
    "down": ((24, (16, 128, 128, 4, 3, 0)), (40, (16, 128, 128, 4, 3, 0)), (1 << 30, (64, 128, 128, 4, 4, 0))),
    "linear": ((24, (16, 64, 128, 4, 4, 0)), (40, (16, 64, 128, 4, 4, 0)), (1 << 30, (64, 128, 128, 4, 4, 0))),
}


def launch_config(gemm: str, rows_per_expert: float, fp8: bool = False, a8: bool = False) -> LaunchConfig:
    """Launch parameters of ``gemm`` ("gate_up" / "down"; "linear": a block-FP8 linear layer, one "expert" of
    :mod:`~vexpert_runtime.serve.fp8_linear`, FP8 tables only) for groups of ~``rows_per_expert`` rows (a
    shape-only figure: the buffer's rows over the experts, so a graph bucket keeps one choice), over
    bf16 / fp16 weights or (``fp8``) block-FP8 ones, against FP8 activations too (``a8``, W8A8)."""
    table = _W8A8_CONFIGS if a8 else _FP8_CONFIGS if fp8 else _CONFIGS
    for limit, config in table[gemm]:
        if rows_per_expert <= limit:
            return config
    raise AssertionError("the last limit covers every row count")


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, swiglu: bool = False,
                 config: LaunchConfig | None = None, out: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, scale_block: tuple[int, int] = (128, 128),
                 x_scales: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 row_src: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] grouped by ``offs`` [E] (int32 ends) times w [E, N', K] (any row and expert stride,
    unit stride along K) → [M, N] with N = N' (or N'/2 and SwiGLU of the two halves when ``swiglu``),
    written into ``out`` (unit column stride) when given; rows past offs[-1] are not written.
    With ``row_src`` [M] (int64, each a row of x) x is [T, K], and row m multiplies ``x[row_src[m]]``: the rows are
    read where they are, not copied into the grouped order first (x_scales then [T, ·] too).

    Block-FP8 weights: w float8_e4m3fn and ``scales`` [E, S_N, S_K] float32 (any expert and row stride,
    unit stride along S_K), the ``weight_scale_inv`` of ``scale_block`` (rows, columns) tiles: w's
    [n, k] weighs ``w[n, k] · scales[n // bn, k // bk]``. With ``swiglu`` the gate's scale rows come first,
    then the up half's (⌈N/bn⌉ each). Read as stored: no dequantised copy of the weights is made.

    W8A8: x float8_e4m3fn too, with ``x_scales`` [M, ⌈K/bk⌉] float32 (one per row and weight scale column,
    :func:`~.fp8_activations.quantize_activation_groups` with group bk), K tiles of 32 or more; the result is
    ``out_dtype`` (or ``out``'s)."""
    sources, depth = x.shape
    rows = sources if row_src is None else row_src.shape[0]
    if row_src is not None and (row_src.dtype != torch.int64 or row_src.dim() != 1 or row_src.stride(0) != 1):
        raise ValueError(f"row_src must be a contiguous [M] int64 tensor, got {row_src.dtype} {tuple(row_src.shape)}")
    experts, columns, _ = w.shape
    if w.shape[2] != depth or w.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError(f"grouped_gemm wants x [M, K] and w [E, N, K] with unit stride along K: "
                         f"got x {tuple(x.shape)} strides {x.stride()}, w {tuple(w.shape)} strides {w.stride()}")
    width = columns // 2 if swiglu else columns
    a8 = x.dtype == torch.float8_e4m3fn
    if a8 and (scales is None or x_scales is None or (out is None and out_dtype is None)):
        raise ValueError("FP8 activations (W8A8) want FP8 weights with their scales, the activations' x_scales and "
                         "out or out_dtype")
    if out is None:
        out = x.new_empty(rows, width, dtype=out_dtype or x.dtype)
    elif out.shape != (rows, width) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {width}] with unit column stride, got {tuple(out.shape)} {out.stride()}")
    if rows == 0 or experts == 0:
        return out
    fp8 = scales is not None
    block_m, block_n, block_k, warps, stages, split_m = config or launch_config(
        "gate_up" if swiglu else "down", rows / experts, fp8, a8)
    if fp8:
        assert scales is not None
        scale_n, scale_k = scale_block
        up_scale_rows = triton.cdiv(width, scale_n) if swiglu else 0
        want = (experts, 2 * up_scale_rows if swiglu else triton.cdiv(columns, scale_n), triton.cdiv(depth, scale_k))
        if w.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or tuple(scales.shape) != want \
                or scales.stride(2) != 1:
            raise ValueError(f"FP8 grouped_gemm wants w float8_e4m3fn and scales float32 {list(want)} with unit "
                             f"last stride: got w {w.dtype}, scales {scales.dtype} {list(scales.shape)} {scales.stride()}")
        while scale_k % block_k:  # a K tile must lie in one scale column
            block_k //= 2
        if block_k < (32 if a8 else 16):
            raise ValueError(f"scale block {scale_block}: its columns must be a multiple of "
                             f"{'32 (FP8 dots, W8A8)' if a8 else '16'}")
        scale_args = (scales, up_scale_rows, scales.stride(0), scales.stride(1))
    else:
        scale_n, scale_k = 1, 1
        scale_args = (w, 0, 0, 0)  # never read
    s, up_s, stride_se, stride_sn = scale_args
    if a8:
        assert x_scales is not None
        want_xs = (sources, triton.cdiv(depth, scale_k))
        if x_scales.dtype != torch.float32 or tuple(x_scales.shape) != want_xs or x_scales.stride(1) != 1:
            raise ValueError(f"W8A8 grouped_gemm wants x_scales float32 {list(want_xs)} with unit column stride: got "
                             f"{x_scales.dtype} {list(x_scales.shape)} {x_scales.stride()}")
        xs, stride_xsm = x_scales, x_scales.stride(0)
    else:
        xs, stride_xsm = x, 0  # never read
    gather = offs if row_src is None else row_src  # (never read without GATHER)
    if split_m == 0:  # row tiles: at most one partial tile per group
        tiles = (triton.cdiv(rows, block_m) + experts, triton.cdiv(width, block_n))
        _grouped_gemm_row_tile_kernel[tiles](
            x, xs, w, s, offs, out, gather, depth, width, width, up_s, x.stride(0), stride_xsm, w.stride(0),
            w.stride(1), stride_se, stride_sn, out.stride(0), E=experts, EP=triton.next_power_of_2(experts),
            SWIGLU=swiglu, FP8=fp8, A8=a8, SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, GATHER=row_src is not None, num_warps=warps, num_stages=stages)
    else:
        expert_major = (triton.cdiv(width, block_n), experts, split_m)
        _grouped_gemm_kernel[expert_major](
            x, xs, w, s, offs, out, gather, depth, width, width, up_s, x.stride(0), stride_xsm, w.stride(0),
            w.stride(1), stride_se, stride_sn, out.stride(0), split_m, SWIGLU=swiglu, FP8=fp8, A8=a8, SCALE_N=scale_n,
            SCALE_K=scale_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATHER=row_src is not None,
            num_warps=warps, num_stages=stages)
    return out


def triton_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                  configs: tuple[LaunchConfig, LaunchConfig] | None = None,
                  out: torch.Tensor | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  scale_block: tuple[int, int] = (128, 128), fp8_activations: bool = False,
                  quantize: ActivationQuantizer = quantize_activation_groups,
                  x_scales: torch.Tensor | None = None, row_src: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~.grouped_moe.grouped_swiglu` as two Triton launches: x [M, H], w13 [E, 2I, H], w2 [E, H, I],
    offs [E] → [M, H] (into ``out`` when given; rows past offs[-1] undefined). ``row_src`` [M] int64: x is [T, H]
    and row m is ``x[row_src[m]]``, gathered by the gate/up GEMM as it reads (:func:`grouped_gemm`; W8A8 quantises
    the T rows of x, not M). ``configs``: (gate_up,
    down) launch parameters, default :func:`launch_config`'s. Block-FP8 experts: w13 and w2
    float8_e4m3fn with ``scales`` (s13 [E, 2·⌈I/bn⌉, ⌈H/bk⌉], s2 [E, ⌈H/bn⌉, ⌈I/bk⌉]) of ``scale_block``
    (:meth:`~.expert_format.ExpertFormat.fp8_stack`). ``fp8_activations`` (W8A8, block-FP8 experts): x and then
    the SwiGLU intermediate (written in x's dtype first) quantised per row and ``scale_block``-wide column group
    (``quantize``: :func:`~.fp8_activations.quantize_activation_groups`, or the same compiled into one kernel by
    the EP layer's fusion) before each GEMM; with ``x_scales`` x arrives quantised so (float8_e4m3fn, the
    dispatch's wire rows) and ``out`` gives the result's dtype."""
    gate_up, down = configs or (None, None)
    s13, s2 = scales or (None, None)
    if fp8_activations:
        group = scale_block[1]
        if x_scales is None:
            xq, xs, dtype = *quantize(x, group), x.dtype
        elif out is None:
            raise ValueError("triton_swiglu over quantised x (x_scales) wants out, whose dtype the result takes")
        else:
            xq, xs, dtype = x, x_scales, out.dtype
        act = grouped_gemm(xq, w13, offs, swiglu=True, config=gate_up, scales=s13, scale_block=scale_block,
                           x_scales=xs, out_dtype=dtype, row_src=row_src)
        aq, as_ = quantize(act, group)
        return grouped_gemm(aq, w2, offs, config=down, out=out, scales=s2, scale_block=scale_block, x_scales=as_,
                            out_dtype=dtype)
    act = grouped_gemm(x, w13, offs, swiglu=True, config=gate_up, scales=s13, scale_block=scale_block, row_src=row_src)
    return grouped_gemm(act, w2, offs, config=down, out=out, scales=s2, scale_block=scale_block)
