"""The serving decode step as CUDA graphs, one per batch-size bucket.

A decode iteration (every sequence feeds its last sampled token) runs the whole model — embeddings,
per layer the attention kernel over the paged cache (:mod:`.attention_kernels`) and the MoE block
(router, shared experts, the vExpert EP layer with its slot flag waits, in-place routing table and
dispatch kernel), the final norm, the LM head and sampling — as one graph replay. Its inputs live in
one static device buffer that one host→device copy fills per iteration (token ids, positions, cache
slots, context lengths, block tables, sampling parameters); the sampled ids come back in one
device→host copy. A batch of ``n`` sequences replays the smallest captured bucket ≥ ``n``; the pad
rows write the scratch block, attend to nothing, are spread over the experts with weight 0 and are
not counted (:attr:`~.hf_model.EPExperts.token_valid`).

Buckets are captured lazily, on first use, after one eager warm-up of the same bucket (kernels
compiled, workspaces allocated), all into one memory pool. A plan switch only rewrites the device
routing table in place, so the graphs stay valid.

Shapes: ``B`` the bucket, ``W`` the widest block table (blocks of a full-context sequence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.serve.attention import AttentionMetadata
from vexpert_runtime.serve.kv_cache import SCRATCH_BLOCK
from vexpert_runtime.serve.step import SequenceWork

# The static inputs, in the order they sit in the buffer (each [B] int64 unless noted).
_FIELDS = ("tokens", "positions", "slots", "lengths", "seeds", "draws", "temperature", "top_p", "valid")


def batch_buckets(max_batch: int) -> list[int]:
    """Bucket sizes up to ``max_batch``: 1, 2, 4, 8, then every 16 (pad ≤ 15 rows), and ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


@dataclass
class DecodeInputs:
    """Views into one static int64 buffer [len(_FIELDS)·B + B·W] (floats stored as float64 bits)."""

    buffer: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    seeds: torch.Tensor
    draws: torch.Tensor
    temperature: torch.Tensor  # float64 view
    top_p: torch.Tensor  # float64 view
    valid: torch.Tensor
    tables: torch.Tensor  # [B, W]

    @classmethod
    def allocate(cls, batch: int, width: int, device: torch.device | str, pin: bool = False) -> DecodeInputs:
        buffer = torch.zeros(len(_FIELDS) * batch + batch * width, dtype=torch.int64, device=device,
                             pin_memory=pin)
        views = {name: buffer[i * batch:(i + 1) * batch] for i, name in enumerate(_FIELDS)}
        views["temperature"] = views["temperature"].view(torch.float64)
        views["top_p"] = views["top_p"].view(torch.float64)
        tables = buffer[len(_FIELDS) * batch:].view(batch, width)
        return cls(buffer, tables=tables, **views)

    def fill(self, work: Sequence[SequenceWork], block_size: int) -> None:
        """Write a decode batch (host buffer): real rows first, then pad rows."""
        n = len(work)
        self.buffer.zero_()
        self.slots.fill_(SCRATCH_BLOCK * block_size)
        self.tokens[:n] = torch.tensor([item.tokens[0] for item in work])
        self.positions[:n] = torch.tensor([item.position for item in work])
        self.slots[:n] = torch.tensor([item.blocks[item.position // block_size] * block_size
                                       + item.position % block_size for item in work])
        self.lengths[:n] = self.positions[:n] + 1
        for row, item in enumerate(work):
            self.tables[row, : len(item.blocks)] = torch.tensor(item.blocks)
            spec = item.sample
            assert spec is not None, "a decode row always samples"
            self.seeds[row], self.draws[row] = spec.seed, spec.draw
            self.temperature[row], self.top_p[row] = spec.temperature, spec.top_p
        self.valid[:n] = 1

    def metadata(self, batch: int, block_size: int) -> AttentionMetadata:
        """The attention metadata of the first ``batch`` rows (views: a graph reads them in place)."""
        return AttentionMetadata(slot_mapping=self.slots[:batch], positions=self.positions[:batch],
                                 block_tables=self.tables[:batch], context_lens=self.lengths[:batch], groups=(),
                                 decode_only=True, block_size=block_size)


# forward(tokens [B], metadata, sampling (temperature, top_p, seed, draw, use_top_p), valid [B] bool,
#         warmup) -> ids [B]; a warm-up pass must leave no lasting effect but compiled kernels.
DecodeForward = Callable[[torch.Tensor, AttentionMetadata, tuple[Any, ...], torch.Tensor, bool], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps (see the module docstring).

    Args:
        forward: the model's decode forward (eager code; captured per bucket).
        max_batch: the largest batch (the scheduler's max_running). width: W.
        block_size: tokens per cache block. stream: the stream the rank computes on.
    """

    def __init__(self, forward: DecodeForward, max_batch: int, width: int, block_size: int,
                 device: torch.device, stream: Any) -> None:
        self.forward = forward
        self.buckets = batch_buckets(max_batch)
        self.width = width
        self.block_size = block_size
        self.stream = stream
        self.host = DecodeInputs.allocate(max_batch, width, "cpu", pin=True)
        self.device_inputs = DecodeInputs.allocate(max_batch, width, device)
        self.warmup_inputs = DecodeInputs.allocate(max_batch, width, device)  # pad rows only (scratch block)
        self.host_out = torch.zeros(max_batch, dtype=torch.int64, pin_memory=True)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None
        self.replays = 0

    def fits(self, work: Sequence[SequenceWork]) -> bool:
        """Whether ``work`` is a decode batch a graph can run."""
        return (0 < len(work) <= self.buckets[-1]
                and all(len(item.tokens) == 1 and item.sample is not None and len(item.blocks) <= self.width
                        for item in work))

    def run(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        """One decode iteration: [len(work)] int64 sampled ids on the CPU."""
        batch = next(b for b in self.buckets if b >= len(work))
        use_top_p = any(item.sample is not None and item.sample.top_p < 1.0 and item.sample.temperature > 0
                        for item in work)
        self.host.fill(work, self.block_size)
        self.device_inputs.buffer.copy_(self.host.buffer, non_blocking=True)
        key = (batch, use_top_p)
        if key not in self.graphs:
            self._capture(batch, use_top_p)
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        host = self.host_out[:batch]
        host.copy_(out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return host[: len(work)].clone()

    def _call(self, inputs: DecodeInputs, batch: int, use_top_p: bool, warmup: bool = False) -> torch.Tensor:
        sampling = (inputs.temperature[:batch].float(), inputs.top_p[:batch].float(), inputs.seeds[:batch],
                    inputs.draws[:batch], use_top_p)
        return self.forward(inputs.tokens[:batch], inputs.metadata(batch, self.block_size), sampling,
                            inputs.valid[:batch].bool(), warmup)

    def _capture(self, batch: int, use_top_p: bool) -> None:
        """Warm up eagerly on pad rows (kernels compiled, workspaces made), then capture the bucket."""
        self._call(self.warmup_inputs, batch, use_top_p, warmup=True)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's watchdog thread may touch its own side stream meanwhile
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = self._call(self.device_inputs, batch, use_top_p)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(batch, use_top_p)] = (graph, out)
