"""The EP layer's grouped-GEMM layout in one GPU kernel (Triton): :func:`fused_arrange_received`,
:func:`fused_arrange_local`.

:func:`~vexpert_runtime.model.ep_moe.arrange_received` (and :func:`~vexpert_runtime.model.ep_moe.arrange_local`
on one rank) lay a layer's rows out by local expert with fixed shapes: two :func:`group_layout` passes (resident
experts, slots), each a count and a rank within the group as the exclusive prefix sum of one-hot rows, then the
row-source scatter. Compiled by inductor that is still ~8 kernels per MoE layer, three of them scans, ~34 µs a
layer at 256 decode tokens on an H100 (run 29's profile: benchmarks/README §10) for a few kilobytes of indices.
Here one program of one thread block does it all: a pass over the rows counts them per group, the group starts
come from the padded counts' prefix sums, a second pass ranks each row within its group (a scan over a chunk of
one-hot rows plus the earlier chunks' counts; then two sums over the group columns a row: its group's start plus
its rank, and a padding row's rank among its peers) and writes its position and the row-source entry.

The arithmetic is :func:`receive_layout`'s step for step (its torch code is the CPU twin and the reference the
tests compare with), and every value is an exact integer: the outputs are equal, not close — the padding rows'
positions included (each ranked, as there, among the rows the slot pass does not compute: padding and resident).

Runs where :func:`~vexpert_runtime.model.ep_moe.fused_layout_runs` says (CUDA, rows × groups ≤
:data:`~vexpert_runtime.model.ep_moe.FUSED_LAYOUT_LIMIT`: one block keeps them in a few chunks); elsewhere the
compiled torch code. This module imports Triton: :mod:`.ep_moe` imports it only where it runs. On an H200 the
graphed 256-sequence decode step went 1.782 → 1.76 ms with it (run 29e, benchmarks/README §10).

Shapes: ``T`` rows (received rows, or one rank's pairs), ``E/N`` resident experts, ``S`` slots,
``M`` = :func:`~vexpert_runtime.model.grouped_moe.padded_capacity` rows of the grouped-GEMM buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK_ENTRIES = 8192  # one-hot entries a chunk holds: FUSED_LAYOUT_LIMIT's rows in at most 16 chunks


@triton.jit
def _row_groups(group_src, local_table, stride_table, rows, T, cols, NUM_LOCAL: tl.constexpr, GP: tl.constexpr,
                LOOKUP: tl.constexpr):
    """The one-hot group rows [len(rows), GP] int32 of ``rows`` (a local expert, −1 padding → column NUM_LOCAL; with
    LOOKUP each row's expert id looked up in ``local_table``; rows ≥ T in no column), whether each row is real, and
    each row's column (GP for rows ≥ T)."""
    mask = rows < T
    g = tl.load(group_src + rows, mask=mask, other=0)
    if LOOKUP:
        g = tl.load(local_table + g * stride_table, mask=mask, other=0)
    g = tl.where(g < 0, NUM_LOCAL, g)
    g = tl.where(mask, g, GP)  # past every column: counted nowhere
    return (g[:, None] == cols[None, :]).to(tl.int32), mask, g


@triton.jit
def _layout_kernel(group_src, local_table, stride_table, row_src, position, resident_offs, slot_offs, computed,
                   T, M, resident_rows,
                   RESIDENT: tl.constexpr, SLOTS: tl.constexpr, ALIGN: tl.constexpr, LOOKUP: tl.constexpr,
                   TOKEN_DIV: tl.constexpr, GP: tl.constexpr, CHUNK: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """One program. group_src [T] int64: each row's local expert (−1 padding), or with LOOKUP its expert id,
    whose local expert is ``local_table[id · stride_table]`` (column 0 of an [E, 1] table: one rank's pairs).
    Writes position [T] int64, row_src [M] int64 (row // TOKEN_DIV of the row landing there, else 0),
    resident_offs [RESIDENT] int32, slot_offs [SLOTS] int32 (group ends within each region), computed
    [RESIDENT + SLOTS] int64. GP: a power of two > RESIDENT + SLOTS (the last real column: padding)."""
    NUM_LOCAL: tl.constexpr = RESIDENT + SLOTS
    cols = tl.arange(0, GP)
    is_res = cols < RESIDENT
    is_slot = (cols >= RESIDENT) & (cols < NUM_LOCAL)
    is_pad = cols == NUM_LOCAL

    # pass 1: rows per group
    counts = tl.zeros([GP], dtype=tl.int32)
    for first in range(0, T, CHUNK):
        hit, _, _ = _row_groups(group_src, local_table, stride_table, first + tl.arange(0, CHUNK), T, cols, NUM_LOCAL,
                                GP, LOOKUP)
        counts += tl.sum(hit, 0)

    # group starts: resident groups from row 0, slot groups from resident_rows, padding after the last slot group
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    res_padded = tl.where(is_res, padded, 0)
    slot_padded = tl.where(is_slot, padded, 0)
    res_ends = tl.cumsum(res_padded, 0)
    slot_ends = tl.cumsum(slot_padded, 0)
    slot_total = tl.sum(slot_padded, 0)
    pad_start = resident_rows + slot_total
    starts = tl.where(is_res, res_ends - res_padded, tl.where(is_slot, resident_rows + slot_ends - slot_padded, pad_start))
    tl.store(resident_offs + cols, res_ends, mask=is_res)
    tl.store(slot_offs + (cols - RESIDENT), slot_ends, mask=is_slot)
    tl.store(computed + cols, counts.to(tl.int64), mask=cols < NUM_LOCAL)

    # row_src: 0 where no row lands (then the rows' entries, after the barrier: one block orders its own stores)
    for first in range(0, M, ZERO_BLOCK):
        offs = first + tl.arange(0, ZERO_BLOCK)
        tl.store(row_src + offs, tl.zeros([ZERO_BLOCK], dtype=tl.int64), mask=offs < M)
    tl.debug_barrier()

    # pass 2: each row's rank within its group, its position and its row-source entry
    earlier = tl.zeros([GP], dtype=tl.int32)  # rows per group in the chunks before this one
    # a padding row is ranked among the rows the slot pass leaves uncomputed: resident rows and padding
    pad_peers = (is_res | is_pad).to(tl.int32)
    for first in range(0, T, CHUNK):
        rows = first + tl.arange(0, CHUNK)
        hit, mask, g = _row_groups(group_src, local_table, stride_table, rows, T, cols, NUM_LOCAL, GP, LOOKUP)
        before = tl.cumsum(hit, 0) - hit + earlier[None, :]  # [CHUNK, GP] earlier rows of each group
        # two reductions over the group columns per row: its group's start + its rank there (any row), and a padding
        # row's rank among its peers
        own = tl.sum((before + starts[None, :]) * hit, 1)
        pad = pad_start + tl.sum(before * pad_peers[None, :], 1)
        pos = tl.where(g == NUM_LOCAL, pad, own).to(tl.int64)
        tl.store(position + rows, pos, mask=mask)
        tl.store(row_src + pos, (rows // TOKEN_DIV).to(tl.int64), mask=mask)
        earlier += tl.sum(hit, 0)


LaunchConfig = tuple[int, int]  # (warps, one-hot entries a chunk holds)


def launch_config(rows: int, groups: int) -> LaunchConfig:
    """(warps, chunk entries) of the layout kernel for ``rows`` rows over ``groups`` one-hot columns (a power of two).

    From ``benchmarks/layout_kernel_tuning.py`` on an H100 (``results/serve_engine/layout_kernel_tuning_run32_h100.json``,
    16 groups, graphed): the largest chunk is the fastest at every row count (each chunk is a pass of scans);
    8 warps at 512 rows (6.72 / 6.37 µs against 7.34 / 7.28 with 4, local / received rows), 4 at 128 (3.29 / 3.11
    against 3.84 / 3.20 with 8), and at 32 rows all within 0.3 µs. So 8 warps past 256 rows."""
    return (8 if rows > 256 else 4), _CHUNK_ENTRIES


def _launch(group_src: torch.Tensor, local_table: torch.Tensor | None, rows: int, resident: int, slots: int,
            align: int, token_div: int, config: LaunchConfig | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from vexpert_runtime.model.grouped_moe import padded_capacity

    device = group_src.device
    resident_rows = padded_capacity(rows, resident, align)
    buffer_rows = resident_rows + padded_capacity(rows, slots, align)
    groups = triton.next_power_of_2(resident + slots + 1)
    row_src = torch.empty(buffer_rows, dtype=torch.int64, device=device)
    position = torch.empty(rows, dtype=torch.int64, device=device)
    resident_offs = torch.empty(resident, dtype=torch.int32, device=device)
    slot_offs = torch.empty(max(slots, 1), dtype=torch.int32, device=device)[:slots]  # no null pointer at S = 0
    computed = torch.empty(resident + slots, dtype=torch.int64, device=device)
    table = group_src if local_table is None else local_table
    warps, entries = config or launch_config(rows, groups)
    _layout_kernel[(1,)](
        group_src, table, 0 if local_table is None else local_table.stride(0), row_src, position, resident_offs,
        slot_offs, computed, rows, buffer_rows, resident_rows,
        RESIDENT=resident, SLOTS=slots, ALIGN=align, LOOKUP=local_table is not None, TOKEN_DIV=token_div, GP=groups,
        CHUNK=max(1, min(triton.next_power_of_2(rows), entries // groups)), ZERO_BLOCK=1024, num_warps=warps,
    )
    return row_src, position, resident_offs, slot_offs, computed


def fused_arrange_received(recv_local: torch.Tensor, resident: int, slots: int, align: int,
                           config: LaunchConfig | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~vexpert_runtime.model.ep_moe.arrange_received` in one kernel: the same outputs, equal.
    recv_local [T] int64 contiguous (−1 padding). ``config``: (warps, chunk entries), default :func:`launch_config`'s."""
    return _launch(recv_local.contiguous(), None, recv_local.numel(), resident, slots, align, 1, config)


def fused_arrange_local(ids: torch.Tensor, local: torch.Tensor, resident: int, slots: int, align: int,
                        config: LaunchConfig | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~vexpert_runtime.model.ep_moe.arrange_local` in one kernel for a table of one copy per expert
    (``local`` [E, 1]: an EP group of one), where the replica choice is the lookup ``local[id, 0]``:
    the same outputs, equal. ids [B, K] int64. ``config`` as :func:`fused_arrange_received`'s."""
    if local.shape[1] != 1:
        raise ValueError(f"fused_arrange_local takes a table of one copy per expert, not {local.shape[1]}")
    return _launch(ids.contiguous().view(-1), local, ids.numel(), resident, slots, align, ids.shape[1], config)
