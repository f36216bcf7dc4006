"""The EP MoE layer as it was before it became sync-free (variable-size all-to-all, split sizes
read back to the host, per-expert loop): kept only as an oracle, so tests can check that the
fixed-capacity layer computes the same outputs and the same per-expert rows."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from vexpert_runtime.model.ep_moe import RoutingTable, choose_replicas
from vexpert_runtime.model.moe_math import combine


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return send
    out = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=group)
    return out


def legacy_ep_moe_layer(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, table: RoutingTable,
                        layer: int, local_weight: Callable[[int], torch.Tensor],
                        expert_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        shared_out: torch.Tensor | None, rank: int, world: int,
                        group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, H], computed [E/N + S]) of the old implementation."""
    batch, top_k = ids.shape
    hidden = x.shape[1]
    num_local = table.experts_per_gpu + table.slots
    device = x.device
    gpu = torch.from_numpy(table.gpu[layer]).to(device)
    local = torch.from_numpy(table.local[layer]).to(device)
    cum = torch.from_numpy(table.cum_share[layer]).to(device)
    dest_gpu, dest_local = choose_replicas(ids, gpu, local, cum, rank, world)
    key = (dest_gpu * num_local + dest_local).reshape(-1)
    order = torch.argsort(key, stable=True)
    send_matrix = torch.bincount(key, minlength=world * num_local).view(world, num_local)
    recv_matrix = _exchange(send_matrix, [1] * world, [1] * world, group)
    send_splits = send_matrix.sum(1).tolist()
    recv_splits = recv_matrix.sum(1).tolist()
    rows = _exchange(x[order // top_k], send_splits, recv_splits, group)
    local_of_row = torch.repeat_interleave(torch.arange(num_local, device=device).repeat(world), recv_matrix.reshape(-1))
    by_expert = torch.argsort(local_of_row, stable=True)
    computed = torch.bincount(local_of_row, minlength=num_local)
    results = rows.new_empty(rows.shape[0], hidden)
    start = 0
    for j, n in enumerate(computed.tolist()):
        if n:
            index = by_expert[start : start + n]
            results[index] = expert_fn(rows[index], local_weight(j))
            start += n
    back = _exchange(results, recv_splits, send_splits, group)
    outputs = torch.empty(batch * top_k, hidden, dtype=back.dtype, device=device)
    outputs[order] = back
    return combine(topk_weights, outputs.view(batch, top_k, hidden), shared_out), computed
