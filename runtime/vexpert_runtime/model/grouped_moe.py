"""Expert compute on one GPU as grouped GEMMs over packed expert rows.

A packed expert row is ``[gate (I·H) | up (I·H) | down (H·I)]`` (:func:`weights.pack_expert`), so a
stack of rows ``[E, D]`` gives, without copying, ``w13 [E, 2I, H]`` (gate and up as one matrix) and
``w2 [E, H, I]``. Tokens arrive sorted by local expert with ``offs[e]`` = end row of expert ``e``'s
group; rows past ``offs[-1]`` are padding (their output is undefined and must be ignored).

On CUDA (bf16/fp16) this is two Triton grouped GEMMs per stack (:mod:`.grouped_gemm_kernel`: SwiGLU in
the first one's epilogue; ``torch._grouped_mm`` where Triton is missing) — one pair each for the base
experts and for the slots — which is also what a CUDA graph captures. On CPU (fp32/bf16)
``torch._grouped_mm`` runs too (any group starts: :func:`group_align`), or a CPU rank keeps its
resident experts oneDNN-prepacked (:class:`PrepackedExperts`) where that is faster
(:func:`cpu_expert_kernel_seconds`); the per-expert loop stays as the reference in tests.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Token groups are padded to this many rows: the grouped GEMM wants 16-byte-aligned group starts.
GROUP_ALIGN = 16


def packed_views(rows: torch.Tensor, intermediate: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (w13 [E, 2I, H], w2 [E, H, I]) of packed rows [E, 3·I·H] (no copy; stride D per expert)."""
    n = intermediate * hidden
    if rows.shape[-1] != 3 * n:
        raise ValueError(f"packed rows have {rows.shape[-1]} elements, expected 3·I·H = {3 * n}")
    stride = rows.stride(0)
    w13 = rows.as_strided((rows.shape[0], 2 * intermediate, hidden), (stride, hidden, 1))
    w2 = rows.as_strided((rows.shape[0], hidden, intermediate), (stride, intermediate, 1), rows.storage_offset() + 2 * n)
    return w13, w2


def prepacking_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PrepackedExperts` can hold experts of ``dtype`` on ``device`` (a CPU torch
    built with oneDNN, fp32)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@dataclass(frozen=True)
class PrepackedExperts:
    """A CPU stack of experts as oneDNN-prepacked weights: per expert ``w13`` [2I, H] and ``w2``
    [H, I] in oneDNN's blocked layout (made once, at load), multiplied by ``_linear_pointwise``.

    Why: the CPU's per-expert loop multiplies a few rows per expert (a decode: ~2; a prompt chunk:
    tens), where MKL's ``F.linear`` re-packs the weight at every call. Prepacked, the same loop is
    1.2–1.3× faster at 1–2 rows per expert and ~2× at 4–64 (fp32, one thread, H 512, I 256:
    ``benchmarks/cpu_expert_layout.py``). oneDNN compiles a kernel per new row count on first use
    (~0.6 ms each). Results equal the packed rows' up to fp32 rounding (a different summation order)."""

    w13: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    intermediate: int

    @classmethod
    def of(cls, rows: torch.Tensor, intermediate: int, hidden: int) -> PrepackedExperts:
        """Prepack packed rows [E, 3·I·H] (the rows are not kept)."""
        w13, w2 = packed_views(rows, intermediate, hidden)
        reorder = torch.ops.mkldnn._reorder_linear_weight
        return cls(tuple(reorder(w.contiguous(), None) for w in w13), tuple(reorder(w.contiguous(), None) for w in w2),
                   intermediate)

    def __len__(self) -> int:
        return len(self.w13)

    def swiglu(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """:func:`grouped_swiglu`'s loop over these experts: x [M, H] sorted by expert, groups ending
        at ``offs`` [E]; rows past offs[-1] are undefined."""
        return swiglu_loop(x, self.w13, self.w2, offs, self.intermediate, _prepacked_linear)


def _prepacked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return out


def swiglu_loop(x: torch.Tensor, w13: torch.Tensor | Sequence[torch.Tensor],
                 w2: torch.Tensor | Sequence[torch.Tensor], offs: torch.Tensor, intermediate: int,
                 linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 linear_down: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """SwiGLU of every expert over its token group, one expert at a time (reads the group ends on the
    host): ``linear(rows, w13[e])`` then ``linear_down(act, w2[e])`` (default ``linear``) per non-empty group."""
    down = linear_down or linear
    out = torch.zeros_like(x)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            h = linear(x[start:end], w13[e])
            out[start:end] = down(F.silu(h[:, :intermediate]) * h[:, intermediate:], w2[e])
        start = end
    return out


def grouped_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped GEMMs (``torch._grouped_mm``) run for activations of ``dtype`` on ``device``:
    CUDA bf16/fp16, CPU fp32/bf16 (else the per-expert loop, which reads the group ends on the host)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype in (torch.bfloat16, torch.float16)
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def group_align(device: torch.device) -> int:
    """Rows a grouped GEMM's groups start on: :data:`GROUP_ALIGN` on CUDA (16-byte-aligned group
    starts); 1 on CPU, whose grouped GEMM takes any start (padding there would only add rows to compute)."""
    return GROUP_ALIGN if device.type == "cuda" else 1


def uses_grouped_gemm(x: torch.Tensor) -> bool:
    return grouped_gemm_runs(x.device, x.dtype)


def _aligned_for_grouped_mm(*tensors: torch.Tensor) -> bool:
    """``torch._grouped_mm`` wants 16-byte-aligned strides and data (real models' H and I are; tiny test
    shapes may not be: they take the loop)."""
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride() if stride != 1)
               for t in tensors)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - CUDA torch without Triton
        return False
    return True


def triton_experts_run(x: torch.Tensor) -> bool:
    """Whether the Triton grouped SwiGLU (:mod:`.grouped_gemm_kernel`) serves ``x``'s experts: CUDA
    bf16/fp16 with Triton importable (CUDA builds of torch ship it)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _triton_importable()


def gather_rows(x: torch.Tensor, row_src: torch.Tensor) -> torch.Tensor:
    """``x[row_src]`` [M, ·] — the rows a ``row_src`` names, copied where a kernel cannot read them in place. An empty x
    (a step with no tokens, whose buffer still has alignment rows naming row 0) gives zero rows: no row of it is read."""
    if x.shape[0] == 0:
        return x.new_zeros(row_src.shape[0], *x.shape[1:])
    return x.index_select(0, row_src)


def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                   grouped: bool | None = None, gpu_kernel: str | None = None,
                   out: torch.Tensor | None = None, row_src: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of every expert over its token group.

    Args:
        x: [M, H] tokens sorted by expert (groups end at ``offs``), M ≥ offs[-1].
        w13: [E, 2I, H]; w2: [E, H, I] (views from :func:`packed_views`).
        offs: [E] int32 cumulative group ends (non-decreasing; a multiple of GROUP_ALIGN on CUDA).
        grouped: force the grouped-GEMM (True) or loop (False) path; default: grouped where it runs.
        gpu_kernel: the grouped GEMMs on CUDA — "triton" (:func:`~.grouped_gemm_kernel.triton_swiglu`,
            the default where Triton runs: it streams decode-sized groups' weights near HBM bandwidth,
            ``benchmarks/grouped_gemm_tuning.py``) or "cutlass" (``torch._grouped_mm``).
        out: [M, H] to write the result into (the Triton kernel writes it there directly), or None.
        row_src: [M] int64 or None: x is then [T, H] and row m is ``x[row_src[m]]`` (the Triton kernel reads the
            rows in place; the other paths copy them first).
    Returns:
        [M, H] (``out`` when given); rows past offs[-1] are undefined.
    """
    if gpu_kernel not in (None, "triton", "cutlass"):
        raise ValueError(f"gpu_kernel must be 'triton', 'cutlass' or None, not {gpu_kernel!r}")
    if row_src is not None and not (grouped is not False and gpu_kernel != "cutlass" and uses_grouped_gemm(x)
                                    and triton_experts_run(x)):
        x, row_src = gather_rows(x, row_src), None
    if grouped is None:
        grouped = uses_grouped_gemm(x) and (_aligned_for_grouped_mm(x, w13, w2) or triton_experts_run(x))
    intermediate = w2.shape[-1]
    if grouped and gpu_kernel != "cutlass" and triton_experts_run(x):
        from vexpert_runtime.model.grouped_gemm_kernel import triton_swiglu

        return triton_swiglu(x, w13, w2, offs, out=out, row_src=row_src)
    if grouped:
        h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        act = F.silu(h[:, :intermediate]) * h[:, intermediate:]
        result = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    else:
        result = swiglu_loop(x, w13, w2, offs, intermediate, F.linear)
    if out is None:
        return result
    return out.copy_(result)


def cpu_expert_kernel_seconds(rows: torch.Tensor, intermediate: int, rows_per_expert: Sequence[int] = (1, 2, 8),
                              repeats: int = 3) -> dict[str, float]:
    """Seconds one SwiGLU pass over the stack ``rows`` [E, 3·I·H] (CPU) takes with each CPU expert kernel
    — ``grouped``: ``torch._grouped_mm`` over the packed rows; ``prepacked``: :class:`PrepackedExperts` —
    summed over passes of ``rows_per_expert`` tokens per expert (decodes: 1–2; prompt chunks: more),
    each the median of ``repeats`` interleaved runs after one warm-up (oneDNN compiles per row count).

    Why time rather than fix one: which is faster depends on the machine — on one 2-core Xeon,
    prepacked was 1.3× faster than the per-expert ``F.linear`` loop at 1–2 rows per expert; on
    another, 0.8× of it, where ``_grouped_mm`` was 1.13× faster (``benchmarks/cpu_expert_layout.py``)."""
    experts = rows.shape[0]
    hidden = rows.shape[1] // (3 * intermediate)
    w13, w2 = packed_views(rows, intermediate, hidden)
    prepacked = PrepackedExperts.of(rows, intermediate, hidden)
    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "grouped": lambda x, offs: grouped_swiglu(x, w13, w2, offs),  # the loop where _grouped_mm cannot run
        "prepacked": prepacked.swiglu,
    }
    total = dict.fromkeys(kernels, 0.0)
    generator = torch.Generator().manual_seed(0)
    for per_expert in rows_per_expert:
        x = torch.randn(experts * per_expert, hidden, generator=generator, dtype=rows.dtype)
        offs = (torch.arange(1, experts + 1) * per_expert).to(torch.int32)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for run in range(repeats + 1):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                kernel(x, offs)
                if run:
                    times[name].append(time.perf_counter() - start)
        for name in kernels:
            total[name] += statistics.median(times[name])
    return total


# Above this many one-hot elements (pairs × groups) rank_in_group sorts and group_counts scatters instead: the
# one-hot forms' memory and time grow with both, a sort's and a scatter's only with the pairs (a shape-only
# choice: graph-safe).
_ONE_HOT_LIMIT = 1 << 20


def group_counts(group: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Rows per group [num_groups] int64 of ``group`` [P] with values in [0, num_groups]; the value
    ``num_groups`` marks a row no group computes (padding, or a row of the other stack). ``weight`` [P] int64:
    each row counts that much (0 leaves it out); None: 1.

    Fixed-size forms instead of ``torch.bincount``, whose output size depends on the data (read back to the
    host, which a CUDA graph cannot capture): up to ``_ONE_HOT_LIMIT`` elements the sum of the one-hot rows —
    compiled, one reduction kernel that inductor fuses with what computes ``group`` (a ``scatter_add_`` is an
    eager fallback kernel after a memset: three pairs of them per MoE layer in the decode step's graph) —,
    above it a ``scatter_add_``.
    """
    if group.numel() * (num_groups + 1) <= _ONE_HOT_LIMIT:
        hit = group.unsqueeze(1) == torch.arange(num_groups, device=group.device)
        return hit.sum(0) if weight is None else torch.where(hit, weight.unsqueeze(1), 0).sum(0)
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=group.device)
    counts.scatter_add_(0, group, torch.ones_like(group) if weight is None else weight)
    return counts[:num_groups]


def rank_in_group(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each entry's rank within its group, in input order: how many earlier entries of ``group`` [P]
    (values in [0, num_groups]) have its value; [P] int64. What a stable sort by group gives, without
    the sort (a radix sort is several kernels per call on a GPU, and the EP layer needs three such
    ranks per MoE layer): the exclusive prefix sum of the entries' one-hot rows [P, num_groups + 1]
    (above ``_ONE_HOT_LIMIT`` elements, the stable sort). No host sync either way."""
    pairs = group.numel()
    if pairs * (num_groups + 1) > _ONE_HOT_LIMIT:
        order = torch.argsort(group, stable=True)
        counts = group_counts(group, num_groups + 1)  # the value num_groups counted too
        first = counts.cumsum(0) - counts
        rank = torch.empty_like(group)
        rank.scatter_(0, order, torch.arange(pairs, device=group.device) - first[group[order]])
        return rank
    column = group.view(-1, 1)
    one_hot = torch.zeros(pairs, num_groups + 1, dtype=torch.int32, device=group.device).scatter_(1, column, 1)
    before = one_hot.cumsum(0, dtype=torch.int32) - one_hot
    return before.gather(1, column).view(-1).to(torch.int64)


def group_layout(local_expert: torch.Tensor, num_groups: int, align: int = GROUP_ALIGN,
                 capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each routed pair goes in the expert-sorted, group-padded buffer (no host sync).

    Args:
        local_expert: [P] int64 local expert (group) of each (token, expert) pair, in [0, num_groups];
            ``num_groups`` marks a pair no group computes: it lands after the last group (past
            ``offs[-1]``, where the grouped GEMM does not read), on a row of its own.
        num_groups: number of groups (experts in the stack).
        align: groups start on multiples of this many rows.
        capacity: rows of the buffer, checked on the host (``ValueError`` if the pairs do not fit);
            None (what graph-captured callers pass) skips the check: every position is then below
            P + num_groups·(align − 1), the worst case (:func:`padded_capacity`).
    Returns:
        position [P] int64 row of each pair (distinct), offs [num_groups] int32 group ends.
    """
    counts = group_counts(local_expert, num_groups)
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    # Uncomputed pairs form one last, unpadded group after the real ones.
    starts = torch.cat([ends - padded, ends[-1:] if num_groups else ends.new_zeros(1)])
    position = starts[local_expert] + rank_in_group(local_expert, num_groups)
    if capacity is not None:
        total = int(ends[-1]) if num_groups else 0  # host sync: only where a caller asks for the check
        if total > capacity:
            raise ValueError(f"{total} padded rows do not fit a buffer of {capacity}")
    return position, ends.to(torch.int32)


def padded_capacity(pairs: int, groups: int, align: int = GROUP_ALIGN) -> int:
    """Rows a group-padded buffer needs for ``pairs`` pairs over ``groups`` groups, whatever the split."""
    return pairs + groups * (align - 1)
