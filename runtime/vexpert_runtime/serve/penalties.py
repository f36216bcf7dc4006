"""Repetition, presence and frequency penalties and a logit bias on the model's device, as vLLM applies them;
graph-capturable.

A sequence sampled with either holds a row of three [R + 1, V] tables from its first step until the model
releases it: ``seen`` (the tokens of its prompt and output: the repetition penalty's set), ``counts`` (how often
each token occurs in its output: the frequency and presence penalties') and ``bias`` (its logit bias, written
from the host when its first sampling item comes, and again when it changes — ``min_tokens``' stop ids at −inf
until then — an eager write ahead of the step, in stream order; zeroed when the row is taken; a constrained
sequence's is written every step: −inf on the tokens its grammar does not allow, :mod:`.structured_output`). The tables are written from each
step's own input tokens — a sequence's prompt chunks, its decodes (the token it sampled last), everything
again after a preemption — so nothing is copied from the host: a row is cleared by its sequence's
position-0 token (a new sequence, or one prefilled again after a preemption), and a token at a position
≥ the prompt's length counts as output. A step records its tokens before it samples, so the penalties at
a sampled position cover every token before it. Row R is scratch: the tokens of unpenalized sequences
write it (it is cleared every step), their samples read it with neutral penalties, which change nothing.

Shapes: ``T`` token rows, ``S`` sampling rows, ``V`` the vocabulary, ``R`` the rows of penalized sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from vexpert_runtime.serve.step import SequenceWork
from vexpert_runtime.serve.structured_output import unpack_allowed


class PenaltyInputs(NamedTuple):
    """A step's penalty inputs: ``token_rows`` [T] int64 (each token's sequence's row; R: none),
    ``outputs`` [T] bool (the token is output), ``sample_rows`` [S] int64 (each sampling row's sequence's
    row), ``repetition``, ``presence``, ``frequency`` [S] float32."""

    token_rows: torch.Tensor
    outputs: torch.Tensor
    sample_rows: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor


class PenaltyRows(NamedTuple):
    """Each work item's row of the tables (``scratch`` for an unpenalized one)."""

    rows: list[int]
    scratch: int


def record_tokens(seen: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                  inputs: PenaltyInputs) -> None:
    """Write a step's input tokens [T] (at ``positions`` [T]) into ``seen`` [R + 1, V] bool and ``counts``
    [R + 1, V] int32, in place: first clear the rows whose sequence starts here (position 0) and the
    scratch row, then mark every token seen and count the outputs."""
    scratch, vocab = seen.shape[0] - 1, seen.shape[1]
    cleared = torch.where(positions == 0, inputs.token_rows, scratch)
    seen.index_fill_(0, cleared, False)
    counts.index_fill_(0, cleared, 0)
    # flat scatters (atomic adds on a GPU: no sort, no host sync inside a CUDA graph)
    seen.view(-1).scatter_(0, inputs.token_rows * vocab + tokens, True)
    counted = torch.where(inputs.outputs, inputs.token_rows, scratch) * vocab + tokens
    counts.view(-1).scatter_add_(0, counted, torch.ones_like(counted, dtype=counts.dtype))


def penalized_logits(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, inputs: PenaltyInputs,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [S, V] (float32) with the logit bias [R + 1, V] added (when given), then vLLM's penalties: a token
    the sequence holds (prompt or output) has its logit divided by the repetition penalty where positive,
    multiplied where not (as transformers' ``repetition_penalty``); then minus frequency × its output count and
    presence × (count > 0) — vLLM's order (logits processors, then penalties)."""
    rows = inputs.sample_rows
    if bias is not None:
        logits = logits + bias[rows]
    occurred = counts[rows].to(logits.dtype)
    repetition = inputs.repetition.unsqueeze(1)
    logits = torch.where(seen[rows], torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - inputs.frequency.unsqueeze(1) * occurred - inputs.presence.unsqueeze(1) * (occurred > 0)


class PenaltyState:
    """The tables and which sequence holds which row (see the module docstring). ``capacity`` rows
    are made at the first penalized step; :meth:`reserve` (before CUDA graphs capture the tables) fixes
    them, else they grow as sequences come."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.fixed = False
        self._rows: dict[int, int] = {}  # seq_id → row
        # seq_id → the bias its row holds (None: also a grammar's mask, rewritten every step)
        self._written: dict[int, tuple[tuple[int, float], ...] | None] = {}
        self._free: list[int] = []

    @property
    def scratch(self) -> int:
        return 0 if self.seen is None else self.seen.shape[0] - 1

    def reserve(self, rows: int) -> None:
        """Make the tables for ``rows`` penalized sequences now and never reallocate them (CUDA graphs
        hold their addresses)."""
        if self.seen is None or self.seen.shape[0] - 1 < rows:
            self._grow(rows)
        self.fixed = True

    def rows_for(self, work: Sequence[SequenceWork], reserve: int | None = None) -> PenaltyRows | None:
        """Each item's row (the scratch row for an unpenalized one), a row taken for a penalized
        sequence (``penalty_prompt_len`` ≥ 0) the first time it comes; None when no item is penalized.
        ``reserve``: a step a CUDA graph will run — the tables are fixed at that many rows first (:meth:`reserve`)."""
        if not any(item.penalty_prompt_len >= 0 for item in work):
            return None
        if reserve is not None and not self.fixed:
            self.reserve(reserve)
        cleared: list[int] = []  # rows zeroed (one launch for all: a row each was a launch each, 256 a step)
        biased: list[tuple[int, Sequence[tuple[int, float]]]] = []  # (row, its logit bias), written after
        masked: list[tuple[int, torch.Tensor]] = []  # (row, its grammar's allowed tokens), masked last
        for item in work:
            if item.seq_id not in self._rows and item.penalty_prompt_len >= 0:
                if not self._free:
                    if self.fixed:
                        raise RuntimeError(f"all {self.scratch} penalty rows are held (reserve more)")
                    self._grow(max(8, 2 * self.scratch))
                self._rows[item.seq_id] = row = self._free.pop()
                cleared.append(row)  # what an earlier holder left
            spec = item.sample
            # (a sequence with allowed token ids has nothing written until its first draw: None ≠ every bias)
            if spec is not None and item.seq_id in self._rows and (
                    spec.allowed is not None
                    or spec.logit_bias != self._written.get(item.seq_id, () if spec.only is None else None)):
                row = self._rows[item.seq_id]  # a new bias (the first, min_tokens reached, a grammar's step): rewrite
                cleared.append(row)
                if spec.logit_bias:
                    biased.append((row, spec.logit_bias))
                self._written[item.seq_id] = spec.logit_bias if spec.allowed is None else None
                mask = spec.allowed if spec.allowed is not None else spec.only  # (a grammar's holds the other)
                if mask is not None:
                    masked.append((row, mask))
        if cleared:
            assert self.bias is not None
            self.bias.index_fill_(0, self._upload(torch.tensor(cleared, dtype=torch.int64)), 0.0)
        for row, pairs in biased:
            self._write_bias(row, pairs)
        if masked:
            self._mask(masked)
        scratch = self.scratch
        return PenaltyRows([self._rows.get(item.seq_id, scratch) for item in work], scratch)

    def release(self, seq_id: int) -> None:
        """The sequence is gone (finished, or preempted: prefilled again, it takes a row afresh)."""
        row = self._rows.pop(seq_id, None)
        self._written.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def inputs(self, work: Sequence[SequenceWork], rows: PenaltyRows) -> PenaltyInputs:
        """The penalty inputs of an eagerly run step (a graphed one reads them from its input buffer)."""
        token_rows, outputs, sample_rows, specs = [], [], [], []
        for item, row in zip(work, rows.rows, strict=True):
            count = len(item.tokens)
            token_rows += [row] * count
            outputs += [item.position + i >= item.penalty_prompt_len >= 0 for i in range(count)]
            if item.sample is not None:
                sample_rows.append(row)
                specs.append(item.sample)
        device = self.device
        return PenaltyInputs(
            torch.tensor(token_rows, dtype=torch.int64).to(device), torch.tensor(outputs).to(device),
            torch.tensor(sample_rows, dtype=torch.int64).to(device),
            torch.tensor([s.repetition for s in specs], dtype=torch.float32).to(device),
            torch.tensor([s.presence for s in specs], dtype=torch.float32).to(device),
            torch.tensor([s.frequency for s in specs], dtype=torch.float32).to(device))

    def _write_bias(self, row: int, pairs: Sequence[tuple[int, float]]) -> None:
        """A sequence's logit bias into its row (an eager write, ahead of the step that samples with it)."""
        assert self.bias is not None
        ids, values = zip(*pairs, strict=True)
        self.bias[row, self._upload(torch.tensor(ids, dtype=torch.int64))] = self._upload(
            torch.tensor(values, dtype=self.bias.dtype))

    def _mask(self, masked: Sequence[tuple[int, torch.Tensor]]) -> None:
        """−inf in the rows' bias where their grammar (or allowed token ids) allows no token (each a bitmask [≥ W]
        int32 on the CPU, W = ⌈V / 32⌉ — llguidance's vocabulary may be wider; one upload for all of them, eager,
        ahead of the step)."""
        assert self.bias is not None
        rows = self._upload(torch.tensor([row for row, _ in masked], dtype=torch.int64))
        width = (self.vocab_size + 31) // 32
        allowed = unpack_allowed(self._upload(torch.stack([words[:width] for _, words in masked])), self.vocab_size)
        self.bias.index_copy_(0, rows, self.bias.index_select(0, rows).masked_fill_(~allowed, float("-inf")))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the model's device without waiting for the device: a copy from pinned memory, in stream order
        (a copy from pageable memory would wait for the step in flight, and the overlap be lost)."""
        if torch.device(self.device).type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _grow(self, rows: int) -> None:
        seen = torch.zeros(rows + 1, self.vocab_size, dtype=torch.bool, device=self.device)
        counts = torch.zeros(rows + 1, self.vocab_size, dtype=torch.int32, device=self.device)
        bias = torch.zeros(rows + 1, self.vocab_size, dtype=torch.float32, device=self.device)
        old = 0 if self.seen is None or self.counts is None else self.seen.shape[0] - 1
        if self.seen is not None and self.counts is not None and self.bias is not None:
            seen[:old] = self.seen[:old]
            counts[:old] = self.counts[:old]
            bias[:old] = self.bias[:old]
        self.seen, self.counts, self.bias = seen, counts, bias
        self._free = [*range(rows - 1, old - 1, -1), *self._free]
