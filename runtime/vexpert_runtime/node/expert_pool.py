"""L2 expert pool (coordinator host memory): per MoE layer one buffer of ``Np`` packed experts at a
fixed stride, so filling a slot is one copy of one row.

``Np ≤ E`` is an operator knob (``tuning.pooled_experts``, default all). With ``Np < E`` the pool keeps
the historically hottest experts of each layer and the allocator may only replicate pooled ones
(its ``pooled`` mask). A pool is immutable once built: :meth:`ExpertPool.refreshed` returns a new pool
that shares the buffers of unchanged layers, so a fill in flight keeps reading the snapshot its plan
was made for. Workers never hold a copy of the pool.

Shapes: ``L`` layers, ``E`` experts, ``Np`` pooled experts per layer, ``D = 3·I·H`` packed row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RowLoader = Callable[[int, list[int]], torch.Tensor]  # (layer, experts) → [len, D]
RowReader = Callable[[int, list[int], torch.Tensor], object]  # (layer, experts, out [len, D]) fills out
Allocator = Callable[[int, int], torch.Tensor]  # (rows, D) → empty [rows, D]

# Rows a plain RowLoader is asked for at once: its result is a temporary beside the pool, so it is
# kept to about this many bytes (at least one row).
LOAD_CHUNK_BYTES = 64 << 20


def _read_rows(out: torch.Tensor, layer: int, experts: list[int], load: RowLoader,
               read_into: RowReader | None) -> None:
    """Fill ``out`` [len(experts), D] with the experts' rows: straight into ``out`` with
    ``read_into``, else through ``load`` in chunks of about :data:`LOAD_CHUNK_BYTES`."""
    if not experts:
        return
    if read_into is not None:
        read_into(layer, experts, out)
        return
    step = max(1, LOAD_CHUNK_BYTES // max(1, out[0].numel() * out.element_size()))
    for start in range(0, len(experts), step):
        out[start : start + step].copy_(load(layer, experts[start : start + step]))


def hottest_experts(hotness: torch.Tensor, pooled: int) -> torch.Tensor:
    """Per layer the ``pooled`` experts with the largest hotness, ascending ids (ties → lower id).

    Args: hotness [L, E] float. Returns [L, Np] int64.
    """
    num_experts = hotness.shape[1]
    pooled = min(pooled, num_experts)
    # Stable tie-break by id: sort by (−hotness, id).
    order = torch.argsort(-hotness.to(torch.float64), dim=1, stable=True)[:, :pooled]
    return order.sort(dim=1).values


class ExpertPool:
    """Per layer one host buffer [Np, D]; ``row_of[l, e]`` is expert e's row or −1 (not pooled)."""

    def __init__(self, experts: torch.Tensor, buffers: list[torch.Tensor], num_experts: int) -> None:
        self.experts = experts  # [L, Np] int64
        self.buffers = buffers
        self.num_experts = num_experts
        row_of = torch.full((experts.shape[0], num_experts), -1, dtype=torch.int64)
        row_of.scatter_(1, experts, torch.arange(experts.shape[1]).expand_as(experts).contiguous())
        self.row_of = row_of

    @classmethod
    def build(cls, experts: torch.Tensor, num_experts: int, numel: int, load: RowLoader, allocate: Allocator,
              read_into: RowReader | None = None) -> ExpertPool:
        """Allocate and fill the pool for ``experts`` [L, Np]: each layer's rows read straight into
        its buffer with ``read_into`` where given, else loaded in bounded chunks (so the peak is the
        pool plus at most one chunk, never a second copy of a layer)."""
        buffers = []
        for layer in range(experts.shape[0]):
            buf = allocate(experts.shape[1], numel)
            _read_rows(buf, layer, experts[layer].tolist(), load, read_into)
            buffers.append(buf)
        return cls(experts, buffers, num_experts)

    @property
    def pooled(self) -> int:
        """Np."""
        return int(self.experts.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def pooled_mask(self) -> torch.Tensor:
        """[L, E] bool: which experts the allocator may replicate."""
        return self.row_of >= 0

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """Packed weights [D] of a pooled expert (a view into the pool)."""
        index = int(self.row_of[layer, expert])
        if index < 0:
            raise KeyError(f"expert {expert} of layer {layer} is not in the pool (Np={self.pooled})")
        return self.buffers[layer][index]

    def refreshed(self, experts: torch.Tensor, load: RowLoader, allocate: Allocator,
                  read_into: RowReader | None = None) -> ExpertPool:
        """A pool holding ``experts`` [L, Np']: unchanged layers share buffers, changed layers get a
        new buffer (rows of experts kept are copied from this pool, new ones loaded as in :meth:`build`)."""
        buffers = []
        for layer in range(experts.shape[0]):
            wanted = experts[layer]
            if wanted.shape[0] == self.pooled and torch.equal(wanted, self.experts[layer]):
                buffers.append(self.buffers[layer])
                continue
            buf = allocate(wanted.shape[0], self.buffers[layer].shape[1])
            missing = []
            for row, expert in enumerate(wanted.tolist()):
                old = int(self.row_of[layer, expert])
                if old >= 0:
                    buf[row].copy_(self.buffers[layer][old])
                else:
                    missing.append((row, expert))
            # new experts, one run of consecutive rows at a time (straight into buf with read_into)
            start = 0
            while start < len(missing):
                end = start + 1
                while end < len(missing) and missing[end][0] == missing[end - 1][0] + 1:
                    end += 1
                first = missing[start][0]
                _read_rows(buf[first : first + end - start], layer, [e for _, e in missing[start:end]], load, read_into)
                start = end
            buffers.append(buf)
        return ExpertPool(experts, buffers, self.num_experts)
