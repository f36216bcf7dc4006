"""Expert-parallel MoE forward: route → pick a physical replica per (token, expert) pair →
all-to-all dispatch → expert compute over base experts and vExpert slots → all-to-all combine.

Every EP rank ("GPU") holds ``E/N`` resident (base) experts and, while a layer runs, the slots its
group's buffer holds. A rank's *local* experts are numbered ``0..E/N−1`` for its base experts
(ascending logical id) and ``E/N + s`` for slot ``s`` — the allocator's physical-id layout
(:meth:`Plan.physical_ids`), so a plan translates into a :class:`RoutingTable` by subtraction.

Replicated experts: each rank splits its own tokens of an expert over the expert's copies in
proportion to shares (stratified positions, rotated by rank so small counts spread too): the plan's
water-filling shares (``dispatch="plan"``), or shares water-filled every layer from this
iteration's own counts, rank-local (``"local"``) or all-reduced over the group (``"global"``); see
:mod:`vexpert_runtime.model.dispatch`.

Fixed shapes, no host synchronisation (DeepEP low-latency style): a rank sends every rank a block
of ``C`` rows (default ``B·K``: all its pairs could go to one rank, so nothing is dropped) plus the
rows' local expert indices, by equal-split ``all_to_all_single`` (gloo on CPU, NCCL on GPU); the
receiver groups the rows by local expert on the device. No split size, count or group end is read
back to the host, so on CUDA a layer — a whole iteration — can be captured in a CUDA graph, and a
plan switch only overwrites the :class:`DeviceRoutingTable` in place. The price is memory and
all-to-all volume proportional to ``N·C`` instead of the pairs actually routed.

Shapes: ``B`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``N`` ranks, ``S`` slots
per buffer, ``R`` max copies of an expert, ``P = B·K`` (token, expert) pairs, ``C`` rows per
destination rank, ``T = N·C`` rows received.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vexpert_runtime.model import fusion
from vexpert_runtime.model.dispatch import DispatchMode, dispatch_cum_share, triton_available
from vexpert_runtime.model.expert_format import ExpertFormat, w8a8_swiglu
from vexpert_runtime.model.fp8_activations import (
    ActivationQuantizer,
    quantize_activation_groups,
    quantized_wire_rows,
    unpack_wire_rows,
)
from vexpert_runtime.model.grouped_moe import (
    GROUP_ALIGN,
    PrepackedExperts,
    gather_rows,
    group_align,
    group_counts,
    group_layout,
    grouped_swiglu,
    packed_views,
    padded_capacity,
    rank_in_group,
    triton_experts_run,
    uses_grouped_gemm,
)
from vexpert_runtime.model.levelling import ReplicaCopies, copies_capacity, list_replica_copies
from vexpert_runtime.model.moe_math import combine
from vexpert_runtime.policy.allocator import Plan
from vexpert_runtime.policy.placement import static_placement


@dataclass(frozen=True)
class RoutingTable:
    """Where the copies of every logical expert live under one plan (numpy, cheap to pickle).

    Attributes:
        plan_id: 0 for the static placement, then increasing.
        gpu: [L, E, R] int64 — EP rank of each copy (copy 0 = resident), −1 padded.
        local: [L, E, R] int64 — local expert index of each copy on its rank (see module doc).
        cum_share: [L, E, R] float64 — cumulative token share of copies 0..r (last valid copy = 1,
            padding = inf, so a uniform draw u ∈ [0, 1) picks copy #{r: cum_share[r] ≤ u}).
        slot_expert: [L, N, S] int64 — logical expert in each slot (−1 empty).
    """

    plan_id: int
    gpu: np.ndarray
    local: np.ndarray
    cum_share: np.ndarray
    slot_expert: np.ndarray

    @property
    def num_layers(self) -> int:
        return int(self.gpu.shape[0])

    def digest(self) -> int:
        """A 62-bit content hash (equal tables ⇔ equal digests, up to hash collisions)."""
        h = hashlib.blake2b(digest_size=8)
        for array in (self.gpu, self.local, self.cum_share, self.slot_expert):
            h.update(np.ascontiguousarray(array).tobytes())
            h.update(str(array.shape).encode())
        return int.from_bytes(h.digest(), "little") >> 2

    @property
    def num_experts(self) -> int:
        return int(self.gpu.shape[1])

    @property
    def num_gpus(self) -> int:
        return int(self.slot_expert.shape[1])

    @property
    def slots(self) -> int:
        return int(self.slot_expert.shape[2])

    @property
    def experts_per_gpu(self) -> int:
        return self.num_experts // self.num_gpus


def table_from_plan(plan: Plan, plan_id: int) -> RoutingTable:
    """Translate an allocator :class:`Plan` into the table workers route with."""
    num_experts = plan.replica_gpu.shape[1]
    stride = num_experts // plan.num_gpus + plan.slots_per_gpu
    phys = plan.physical_ids()
    local = torch.where(plan.replica_gpu >= 0, phys - plan.replica_gpu * stride, torch.full_like(phys, -1))
    share = plan.replica_share.to(torch.float64) * (plan.replica_gpu >= 0)
    cum = share.cumsum(-1)
    valid = plan.replica_gpu >= 0
    last = valid.sum(-1, keepdim=True) - 1  # index of the last valid copy
    cum = cum.scatter(-1, last.clamp(min=0), 1.0)
    cum = torch.where(valid, cum, torch.full_like(cum, float("inf")))
    return RoutingTable(
        plan_id=plan_id,
        gpu=plan.replica_gpu.cpu().numpy().astype(np.int64),
        local=local.cpu().numpy().astype(np.int64),
        cum_share=cum.cpu().numpy(),
        slot_expert=plan.slot_expert.cpu().numpy().astype(np.int64),
    )


def static_table(num_layers: int, num_experts: int, num_gpus: int, slots: int) -> RoutingTable:
    """The plan-less table: every expert only on its static base GPU, all slots empty (plan id 0)."""
    return table_from_plan(plan_from_slots(static_placement(num_layers, num_experts, num_gpus), torch.full((num_layers, num_gpus, slots), -1)), 0)


def plan_from_slots(base_gpu: torch.Tensor, slot_expert: torch.Tensor, share: torch.Tensor | None = None) -> Plan:
    """A :class:`Plan` for any slot assignment (tests, scripted plans, degraded mode).

    Args:
        base_gpu: [L, E] int64 resident GPU of each expert.
        slot_expert: [L, N, S] int64 expert in each slot (−1 empty); an expert must not sit twice on one GPU.
        share: optional [L, E, R] token shares per copy (copy 0 resident, then slots in (gpu, slot)
            order); default: even split.
    """
    num_layers, num_experts = base_gpu.shape
    _, num_gpus, slots = slot_expert.shape
    copies: list[list[list[tuple[int, int]]]] = [
        [[(int(base_gpu[layer, e]), -1)] for e in range(num_experts)] for layer in range(num_layers)
    ]
    for layer in range(num_layers):
        for gpu in range(num_gpus):
            for slot in range(slots):
                expert = int(slot_expert[layer, gpu, slot])
                if expert < 0:
                    continue
                if any(g == gpu for g, _ in copies[layer][expert]):
                    raise ValueError(f"layer {layer}: expert {expert} twice on GPU {gpu}")
                copies[layer][expert].append((gpu, slot))
    width = max(len(c) for row in copies for c in row)
    replica_gpu = torch.full((num_layers, num_experts, width), -1, dtype=torch.int64)
    replica_slot = torch.full_like(replica_gpu, -1)
    for layer in range(num_layers):
        for e in range(num_experts):
            for r, (gpu, slot) in enumerate(copies[layer][e]):
                replica_gpu[layer, e, r] = gpu
                replica_slot[layer, e, r] = slot
    valid = replica_gpu >= 0
    if share is None:
        share = valid.to(torch.float32) / valid.sum(-1, keepdim=True)
    else:
        share = torch.where(valid, share[..., :width].to(torch.float32), torch.zeros(()))
        share = share / share.sum(-1, keepdim=True).clamp(min=1e-12)
    empty = torch.zeros(num_layers)
    vexperts = (slot_expert >= 0).sum(2).amax(1) if slots else torch.zeros(num_layers, dtype=torch.int64)
    return Plan(vexperts, slot_expert.to(torch.int64), base_gpu, replica_gpu, replica_slot, share, empty, empty)


def base_experts(num_experts: int, num_gpus: int, rank: int) -> list[int]:
    """Logical ids of rank's resident experts under the static placement (ascending)."""
    per_gpu = num_experts // num_gpus
    return list(range(rank * per_gpu, (rank + 1) * per_gpu))


# ---------------------------------------------------------------------------------------------
# The routing table on the device
# ---------------------------------------------------------------------------------------------


_TABLE_ALIGN = 16  # bytes: every packed tensor starts aligned for its dtype

Layout = Sequence[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each packed tensor, in order


def _aligned_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return -(-math.prod(shape) * dtype.itemsize // _TABLE_ALIGN) * _TABLE_ALIGN


def _packed_views(storage: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Each tensor of ``layout`` a typed view of its aligned byte range of ``storage`` [bytes] uint8."""
    views, at = [], 0
    for shape, dtype in layout:
        views.append(storage[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
        at += _aligned_bytes(shape, dtype)
    return views


def max_replicas(num_gpus: int, slots: int) -> int:
    """R: the most copies an expert can have — its resident one plus at most one slot on each other
    GPU (an expert never sits twice on one GPU), none without slots."""
    return max(1, num_gpus) if slots > 0 else 1


@dataclass
class DeviceRoutingTable:
    """A :class:`RoutingTable` in fixed-shape tensors on the device the layer runs on.

    The layer reads only these tensors, and a plan switch overwrites them in place (:meth:`load`,
    same storage, same shapes), so a CUDA graph captured over the layer stays valid across plans —
    what vLLM and SGLang do with their logical→physical maps. The replica width R is fixed up front
    (:func:`max_replicas`); a table with fewer copies per expert is padded (gpu/local −1, cum_share
    inf: a draw u < 1 never picks a padded copy).

    Attributes:
        gpu, local: [L, E, R] int64; cum_share: [L, E, R] float64 (see :class:`RoutingTable`).
        copy_expert, copy_gpu, copy_col: [L, C] int32, copy_step: [L, C] float32, single_gpu: [L, E]
            int32 — the replicated experts' copies listed per layer, C = :func:`copies_capacity`
            (per layer, :meth:`copies`: what the per-iteration dispatch's fused kernel sweeps over).
        num_gpus, slots: N and S the table was made for (shapes, fixed).
        plan_id: id of the table loaded last (host side; −1 before the first load).
    """

    gpu: torch.Tensor
    local: torch.Tensor
    cum_share: torch.Tensor
    copy_expert: torch.Tensor
    copy_gpu: torch.Tensor
    copy_col: torch.Tensor
    copy_step: torch.Tensor
    single_gpu: torch.Tensor
    num_gpus: int
    slots: int
    storage: torch.Tensor = field(repr=False)  # the one byte buffer every tensor above views
    plan_id: int = -1
    # the bytes load writes into (pinned on a GPU), numpy views of each tensor in them, the last copy's event
    _staging: tuple[torch.Tensor, list[np.ndarray], Any] | None = field(default=None, repr=False)
    _held: RoutingTable | None = field(default=None, repr=False)  # the table these tensors hold (see load)

    @classmethod
    def allocate(cls, num_layers: int, num_experts: int, num_gpus: int, slots: int,
                 device: torch.device | str, replicas: int | None = None) -> DeviceRoutingTable:
        """Tensors of a table for these sizes, every one a view of one device byte buffer (so that
        :meth:`load` is one host→device copy), holding no plan yet."""
        width = max_replicas(num_gpus, slots) if replicas is None else replicas
        shape, listed = (num_layers, num_experts, width), (num_layers, copies_capacity(num_gpus, slots))
        layout = [(shape, torch.int64), (shape, torch.int64), (shape, torch.float64), (listed, torch.int32),
                  (listed, torch.int32), (listed, torch.int32), (listed, torch.float32), (shape[:2], torch.int32)]
        storage = torch.empty(sum(_aligned_bytes(*field) for field in layout), dtype=torch.uint8, device=device)
        views = _packed_views(storage, layout)
        for view, empty in zip(views, (-1, -1, float("inf"), -1, -1, -1, 0.0, -1), strict=True):
            view.fill_(empty)
        gpu, local, cum_share, copy_expert, copy_gpu, copy_col, copy_step, single_gpu = views
        return cls(gpu, local, cum_share, copy_expert, copy_gpu, copy_col, copy_step, single_gpu, num_gpus, slots,
                   storage)

    @classmethod
    def of(cls, table: RoutingTable, device: torch.device | str, replicas: int | None = None) -> DeviceRoutingTable:
        """A new device table holding ``table``."""
        out = cls.allocate(table.num_layers, table.num_experts, table.num_gpus, table.slots, device, replicas)
        out.load(table)
        return out

    @property
    def num_layers(self) -> int:
        return int(self.gpu.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.gpu.shape[1])

    @property
    def replicas(self) -> int:
        return int(self.gpu.shape[2])

    @property
    def experts_per_gpu(self) -> int:
        return self.num_experts // self.num_gpus

    def copies(self, layer: int) -> ReplicaCopies:
        """The layer's replicated experts' copies, listed (views: a later :meth:`load` shows through)."""
        return self._layer_copies[layer]

    @cached_property
    def _layer_copies(self) -> list[ReplicaCopies]:
        # made once: the EP layer asks every call, and :meth:`load` writes into these same storages
        return [ReplicaCopies(self.copy_expert[layer], self.copy_gpu[layer], self.copy_col[layer],
                              self.copy_step[layer], self.single_gpu[layer]) for layer in range(self.num_layers)]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """The table's tensors in packing order (the order of the fields)."""
        return (self.gpu, self.local, self.cum_share, self.copy_expert, self.copy_gpu, self.copy_col,
                self.copy_step, self.single_gpu)

    def _host_staging(self) -> tuple[torch.Tensor, list[np.ndarray]]:
        """The bytes :meth:`load` writes the next table into and numpy views of each tensor in them:
        on a GPU a pinned host buffer, kept and reused once the previous copy from it has run; on the
        CPU the table's own storage."""
        if self._staging is None:
            host = (self.storage if not self.storage.is_cuda
                    else torch.empty(self.storage.shape, dtype=torch.uint8, pin_memory=True))
            arrays = [view.numpy() for view in _packed_views(host, [(t.shape, t.dtype) for t in self._tensors()])]
            self._staging = (host, arrays, None)
        host, arrays, done = self._staging
        if done is not None:
            done.synchronize()  # a plan ago: long since copied, as a rule
        return host, arrays

    def load(self, table: RoutingTable) -> None:
        """Overwrite these tensors with ``table`` (a plan switch: data only, no new shapes).

        The copies are ordered on the current stream, so layers enqueued before read the old plan
        and layers enqueued after read the new one. Raises ``ValueError`` (tensors untouched) if the
        table does not fit the fixed shapes. A table whose routing equals the one held (a new plan
        id for the same placement: a balanced load re-planned every k iterations) only takes the id.
        """
        held = self._held
        if held is not None and all(a.shape == b.shape and np.array_equal(a, b) for a, b in
                                    ((held.gpu, table.gpu), (held.local, table.local), (held.cum_share, table.cum_share))):
            self.plan_id, self._held = table.plan_id, table
            return
        expected = (self.num_layers, self.num_experts, self.num_gpus, self.slots)
        got = (table.num_layers, table.num_experts, table.num_gpus, table.slots)
        if got != expected:
            raise ValueError(f"table has (L, E, N, S) = {got}, the device table {expected}")
        width = table.gpu.shape[2]
        if width > self.replicas:
            raise ValueError(f"table has {width} copies of an expert, the device table room for {self.replicas}")
        listed = list_replica_copies(table.gpu, self.copy_expert.shape[1])  # raises before any copy
        host, arrays = self._host_staging()
        gpu, local, cum_share, *copies = arrays
        # written in place, padding included: at DeepSeek-V3's size (58 × 256 × 9 per array) numpy's
        # pad and a torch copy per array took several ms of the rank's thread per plan switch; a fill
        # and one strided column copy per copy index beat a [..., :width] slice assignment 2.5×
        for array, value, padding in ((gpu, table.gpu, -1), (local, table.local, -1), (cum_share, table.cum_share, np.inf)):
            array.fill(padding)
            for column in range(width):
                array[..., column] = value[..., column]
        for array, value in zip(copies, listed, strict=True):
            array[...] = value
        if self.storage.is_cuda:  # one host→device copy of the whole table, queued (pinned), no wait
            self.storage.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._staging = (host, arrays, done)
        self.plan_id, self._held = table.plan_id, table


# ---------------------------------------------------------------------------------------------
# Replica choice and dispatch bookkeeping (pure, single rank, fixed shapes: no host sync)
# ---------------------------------------------------------------------------------------------


def choose_replicas(
    ids: torch.Tensor, gpu: torch.Tensor, local: torch.Tensor, cum_share: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the copy each (token, expert) pair goes to.

    The j-th of this rank's n_e pairs for expert e draws u = frac((j + ½)/n_e + rank/N) and takes the
    copy whose cumulative-share interval holds u: stratified within a rank, rotated across ranks.

    Args: ids [B, K] int64; gpu, local [E, R] int64; cum_share [E, R] float64 (all on one device;
        padded copies have cum_share inf).
    Returns dest_gpu [B, K], dest_local [B, K] int64.
    """
    flat = ids.reshape(-1)
    num_experts = gpu.shape[0]
    if gpu.shape[1] == 1 or flat.numel() == 0:
        return gpu[flat, 0].view_as(ids), local[flat, 0].view_as(ids)
    count = group_counts(flat, num_experts)
    position = rank_in_group(flat, num_experts)
    u = torch.frac((position.to(torch.float64) + 0.5) / count[flat].to(torch.float64) + rank / world)
    copy = (cum_share[flat] <= u.unsqueeze(1)).sum(1)
    return gpu[flat, copy].view_as(ids), local[flat, copy].view_as(ids)


def send_rows(dest_gpu: torch.Tensor, world: int, capacity: int) -> torch.Tensor:
    """Row of each pair in the send buffer [N·C + 1] (DeepEP low-latency style dispatch).

    Destination rank d owns rows d·C .. d·C + C − 1; a pair takes the next free row of its block
    (pair order). A pair past its block's C rows goes to the trash row N·C, which is never sent: it
    is dropped (its output reads as zero). With C = every pair of the rank nothing is dropped.

    Args: dest_gpu [P] int64 in [0, N). Returns [P] int64 in [0, N·C].
    """
    rank_in_dest = rank_in_group(dest_gpu, world)
    return torch.where(rank_in_dest < capacity, dest_gpu * capacity + rank_in_dest, world * capacity)


@dataclass(frozen=True)
class ReceiveLayout:
    """Where received rows go in the compute buffer, and the group ends the grouped GEMMs read.

    The buffer has two regions of fixed size: the resident experts' groups in rows
    [0, resident_rows), the slots' groups in [resident_rows, end). Each region starts at row 0 of its
    own GEMM, so neither needs a split point known on the host.

    Attributes:
        position: [T] int64 buffer row of each received row (distinct; padding rows land past their
            region's last group end, where no GEMM reads).
        resident_offs: [E/N] int32, slot_offs: [S] int32 group ends within each region.
        computed: [E/N + S] int64 real rows per local expert.
        resident_rows, rows: region split and buffer size (host ints, from shapes only).
    """

    position: torch.Tensor
    resident_offs: torch.Tensor
    slot_offs: torch.Tensor
    computed: torch.Tensor
    resident_rows: int
    rows: int


def receive_layout(local_of_row: torch.Tensor, resident: int, slots: int, align: int = GROUP_ALIGN) -> ReceiveLayout:
    """Lay received rows out by local expert (``group_layout`` padding), fixed shapes throughout.

    Args: local_of_row [T] int64 local expert of each received row (0..E/N−1 resident, E/N + s
        slot s), −1 for padding. resident = E/N, slots = S. align: group alignment (the grouped
        GEMM's; the per-expert loop needs none).
    """
    num_local = resident + slots
    group = torch.where(local_of_row < 0, num_local, local_of_row)  # num_local: not computed
    is_slot = group >= resident
    resident_pos, resident_offs = group_layout(torch.where(is_slot, resident, group), resident, align)
    slot_pos, slot_offs = group_layout(torch.where(is_slot, group - resident, slots), slots, align)
    resident_rows = padded_capacity(local_of_row.numel(), resident, align)
    position = torch.where(is_slot, resident_rows + slot_pos, resident_pos)
    return ReceiveLayout(position, resident_offs, slot_offs, group_counts(group, num_local), resident_rows,
                         resident_rows + padded_capacity(local_of_row.numel(), slots, align))


def pack_dispatch(x: torch.Tensor, ids: torch.Tensor, gpu: torch.Tensor, local: torch.Tensor, cum_share: torch.Tensor,
                  rank: int, world: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's send buffers: each (token, expert) pair's row at its copy's rank block.

    Args: x [B, H]; ids [B, K]; gpu, local [E, R] int64; cum_share [E, R] float64 (the layer's
        table, shares as :func:`choose_replicas` draws them); block: C rows per destination.
    Returns send_x [N·C, H] (rows where no pair are left unwritten: their receiver lays them past every
    group, where nothing reads them), send_local [N·C] int64 local expert of each row (−1 padding),
    row_of_pair [P] int64 in [0, N·C] (N·C: dropped, past its block).
    """
    batch, top_k = ids.shape
    pairs = batch * top_k
    dest_gpu, dest_local = choose_replicas(ids, gpu, local, cum_share, rank, world)
    row_of_pair = send_rows(dest_gpu.reshape(-1), world, block)
    token_of_pair = torch.arange(pairs, device=x.device) // top_k
    # One extra (trash) row takes the dropped pairs; it is not sent.
    send_x = x.new_empty(world * block + 1, x.shape[1])  # no memset: padding rows are never read
    send_x.index_copy_(0, row_of_pair, x.index_select(0, token_of_pair))
    send_local = torch.full((world * block + 1,), -1, dtype=torch.int64, device=x.device)
    send_local.index_copy_(0, row_of_pair, dest_local.reshape(-1))
    return send_x[:-1], send_local[:-1], row_of_pair


def arrange_received(recv_local: torch.Tensor, resident: int, slots: int, align: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The received rows laid out for the grouped GEMMs (:func:`receive_layout`), as the received row each buffer
    row reads: the gate/up GEMM gathers them from the receive buffer as it reads (``row_src``), or
    :func:`stacked_outputs` copies them where it cannot — no copy of the rows into the grouped order first.

    Args: recv_local [T] int64 (−1 padding); resident = E/N; slots = S.
    Returns row_src [M] int64 (M = :attr:`ReceiveLayout.rows`; 0 on rows no received row lands on — a group's
    alignment padding, the space past the groups —, whose outputs nothing reads: a GEMM row depends only on its
    own input row), position [T] (buffer row of each received row), resident_offs [E/N] int32, slot_offs [S]
    int32, computed [E/N + S] int64.
    """
    layout = receive_layout(recv_local, resident, slots, align)
    received = torch.arange(recv_local.numel(), device=recv_local.device)
    row_src = torch.zeros(layout.rows, dtype=torch.int64, device=recv_local.device).index_copy_(0, layout.position,
                                                                                                 received)
    return row_src, layout.position, layout.resident_offs, layout.slot_offs, layout.computed


def combine_received(back: torch.Tensor, row_of_pair: torch.Tensor, topk_weights: torch.Tensor,
                     shared_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sender's side after the combine all-to-all: each pair's output from the row it was sent
    from, weighted and summed per token.

    Args: back [N·C, H] the expert outputs returned per send row; row_of_pair [P] (N·C: dropped,
        reads zero); topk_weights [B, K]; shared_out [B, H] or None.
    Returns y [B, H] and the number of dropped pairs [] int64.
    """
    batch, top_k = topk_weights.shape
    rows = torch.cat([back, back.new_zeros(1, back.shape[1])])  # the trash row: dropped pairs read zero
    outputs = rows.index_select(0, row_of_pair).view(batch, top_k, back.shape[1])
    dropped = (row_of_pair == back.shape[0]).sum()
    return combine(topk_weights, outputs, shared_out), dropped


def arrange_local(ids: torch.Tensor, gpu: torch.Tensor, local: torch.Tensor, cum_share: torch.Tensor, resident: int,
                  slots: int, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's pairs laid out for its grouped GEMMs without moving its tokens (an EP group of one: no send
    buffer, no exchange): the buffer rows :func:`pack_dispatch` → :func:`arrange_received` lay out with ``world`` = 1
    and nothing dropped, as the token each row reads — the GEMM gathers them as it reads (``row_src``), or
    :func:`stacked_outputs` copies them where it cannot.

    Args: ids [B, K]; gpu, local, cum_share [E, R] the layer's table; resident = E, slots = S.
    Returns row_src [M] int64 (the token of each buffer row; 0 on rows no pair lands on, whose outputs nothing
    reads), position [P] (buffer row of each pair), resident_offs [E] int32, slot_offs [S] int32, computed [E + S]
    int64 — as :func:`arrange_received`.
    """
    _, dest_local = choose_replicas(ids, gpu, local, cum_share, 0, 1)
    # the pairs as one rank's received rows (pair p = token p // K): each buffer row's pair, then its token
    pair_of_row, position, resident_offs, slot_offs, computed = arrange_received(dest_local.reshape(-1), resident,
                                                                                 slots, align)
    return pair_of_row // ids.shape[1], position, resident_offs, slot_offs, computed


# rows × (groups + 1) up to which a layer's layout runs as one kernel (:mod:`.layout_kernel`: one thread block
# holds them in a few chunks of one-hot rows); beyond, the compiled torch code
FUSED_LAYOUT_LIMIT = 1 << 16


def fused_layout_runs(device: torch.device, rows: int, resident: int, slots: int) -> bool:
    """Whether :func:`arrange_received` / :func:`arrange_local` of ``rows`` rows run as one kernel
    (:mod:`.layout_kernel`, equal outputs): on CUDA with Triton (not switched off with
    ``VEXPERT_DISPATCH_KERNEL=torch``), at least one row, rows × (E/N + S + 1) ≤ :data:`FUSED_LAYOUT_LIMIT`."""
    return device.type == "cuda" and 0 < rows * (resident + slots + 1) <= FUSED_LAYOUT_LIMIT and triton_available()


def combine_local(out: torch.Tensor, position: torch.Tensor, topk_weights: torch.Tensor,
                  shared_out: torch.Tensor | None) -> torch.Tensor:
    """:func:`combine_received` for an EP group of one: each pair's output read from its buffer row.
    Args: out [M, H]; position [P]; topk_weights [B, K]; shared_out [B, H] or None. Returns y [B, H]."""
    batch, top_k = topk_weights.shape
    return combine(topk_weights, out.index_select(0, position).view(batch, top_k, out.shape[1]), shared_out)


@dataclass
class LayerStats:
    """What one rank saw in one layer, on the layer's device (read them when it suits the caller):
    computed [E/N + S] int64 rows per local expert; dropped: [] int64 pairs past the dispatch
    capacity (0 with the default capacity); sent: pairs this rank routed (B·K, from shapes)."""

    computed: torch.Tensor
    dropped: torch.Tensor
    sent: int


def _exchange(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """all_to_all_single with equal splits (N blocks of the same size; identity without a group).

    CUDA tensors over a gloo-only group (ranks sharing one GPU, where NCCL refuses to run) go
    through host memory: correct, but it synchronises the host, so only for measuring on a host
    with fewer GPUs than ranks."""
    if group is None:
        return send
    if send.is_cuda and dist.get_backend(group) == "gloo":
        staged = send.cpu()
        out_host = torch.empty_like(staged)
        dist.all_to_all_single(out_host, staged, group=group)
        return out_host.to(send.device, non_blocking=True)
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send.contiguous(), group=group)
    return out


def _exchange_rows(send_x: torch.Tensor, send_local: torch.Tensor, group: dist.ProcessGroup | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch all-to-all of the rows [N·C, H] and their local experts [N·C] int64. Over a CPU
    group as one exchange: each row carries its index bit for bit in 8 bytes of extra columns (a gloo
    collective costs ~0.1–0.2 ms of a CPU rank's step, whatever its size); on GPUs as two (NCCL's are
    cheap, and the copy the packing needs is not)."""
    if group is None or send_x.is_cuda:
        return _exchange(send_x, group), _exchange(send_local, group)
    rows, hidden = send_x.shape
    tagged = torch.cat([send_x, send_local.view(send_x.dtype).view(rows, 8 // send_x.element_size())], dim=1)
    received = _exchange(tagged, group)
    return received[:, :hidden], received[:, hidden:].contiguous().view(torch.int64).view(-1)


@dataclass(frozen=True)
class ExpertStacks:
    """A rank's local experts as stacks of packed rows: resident [E/N, D] and this group's slots
    [S, D] (local index E/N + s is slot s), with the expert FFN's intermediate size and, for rows
    that are not dense rows of the compute dtype (block FP8), their format."""

    resident: torch.Tensor | PrepackedExperts  # rows, or (CPU) the same experts prepacked for oneDNN
    slots: torch.Tensor | None
    intermediate: int
    grouped: bool | None = None  # force (True/False) the grouped-GEMM path; None: where it runs
    format: ExpertFormat | None = None  # None: dense rows of the compute dtype

    def weights(self, rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) of a stack: views of dense rows, a dequantised copy of FP8."""
        if self.format is None:
            return packed_views(rows, self.intermediate, hidden)
        return self.format.stack_weights(rows)

    @property
    def wire_group(self) -> int | None:
        """W8A8 rows (block FP8, ``fp8_activations``): the columns per activation scale, and tokens cross the
        dispatch quantised, as wire rows (:func:`~.fp8_activations.pack_wire_rows`); else None (rows of the
        compute dtype)."""
        fmt = self.format
        if fmt is None or fmt.fp8_block is None or not fmt.fp8_activations:
            return None
        return fmt.fp8_block[1]

    def swiglu(self, x: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
               quantize: ActivationQuantizer = quantize_activation_groups,
               row_src: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU of x [M, H]'s groups (ends ``offs``) through the stack ``rows`` into ``out``. Block-FP8
        rows on a GPU go to the Triton grouped GEMM as stored (fp8 weights, block scales applied per K
        tile: half the bytes a bf16 expert reads, and no dequantised copy; W8A8 where the format says
        ``fp8_activations``); elsewhere :func:`grouped_swiglu` over :meth:`weights` (W8A8:
        :func:`~.expert_format.w8a8_swiglu`, the same numbers one expert at a time). ``quantize``: how W8A8's
        activations are quantised (the EP layer passes its compiled copy where it fuses). W8A8 only: x may be
        wire rows [M, B] uint8 (:attr:`wire_group`), quantised before the dispatch; ``out`` is always [M, H] of
        the compute dtype. ``row_src`` [M] int64: x is [T, ·] and row m is ``x[row_src[m]]`` — read in place by the
        Triton kernel, copied first elsewhere."""
        fmt = self.format
        x_scales = None
        if x.dtype == torch.uint8:
            if self.wire_group is None:
                raise ValueError("uint8 activations are W8A8 wire rows; these experts are not W8A8")
            x, x_scales = unpack_wire_rows(x, out.shape[1])  # per row: T rows in, T rows out
        if fmt is not None and fmt.fp8_block is not None and self.grouped is not False and triton_experts_run(out):
            stack = fmt.fp8_stack(rows)
            if stack is not None:
                from vexpert_runtime.model.grouped_gemm_kernel import triton_swiglu

                return triton_swiglu(x, stack.w13, stack.w2, offs, out=out, scales=(stack.s13, stack.s2),
                                     scale_block=stack.block, fp8_activations=fmt.fp8_activations, quantize=quantize,
                                     x_scales=x_scales, row_src=row_src)
        w13, w2 = self.weights(rows, out.shape[1])
        if fmt is None or fmt.fp8_block is None or not fmt.fp8_activations:  # (the Triton kernel gathers there too)
            return grouped_swiglu(x, w13, w2, offs, grouped=self.grouped, out=out, row_src=row_src)
        if row_src is not None:
            x = gather_rows(x, row_src)
            x_scales = None if x_scales is None else gather_rows(x_scales, row_src)
        return out.copy_(w8a8_swiglu(x, w13, w2, offs, fmt.fp8_block[1], x_scales))


def stacked_outputs(buf: torch.Tensor, resident_offs: torch.Tensor, slot_offs: torch.Tensor, resident_rows: int,
                    stacks: ExpertStacks, slot_wait: Callable[[], None] | None = None,
                    after_compute: Callable[[], None] | None = None,
                    quantize: ActivationQuantizer = quantize_activation_groups,
                    row_src: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs [M, H] of a buffer [M, H] laid out by :func:`receive_layout`: one grouped GEMM
    pair over the resident stack (rows [0, resident_rows)), then — after ``slot_wait`` — one over the
    slot stack (the rest), then ``after_compute``. Rows past a region's last group end are undefined.
    Both hooks are called on every call, also when no row goes to a slot. With ``row_src`` [M] int64
    (:func:`arrange_received`, :func:`arrange_local`) ``buf`` is the rows as they arrived [T, ·] (received, or an EP
    group of one's tokens) and buffer row m is ``buf[row_src[m]]``."""
    rows = buf.shape[0] if row_src is None else row_src.shape[0]
    if stacks.wire_group is None:
        out = buf.new_empty(rows, buf.shape[1])
    else:  # wire rows in, rows of the compute dtype out
        assert stacks.format is not None
        out = buf.new_empty(rows, stacks.format.hidden, dtype=stacks.format.compute_dtype)

    def region(first: int, last: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, row_src) of buffer rows [first, last)."""
        if row_src is None:
            return buf[first:last], None
        return buf, row_src[first:last]

    x, src = region(0, resident_rows)
    if isinstance(stacks.resident, PrepackedExperts):
        out[:resident_rows] = stacks.resident.swiglu(x if src is None else gather_rows(x, src), resident_offs)
    else:
        stacks.swiglu(x, stacks.resident, resident_offs, out[:resident_rows], quantize, src)
    if slot_wait is not None:
        slot_wait()
    if slot_offs.numel():
        if stacks.slots is None:
            raise ValueError("the routing table has slots but no slot stack was given")
        x, src = region(resident_rows, None)
        stacks.swiglu(x, stacks.slots, slot_offs, out[resident_rows:], quantize, src)  # slots filled
    if after_compute is not None:
        after_compute()
    return out


@functools.cache
def _no_drops(device: torch.device) -> torch.Tensor:
    """The dropped-pair count of a layer that drops none (an EP group of one), made once per device: a new zero each
    layer was a fill kernel each MoE layer of every step. Read-only: no caller writes a layer's statistics."""
    return torch.zeros((), dtype=torch.int64, device=device)


def ep_moe_layer(
    x: torch.Tensor,
    ids: torch.Tensor,
    topk_weights: torch.Tensor,
    table: DeviceRoutingTable,
    layer: int,
    stacks: ExpertStacks,
    shared_out: torch.Tensor | None,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    *,
    capacity: int | None = None,
    slot_wait: Callable[[], None] | None = None,
    after_compute: Callable[[], None] | None = None,
    dispatch: DispatchMode = "plan",
    compiled: bool = False,
) -> tuple[torch.Tensor, LayerStats]:
    """One MoE layer on this rank's tokens, expert-parallel, with fixed shapes and no host sync.

    Dispatch: every rank sends every rank a block of C rows plus C local-expert indices (−1 on
    padding) with one equal-split all-to-all each, so no split size is ever read back to the host;
    the receiver lays the rows out by local expert on the device, runs the grouped GEMMs with
    device-side group ends, and sends each block back the same way; the sender gathers its pairs'
    outputs from the rows it sent them from. Everything is a function of the shapes and of tensors
    on ``x.device``, so on CUDA the layer can be captured in a CUDA graph (a plan switch is
    :meth:`DeviceRoutingTable.load`).

    Args:
        x: [B, H] this rank's (normed) tokens; ids/topk_weights: [B, K] its routing.
        table: the device routing table (plan) and the layer's index into it.
        stacks: the local experts. Grouped GEMMs where they run (CUDA bf16/fp16, or ``stacks.grouped``);
            elsewhere the per-expert loop over the same layout (it reads the group ends on the host).
        shared_out: [B, H] shared-expert output or None.
        capacity: C, rows per destination rank; the same on every rank. Default B·K: nothing can be
            dropped, provided every rank has B tokens; with uneven batches pass max B·K.
        slot_wait: called after the resident experts' compute is enqueued, right before the slot
            experts' (the worker waits there for its slots to be filled).
        after_compute: called right after the slot experts' compute is enqueued (the worker releases
            its slots there). Both hooks run on every call.
        dispatch: how a replicated expert's pairs split over its copies: ``"plan"`` (the table's
            shares), ``"local"`` (water-filled from this rank's counts of the layer) or ``"global"``
            (from the group's counts: one all-reduce of [E] int32 before the all-to-all, so every
            rank must pass the same mode). No host sync in any mode.
        compiled: run the bookkeeping around the GEMMs and collectives (:func:`pack_dispatch`,
            :func:`arrange_received`, :func:`combine_received`; one rank: :func:`arrange_local`,
            :func:`combine_local`) compiled by inductor (:mod:`~vexpert_runtime.model.fusion`): a few fused kernels
            per layer instead of ~120. On CUDA the layout (:func:`arrange_received` / :func:`arrange_local`) is one
            Triton kernel either way, where :func:`fused_layout_runs`.
    Returns (y [B, H], stats), stats on ``x.device``.
    """
    batch, top_k = ids.shape
    pairs = batch * top_k
    block = pairs if capacity is None else capacity
    fused = compiled and pairs > 0  # inductor fails on some empty shapes; an empty step is cheap eagerly
    pack, combine_back = fusion.maybe_compiled(pack_dispatch, fused), fusion.maybe_compiled(combine_received, fused)
    cum_share = dispatch_cum_share(dispatch, ids, table.gpu[layer], table.cum_share[layer], table.num_gpus,
                                   group, copies=table.copies(layer))
    # W8A8's activation quantisations fused into one kernel each where the layer's bookkeeping is
    quantize = fusion.maybe_compiled(quantize_activation_groups, fused)
    # W8A8: each token quantised once, before the all-to-all (not each of its K copies after it), and sent as
    # FP8 with its scales (DeepEP's FP8 dispatch: ~half the bytes); per-row quantisation, so the same numbers
    tokens = x if stacks.wire_group is None else fusion.maybe_compiled(quantized_wire_rows, fused)(x, stacks.wire_group)
    grouped = stacks.grouped if stacks.grouped is not None else uses_grouped_gemm(x)
    resident, slots = table.experts_per_gpu, table.slots
    align = group_align(x.device) if grouped else 1
    if group is None and world == 1 and block >= pairs:
        # An EP group of one (a single-GPU server): no send and return buffers — the gate/up GEMM reads each pair's
        # token where it is (row_src) and the combine reads the outputs from the GEMM's buffer
        if table.local.shape[-1] == 1 and fused_layout_runs(x.device, pairs, resident, slots):
            from vexpert_runtime.model.layout_kernel import fused_arrange_local

            layout = fused_arrange_local(ids, table.local[layer], resident, slots, align)
        else:
            layout = fusion.maybe_compiled(arrange_local, fused)(ids, table.gpu[layer], table.local[layer], cum_share,
                                                                 resident, slots, align)
        row_src, position, resident_offs, slot_offs, computed = layout
        out = stacked_outputs(tokens, resident_offs, slot_offs, padded_capacity(pairs, resident, align), stacks,
                              slot_wait, after_compute, quantize, row_src)
        y = fusion.maybe_compiled(combine_local, fused)(out, position, topk_weights, shared_out)
        return y, LayerStats(computed=computed, dropped=_no_drops(x.device), sent=pairs)
    send_x, send_local, row_of_pair = pack(tokens, ids, table.gpu[layer], table.local[layer], cum_share, rank, world,
                                           block)
    recv_x, recv_local = _exchange_rows(send_x, send_local, group)
    if fused_layout_runs(x.device, recv_local.numel(), resident, slots):
        from vexpert_runtime.model.layout_kernel import fused_arrange_received

        layout = fused_arrange_received(recv_local, resident, slots, align)
    else:
        layout = fusion.maybe_compiled(arrange_received, fused)(recv_local, resident, slots, align)
    row_src, position, resident_offs, slot_offs, computed = layout
    resident_rows = padded_capacity(recv_local.numel(), resident, align)
    out = stacked_outputs(recv_x, resident_offs, slot_offs, resident_rows, stacks, slot_wait, after_compute, quantize,
                          row_src)
    back = _exchange(out.index_select(0, position), group)
    y, dropped = combine_back(back, row_of_pair, topk_weights, shared_out)
    return y, LayerStats(computed=computed, dropped=dropped, sent=pairs)
