"""Expert-parallel MoE forward: route → pick a physical replica per (token, expert) pair →
all-to-all dispatch → expert compute over base experts and vExpert slots → all-to-all combine.

Every EP rank ("GPU") holds ``E/N`` resident (base) experts and, while a layer runs, the slots its
group's buffer holds. A rank's *local* experts are numbered ``0..E/N−1`` for its base experts
(ascending logical id) and ``E/N + s`` for slot ``s`` — the allocator's physical-id layout
(:meth:`Plan.physical_ids`), so a plan translates into a :class:`RoutingTable` by subtraction.

Replicated experts: each rank splits its own tokens of an expert over the expert's copies in
proportion to the plan's shares (stratified positions, rotated by rank so small counts spread too),
which makes the global split follow the allocator's water-filling shares.

Collectives go through ``torch.distributed`` (gloo on CPU, NCCL on GPU): per layer one small
all-to-all of counts ``[N, E/N + S]`` and one all-to-all each way for the rows.

Shapes: ``B`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``N`` ranks, ``S`` slots
per buffer, ``R`` max copies of an expert, ``P = B·K`` (token, expert) pairs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vexpert_runtime.model.expert_format import ExpertFormat
from vexpert_runtime.model.grouped_moe import group_layout, grouped_swiglu, packed_views, uses_grouped_gemm
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
# Replica choice and dispatch bookkeeping (pure, single rank)
# ---------------------------------------------------------------------------------------------


def choose_replicas(
    ids: torch.Tensor, gpu: torch.Tensor, local: torch.Tensor, cum_share: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the copy each (token, expert) pair goes to.

    The j-th of this rank's n_e pairs for expert e draws u = frac((j + ½)/n_e + rank/N) and takes the
    copy whose cumulative-share interval holds u: stratified within a rank, rotated across ranks.

    Args: ids [B, K] int64; gpu, local [E, R] int64; cum_share [E, R] float64 (all on one device).
    Returns dest_gpu [B, K], dest_local [B, K] int64.
    """
    flat = ids.reshape(-1)
    num_experts = gpu.shape[0]
    if gpu.shape[1] == 1 or flat.numel() == 0:
        return gpu[flat, 0].view_as(ids), local[flat, 0].view_as(ids)
    count = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    start = count.cumsum(0) - count
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]
    u = torch.frac((position.to(torch.float64) + 0.5) / count[flat].to(torch.float64) + rank / world)
    copy = (cum_share[flat] <= u.unsqueeze(1)).sum(1)
    return gpu[flat, copy].view_as(ids), local[flat, copy].view_as(ids)


@dataclass
class LayerStats:
    """What one rank saw in one layer: computed [E/N + S] rows per local expert, sent pairs."""

    computed: torch.Tensor
    sent: int


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """all_to_all_single of rows (identity for a single rank without a process group)."""
    if group is None:
        return send
    out = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=group)
    return out


@dataclass(frozen=True)
class ExpertStacks:
    """A rank's local experts as stacks of packed rows: resident [E/N, D] and this group's slots
    [S, D] (local index E/N + s is slot s), with the expert FFN's intermediate size and, for rows
    that are not dense rows of the compute dtype (block FP8), their format."""

    resident: torch.Tensor
    slots: torch.Tensor | None
    intermediate: int
    grouped: bool | None = None  # force (True/False) the grouped-GEMM path; None: where it runs
    format: ExpertFormat | None = None  # None: dense rows of the compute dtype

    def weights(self, rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) of a stack: views of dense rows, a dequantised copy of FP8."""
        if self.format is None:
            return packed_views(rows, self.intermediate, hidden)
        return self.format.stack_weights(rows)


def stacked_outputs(buf: torch.Tensor, offs: torch.Tensor, ends: list[int], stacks: ExpertStacks,
                    resident: int) -> torch.Tensor:
    """Expert outputs [M, H] of a group-padded buffer ``buf`` [M, H] laid out by
    :func:`~vexpert_runtime.model.grouped_moe.group_layout` over the resident experts then the slots
    (``offs`` [E/N + S] int32 group ends, ``ends`` the same on the host): one grouped GEMM pair for
    the resident stack, one for the slots."""
    hidden = buf.shape[1]
    out = torch.empty_like(buf)
    split = ends[resident - 1] if resident else 0
    w13, w2 = stacks.weights(stacks.resident, hidden)
    out[:split] = grouped_swiglu(buf[:split], w13, w2, offs[:resident], grouped=stacks.grouped)
    if ends and ends[-1] > split:
        if stacks.slots is None:
            raise ValueError("pairs were routed to slots but no slot stack was given")
        s13, s2 = stacks.weights(stacks.slots, hidden)
        out[split:] = grouped_swiglu(buf[split:], s13, s2, offs[resident:] - split, grouped=stacks.grouped)
    return out


def _grouped_compute(rows: torch.Tensor, local_of_row: torch.Tensor, stacks: ExpertStacks, resident: int,
                     num_local: int) -> torch.Tensor:
    """Expert outputs [T, H] for received rows [T, H] with local expert ``local_of_row`` [T]."""
    position, offs = group_layout(local_of_row, num_local)
    ends = offs.tolist()
    buf = rows.new_zeros(ends[-1] if ends else 0, rows.shape[1])
    buf[position] = rows
    return stacked_outputs(buf, offs, ends, stacks, resident)[position]


def ep_moe_layer(
    x: torch.Tensor,
    ids: torch.Tensor,
    topk_weights: torch.Tensor,
    table: RoutingTable,
    layer: int,
    local_weight: Callable[[int], torch.Tensor],
    expert_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shared_out: torch.Tensor | None,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    after_compute: Callable[[], None] | None = None,
    stacks: ExpertStacks | None = None,
    slot_wait: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, LayerStats]:
    """One MoE layer on this rank's tokens, expert-parallel.

    Args:
        x: [B, H] this rank's (normed) tokens; ids/topk_weights: [B, K] its routing.
        table: routing table of the plan this layer runs under; layer: its index.
        local_weight: j ↦ packed weights [3·I·H] of local expert j (base 0..E/N−1, slot E/N + s).
        expert_fn: (rows [T, H], packed weights) ↦ [T, H].
        shared_out: [B, H] shared-expert output or None.
        slot_wait: called once per call before any slot expert is computed; the worker waits there
            until the layer's slots are filled (on a GPU: a wait enqueued on its stream).
        after_compute: called once the expert compute is enqueued (before the combine); the worker
            marks the layer's slots free there (on a GPU: a flag write enqueued on its stream).
        stacks: the same local experts as stacked packed rows; where grouped GEMMs run (CUDA, bf16/fp16,
            or ``stacks.grouped``) the compute is two grouped GEMMs per stack instead of a loop.
    Every tensor lives on ``x.device`` (CPU with gloo, CUDA with NCCL); the table is moved there.
    Returns (y [B, H], stats) with ``stats.computed`` on the host.
    """
    batch, top_k = ids.shape
    hidden = x.shape[1]
    num_local = table.experts_per_gpu + table.slots
    device = x.device
    gpu = torch.from_numpy(table.gpu[layer]).to(device)
    local = torch.from_numpy(table.local[layer]).to(device)
    cum = torch.from_numpy(table.cum_share[layer]).to(device)
    dest_gpu, dest_local = choose_replicas(ids, gpu, local, cum, rank, world)
    key = (dest_gpu * num_local + dest_local).reshape(-1)
    order = torch.argsort(key, stable=True)  # pairs grouped by destination rank, then local expert
    send_matrix = torch.bincount(key, minlength=world * num_local).view(world, num_local)
    recv_matrix = _exchange(send_matrix, [1] * world, [1] * world, group)
    send_splits = send_matrix.sum(1).tolist()
    recv_splits = recv_matrix.sum(1).tolist()
    rows = _exchange(x[order // top_k], send_splits, recv_splits, group)

    # Compute: received rows come ordered by (source rank, local expert); group them by local expert.
    local_of_row = torch.repeat_interleave(torch.arange(num_local, device=device).repeat(world), recv_matrix.reshape(-1))
    by_expert = torch.argsort(local_of_row, stable=True)
    computed = torch.bincount(local_of_row, minlength=num_local)
    if slot_wait is not None:
        slot_wait()
    grouped = stacks is not None and (stacks.grouped if stacks.grouped is not None else uses_grouped_gemm(rows))
    if stacks is not None and grouped:
        results = _grouped_compute(rows, local_of_row, stacks, table.experts_per_gpu, num_local)
    else:
        results = rows.new_empty(rows.shape[0], hidden)
        start = 0
        for j, n in enumerate(computed.tolist()):
            if n:
                index = by_expert[start : start + n]
                results[index] = expert_fn(rows[index], local_weight(j))
                start += n
    if after_compute is not None:
        after_compute()

    back = _exchange(results, recv_splits, send_splits, group)
    outputs = torch.empty(batch * top_k, hidden, dtype=back.dtype, device=device)
    outputs[order] = back
    y = combine(topk_weights, outputs.view(batch, top_k, hidden), shared_out)
    return y, LayerStats(computed=computed.cpu(), sent=int(key.numel()))
