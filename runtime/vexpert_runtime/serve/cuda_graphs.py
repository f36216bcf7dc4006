"""A serving rank's iterations as CUDA graphs, one per token-count bucket.

An iteration — decodes and prompt chunks alike — runs the whole model as one graph replay:
embeddings, per layer the attention kernel over the paged cache (:mod:`.attention_kernels`, where
every token attends to its own sequence up to itself, so a prompt chunk needs no other code path)
and the MoE block (router, shared experts, the vExpert EP layer with its slot flag waits, in-place
routing table and dispatch kernel), the final norm, the LM head at each sampled token and sampling.
Its inputs live in one static device buffer that one host→device copy fills (token ids, positions,
cache slots, per-token context lengths and sequence rows, block tables, sampled rows, sampling
parameters); the sampled ids come back in one device→host copy.

An iteration of ``T`` tokens of ``B`` sequences replays the smallest captured bucket with at least
``T`` token rows (its sampling rows are ``min(bucket, max_seqs)``; :func:`token_buckets`). Pad rows write the scratch block,
attend to nothing, are spread over the experts with weight 0 and are not counted
(:attr:`~.moe_executors.EPExperts.token_valid`) — so an empty iteration (a rank with no work stepping in
lockstep with its EP group) is the 1-row bucket of pad rows only, not an eager pass. Every bucket is
captured at the first iteration, largest first (so the smaller ones reuse the memory of the larger),
each after one eager warm-up pass over pad rows only (kernels compiled, workspaces made, no lasting
effect), all in one memory pool; the top-p variants, those that report log-probabilities and those that split long contexts (split-KV,
:func:`~.attention_kernels.kv_splits`: small buckets once a context is long), on first use — the split
kernels themselves compile at the first iteration where the model's context can split. A plan switch only rewrites the
device routing table in place: graphs stay valid.

Shapes: ``T`` token rows, ``S`` sampling rows, ``W`` the widest block table (a full context).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from vexpert_runtime.gc_heap import collector_paused
from vexpert_runtime.serve.attention import AttentionMetadata
from vexpert_runtime.serve.kv_cache import SCRATCH_BLOCK
from vexpert_runtime.serve.penalties import PenaltyInputs, PenaltyRows
from vexpert_runtime.serve.sampling import truncates
from vexpert_runtime.serve.step import SequenceWork, StepLogprobs

_TOKEN_FIELDS = ("tokens", "positions", "slots", "lengths", "seqs", "valid", "fed", "penalty_rows", "outputs")
_PENALTY_SAMPLE_FIELDS = ("penalty_sample_rows", "repetition", "presence", "frequency")  # written only with penalties
_SAMPLE_FIELDS = ("rows", "seeds", "draws", "temperature", "top_p", "top_k", "min_p", *_PENALTY_SAMPLE_FIELDS)
# Fields a step reads as float32 / bool, each kept in the low bytes of its int64 element (float32 bits, a 0 / 1 byte)
# and read through a strided view of them: a graph reads them as they are, where ``.float()`` / ``.bool()`` conversions
# of whole-element fields were four kernels at the head of every replay (run 33b's Nsight Compute table: ~15 µs).
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")
_BOOL_FIELDS = ("valid", "outputs")
if sys.byteorder != "little":  # pragma: no cover - every platform torch serves on is little-endian
    raise ImportError("cuda_graphs keeps float32 and bool fields in the low bytes of int64 elements: little-endian only")


def token_buckets(max_tokens: int) -> list[int]:
    """Token-row buckets: 1, 2, 4, 8, every 16 up to 256, every 32 up to 512, then eight per doubling
    (every 64 up to 1024, every 128 up to 2048, …) and ``max_tokens`` itself.

    A replay pads to its bucket, so a bucket costs at most 1/8 of its rows in padding above 256
    (at 256 decodes most iterations carry a prompt chunk or two: the fine steps matter there), while
    the number of graphs — each captured at start and held — grows with log(max_tokens): 44 for a
    budget of 2048, 60 for 8192 (every 32 rows all the way: 72 and 264).
    """
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]
    step = 64
    while sizes[-1] < max_tokens:
        sizes += range(sizes[-1] + step, 2 * sizes[-1] + 1, step)
        step *= 2
    return sorted({*(b for b in sizes if b < max_tokens), max_tokens})


@dataclass
class GraphInputs:
    """Views into one static int64 buffer: the token fields [T] each, the sampling fields [S] each
    (float32 and bool fields in their elements' low bytes: :data:`_FLOAT_FIELDS`, :data:`_BOOL_FIELDS`), then the block tables [S, W] stored column by column (block j of
    every row together), so an iteration whose longest table has w blocks copies only the buffer's
    first :meth:`used` elements: a long context's W (10,240 columns for DeepSeek-V3's 163,840 tokens)
    costs nothing until a sequence is that long."""

    buffer: torch.Tensor
    views: dict[str, torch.Tensor]
    tables: torch.Tensor  # [S, W], strides (1, S)
    _numpy: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def allocate(cls, tokens: int, seqs: int, width: int, device: torch.device | str, pin: bool = False
                 ) -> GraphInputs:
        size = len(_TOKEN_FIELDS) * tokens + len(_SAMPLE_FIELDS) * seqs + seqs * width
        buffer = torch.zeros(size, dtype=torch.int64, device=device, pin_memory=pin)
        views, at = {}, 0
        for names, n in ((_TOKEN_FIELDS, tokens), (_SAMPLE_FIELDS, seqs)):
            for name in names:
                views[name] = buffer[at:at + n]
                at += n
        for name in _FLOAT_FIELDS:
            views[name] = views[name].view(torch.float32)[::2]
        for name in _BOOL_FIELDS:
            views[name] = views[name].view(torch.bool)[::8]
        return cls(buffer, views, buffer[at:].view(width, seqs).t())

    def used(self, work: Sequence[SequenceWork], width: int | None = None) -> int:
        """Elements of :attr:`buffer` an iteration of ``work`` reads: everything before the tables, and
        their columns up to the longest block table (``width``, :func:`table_width` when None; the device
        keeps stale columns beyond: a row is read only up to its context)."""
        seqs = self.tables.shape[0]
        width = table_width(work) if width is None else width
        return self.buffer.numel() - self.tables.numel() + max(width, 1) * seqs

    def fill(self, work: Sequence[SequenceWork], block_size: int, penalty_rows: PenaltyRows | None = None) -> int:
        """Write an iteration into this (host, pinned) buffer: real rows first, pad rows after;
        the number of sampling rows used. Per-field numpy writes from one list per field: at 256
        sequences this runs every few milliseconds on the serving loop's thread. ``penalty_rows``:
        each item's row of the penalty tables (:mod:`.penalties`; None: no item is penalized, and the
        penalty fields are left as they are — only a graph with penalties reads them)."""
        v = self._host_views()
        tables = v["tables"]
        items = len(work)
        counts = [len(item.tokens) for item in work]
        n = sum(counts)
        starts = np.array([item.position for item in work], np.int64)
        if n == items:  # one token each (decodes): the steady state, no repeats needed
            v["tokens"][:n] = [item.tokens[0] for item in work]
            seqs = ends = np.arange(n, dtype=np.int64)
            positions = starts
        else:
            lengths = np.array(counts, np.int64)
            ends = np.cumsum(lengths) - 1  # each item's last token row
            seqs = np.repeat(np.arange(items, dtype=np.int64), lengths)
            positions = np.repeat(starts - (ends + 1 - lengths), lengths) + np.arange(n, dtype=np.int64)
            v["tokens"][:n] = np.fromiter(chain.from_iterable([item.tokens for item in work]), np.int64, n)
        v["tokens"][n:] = 0
        end_rows = ends.tolist()
        v["fed"][:] = -1
        fed = [(row, item.fed) for row, item in zip(end_rows, work, strict=True) if item.fed is not None]
        if fed:  # decodes whose one token the previous step sampled (on the device)
            fed_rows, fed_from = zip(*fed, strict=True)
            v["fed"][list(fed_rows)] = fed_from
        v["positions"][:n] = positions
        v["positions"][n:] = 0
        v["lengths"][:n] = positions + 1
        v["lengths"][n:] = 0
        v["seqs"][:n] = seqs
        v["seqs"][n:] = 0
        v["valid"][:n] = 1
        v["valid"][n:] = 0
        # block tables: the used rows, one scatter of every block id (columns past a row's blocks
        # keep whatever they held: attention reads a row only up to its context length)
        widths = np.array([len(item.blocks) for item in work], np.int64)
        total = int(widths.sum())
        flat = np.fromiter(chain.from_iterable([item.blocks for item in work]), np.int64, total)
        first = np.cumsum(widths) - widths
        tables[np.repeat(np.arange(items), widths), np.arange(total) - np.repeat(first, widths)] = flat
        v["slots"][:n] = tables[seqs, positions // block_size] * block_size + positions % block_size
        v["slots"][n:] = SCRATCH_BLOCK * block_size
        sampled = [(row, item.sample) for row, item in zip(end_rows, work, strict=True) if item.sample is not None]
        s = len(sampled)
        if s:
            rows, specs = zip(*sampled, strict=True)
            v["rows"][:s] = rows
            v["seeds"][:s] = [spec.seed for spec in specs]
            v["draws"][:s] = [spec.draw for spec in specs]
            v["temperature"][:s] = [spec.temperature for spec in specs]
            v["top_p"][:s] = [spec.top_p for spec in specs]
            v["top_k"][:s] = [spec.top_k for spec in specs]
            v["min_p"][:s] = [spec.min_p for spec in specs]
        for name in _SAMPLE_FIELDS[: -len(_PENALTY_SAMPLE_FIELDS)]:
            v[name][s:] = 0
        if penalty_rows is not None:
            self._fill_penalties(work, penalty_rows, seqs, positions, n, s, v)
        return s

    @staticmethod
    def _fill_penalties(work: Sequence[SequenceWork], penalty_rows: PenaltyRows, seqs: np.ndarray,
                        positions: np.ndarray, n: int, s: int, v: dict[str, np.ndarray]) -> None:
        """The penalty fields (:class:`~.penalties.PenaltyInputs`); pad rows write the scratch row."""
        scratch = penalty_rows.scratch
        rows = np.array(penalty_rows.rows, np.int64)
        prompt_lens = np.array([item.penalty_prompt_len for item in work], np.int64)
        v["penalty_rows"][:n] = rows[seqs]
        v["penalty_rows"][n:] = scratch
        v["outputs"][:n] = (positions >= prompt_lens[seqs]) & (prompt_lens[seqs] >= 0)
        v["outputs"][n:] = 0
        sampled = [(row, item.sample) for row, item in zip(penalty_rows.rows, work, strict=True)
                   if item.sample is not None]
        v["penalty_sample_rows"][:s] = [row for row, _ in sampled]
        v["penalty_sample_rows"][s:] = scratch
        v["repetition"][:s] = [spec.repetition for _, spec in sampled]
        v["repetition"][s:] = 1.0
        v["presence"][:s] = [spec.presence for _, spec in sampled]
        v["presence"][s:] = 0.0
        v["frequency"][:s] = [spec.frequency for _, spec in sampled]
        v["frequency"][s:] = 0.0

    def _host_views(self) -> dict[str, np.ndarray]:
        """numpy views of :attr:`views` and :attr:`tables` (made once: a view costs µs per call)."""
        if self._numpy is None:
            self._numpy = {name: t.numpy() for name, t in self.views.items()}
            self._numpy["tables"] = self.tables.numpy()
        return self._numpy

    def metadata(self, tokens: int, seqs: int, block_size: int, kv_splits: int = 1) -> AttentionMetadata:
        """Attention metadata over the first ``tokens`` / ``seqs`` rows (views: a graph reads them in place)."""
        v = self.views
        return AttentionMetadata(slot_mapping=v["slots"][:tokens], positions=v["positions"][:tokens],
                                 block_tables=self.tables[:seqs], context_lens=v["lengths"][:tokens],
                                 token_seq=v["seqs"][:tokens], groups=(), block_size=block_size, kv_splits=kv_splits)


class GraphKey(NamedTuple):
    """Which captured graph an iteration replays (:func:`graph_key`)."""

    tokens: int  # the token bucket
    truncate: bool  # truncated sampling (min-p, top-k, top-p)
    splits: int  # the decode kernels' context splits
    logprobs: bool  # log-probabilities reported
    penalties: bool  # penalties tracked and applied


def graph_key(work: Sequence[SequenceWork], buckets: Sequence[int], block_size: int,
              kv_splits: Callable[[int, int], int] | None, width: int) -> GraphKey:
    """The graph of an iteration: the smallest bucket with a row for every token; whether any sampled row
    draws from fewer than all tokens (:func:`~.sampling.truncates`: a graph of its own, as the sort over
    the vocabulary costs the others nothing); the decode kernels' splits for that bucket at the longest
    context the tables reach (``width`` blocks); whether any sampled row asks for log-probabilities, and
    whether any item is of a sequence sampled with penalties (likewise: work over the vocabulary that
    the others skip)."""
    tokens = sum(len(item.tokens) for item in work)
    bucket = next(b for b in buckets if b >= tokens)
    truncate = logprobs = penalties = False
    for item in work:
        if item.sample is not None:
            truncate = truncate or truncates(item.sample)
            logprobs = logprobs or item.sample.logprobs
        penalties = penalties or item.penalty_prompt_len >= 0
    splits = 1 if kv_splits is None else kv_splits(bucket, width * block_size)
    return GraphKey(bucket, truncate, splits, logprobs, penalties)


def table_width(work: Sequence[SequenceWork]) -> int:
    """The longest block table of an iteration, in blocks."""
    return max((len(item.blocks) for item in work), default=0)


# forward(tokens [T], fed [T] (−1, or the previous step's sampling row a token comes from), metadata,
#         sample_rows [S], sampling (temperature, top_p, top_k, min_p, seed, draw, truncate), valid [T] bool, warmup,
#         logprobs, penalties (PenaltyInputs or None)) -> (ids [S],) or, with logprobs, (ids [S], sampled [S],
# top ids [S, K], top logprobs [S, K]); a warm-up pass must leave nothing behind but compiled kernels.
GraphForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, tuple[Any, ...], torch.Tensor,
                         bool, bool, PenaltyInputs | None], tuple[torch.Tensor, ...]]


@dataclass
class _Staging:
    """One of two pinned host sides of the graph inputs and outputs: while the device runs step i
    from one, the host fills step i+1 into the other. ``outs``: the sampled ids [S] and, for a
    graph with log-probabilities, their three tensors (allocated at its first use). ``copied``: the
    event after its inputs' copy to the device (the host may refill it once that has run)."""

    inputs: GraphInputs
    outs: list[torch.Tensor]
    copied: Any = None

    def host_outputs(self, device_outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host views as large as ``device_outs`` (its rows at most :attr:`outs`' first's)."""
        while len(self.outs) < len(device_outs):
            like = device_outs[len(self.outs)]
            self.outs.append(torch.zeros((self.outs[0].shape[0], *like.shape[1:]), dtype=like.dtype, pin_memory=True))
        return [host[: out.shape[0]] for host, out in zip(self.outs, device_outs, strict=False)]


@dataclass
class GraphStep:
    """A replayed iteration in flight (:class:`~.step.PendingStep`)."""

    done: Any  # CUDA event after the outputs' copy to the host
    outs: list[torch.Tensor]  # pinned host ids [S] (and log-probabilities: GraphForward), valid once ``done``
    rows: list[int]  # the work items that sample, in sampling-row order
    items: int

    def result(self) -> torch.Tensor:
        self.done.synchronize()
        result = torch.full((self.items,), -1, dtype=torch.int64)
        result[self.rows] = self.outs[0][: len(self.rows)]
        return result

    def prompt_logprobs(self) -> None:
        """Never: an iteration that reports prompt log-probabilities runs eagerly."""
        return None

    def logprobs(self) -> StepLogprobs | None:
        if len(self.outs) == 1:
            return None
        self.done.synchronize()
        sampled, top_ids, top_logprobs = self.outs[1:]
        return StepLogprobs.at_rows(self.items, self.rows, sampled, top_ids, top_logprobs)


class GraphedSteps:
    """Captured iterations (see the module docstring).

    Args:
        forward: the model's forward (eager code; captured per bucket).
        max_tokens: the most tokens in an iteration (the scheduler's max_batch_tokens).
        max_seqs: the most sequences in an iteration (max_running). width: W.
        block_size: tokens per cache block. stream: the stream the rank computes on.
        kv_splits: (bucket rows, longest context in tokens) → the decode kernels' context splits
            (:func:`~.attention_kernels.kv_splits`); a bucket gets a graph per value it meets, on
            first use, as for truncated sampling (min-p, top-k, top-p). None: always one pass.
    """

    def __init__(self, forward: GraphForward, max_tokens: int, max_seqs: int, width: int, block_size: int,
                 device: torch.device, stream: Any, kv_splits: Callable[[int, int], int] | None = None) -> None:
        self.forward = forward
        self.kv_splits = kv_splits
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.width = width
        self.block_size = block_size
        self.stream = stream
        self.staging = [_Staging(GraphInputs.allocate(max_tokens, max_seqs, width, "cpu", pin=True),
                                 [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=True)]) for _ in range(2)]
        self.device_inputs = GraphInputs.allocate(max_tokens, max_seqs, width, device)
        self.warmup_inputs = GraphInputs.allocate(max_tokens, max_seqs, width, device)  # pad rows only
        # GraphKey → the graph and its outputs
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool: Any = None
        self.replays = 0

    def fits(self, work: Sequence[SequenceWork]) -> bool:
        """Whether a captured bucket can run ``work`` (prompt log-probabilities: never, they run eagerly)."""
        return (len(work) <= self.max_seqs and sum(len(item.tokens) for item in work) <= self.buckets[-1]
                and all(len(item.blocks) <= self.width and not item.prompt_targets for item in work))

    def run(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        """One iteration: [len(work)] int64 on the CPU, the sampled ids (−1 where nothing is sampled)."""
        return self.launch(work).result()

    def key_for(self, work: Sequence[SequenceWork], width: int | None = None) -> GraphKey:
        """The graph an iteration of ``work`` replays (:func:`graph_key`)."""
        return graph_key(work, self.buckets, self.block_size, self.kv_splits,
                         table_width(work) if width is None else width)

    def launch(self, work: Sequence[SequenceWork], penalty_rows: PenaltyRows | None = None) -> GraphStep:
        """Enqueue one iteration (one input copy, one replay, one output copy) without waiting for it;
        ``penalty_rows``: the items' rows of the penalty tables when any is penalized."""
        staging = self.staging[self.replays % 2]
        if staging.copied is not None:  # its inputs of two steps ago are on the device (long since, as a rule)
            staging.copied.synchronize()
        staging.inputs.fill(work, self.block_size, penalty_rows)
        width = table_width(work)
        used = staging.inputs.used(work, width)
        self.device_inputs.buffer[:used].copy_(staging.inputs.buffer[:used], non_blocking=True)
        staging.copied = torch.cuda.Event()
        staging.copied.record()
        if not self.graphs:  # the first iteration: every plain bucket now, not one by one while serving
            for size in reversed(self.buckets):
                self._capture(GraphKey(size, False, 1, False, False))
            longest = self.width * self.block_size  # the model's context: does any launch ever split?
            splits = 1 if self.kv_splits is None else self.kv_splits(1, longest)
            if splits > 1:  # compile the split kernels now, not when the first long context arrives
                self._call(self.warmup_inputs, GraphKey(1, False, splits, False, False), warmup=True)
        key = self.key_for(work, width)
        if key not in self.graphs:
            self._capture(key)
        graph, outs = self.graphs[key]
        graph.replay()
        self.replays += 1
        hosts = staging.host_outputs(outs)
        for host, out in zip(hosts, outs, strict=True):
            host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return GraphStep(done, hosts, [b for b, item in enumerate(work) if item.sample is not None], len(work))

    def _call(self, inputs: GraphInputs, key: GraphKey, warmup: bool = False) -> tuple[torch.Tensor, ...]:
        tokens = key.tokens
        seqs = min(tokens, self.max_seqs)
        v = inputs.views
        sampling = (v["temperature"][:seqs], v["top_p"][:seqs], v["top_k"][:seqs], v["min_p"][:seqs],
                    v["seeds"][:seqs], v["draws"][:seqs], key.truncate)
        penalties = None
        if key.penalties:
            penalties = PenaltyInputs(v["penalty_rows"][:tokens], v["outputs"][:tokens], v["penalty_sample_rows"][:seqs],
                                      v["repetition"][:seqs], v["presence"][:seqs], v["frequency"][:seqs])
        meta = inputs.metadata(tokens, seqs, self.block_size, key.splits)
        return self.forward(v["tokens"][:tokens], v["fed"][:tokens], meta, v["rows"][:seqs], sampling,
                            v["valid"][:tokens], warmup, key.logprobs, penalties)

    def _capture(self, key: GraphKey) -> None:
        """Warm up eagerly on pad rows, then capture the bucket."""
        self._call(self.warmup_inputs, key, warmup=True)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's watchdog thread may touch its own side stream meanwhile;
        # no garbage collection inside the capture (gc_heap.collector_paused says why)
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                                  capture_error_mode="thread_local"):
            outs = self._call(self.device_inputs, key)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, outs)
