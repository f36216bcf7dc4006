"""The contract between a rank's scheduler and the model it drives.

A rank's scheduler decides, every iteration, which of its sequences run and which tokens each feeds
(a prompt chunk, or the token sampled last) and which KV-cache blocks each holds (it owns the
:class:`~.kv_cache.BlockPool`); the model runs them as one batch, writes their keys and values into
those blocks and samples the next token of every sequence whose prompt is done (on the device: one
small device→host copy per iteration, not the logits). Every EP rank calls :meth:`StepModel.step` once per iteration, in
lockstep — with an empty list when it has no work — because the MoE layers inside are collectives.

**Overlapped steps.** On a GPU the host's bookkeeping (forming the batch, detokenizing, sending
events) would leave the device idle between iterations. A model with ``overlaps_steps`` lets the
scheduler :meth:`StepModel.launch` iteration i+1 *before* it reads iteration i's tokens: a decode
whose last token the host has not seen yet names the sampling row it came from (``SequenceWork.fed``)
and the model takes that token from its device copy of the previous step's sampled ids. The host
then reads step i's tokens while the device runs step i+1. A sequence that stopped at step i (EOS,
a stop string, a cancel) has one wasted row in step i+1, and its blocks return only once that step is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

# SamplingSpec and SequenceWork are made for every sequence of every iteration (hundreds per few
# milliseconds on the serving loop's thread): plain slotted dataclasses, whose construction costs a
# fifth of a frozen one's. Nothing changes them once made.


@dataclass(slots=True)
class SamplingSpec:
    """How to pick a sequence's next token: greedy below a tiny temperature, else temperature +
    min-p, top-k and top-p (0, 0 and 1: off). ``seed`` and ``draw`` (how many tokens the sequence
    sampled before) make the draw a pure function of the request, whatever shares its batch
    (:func:`~.sampling.sample_tokens`). ``logprobs``: also report the sampled token's log-probability
    and the :data:`~.events.MAX_LOGPROBS` most likely tokens' (:class:`StepLogprobs`). ``repetition``,
    ``presence``, ``frequency``: vLLM's penalties (1, 0, 0: off), ``logit_bias`` (token id, bias) pairs
    (:mod:`.penalties`; either needs the item's ``penalty_prompt_len``); ``allowed``: a constrained sequence's
    tokens this draw may take, a bitmask [⌈V/32⌉] int32 on the CPU (:mod:`.structured_output`; likewise), None: all;
    ``only``: the tokens any of its draws may take (a request's ``allowed_token_ids``), a bitmask likewise, the
    same tensor at every draw (written with its logit bias; ``allowed`` already holds it), None: all."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    draw: int = 0
    top_k: int = 0
    min_p: float = 0.0
    logprobs: bool = False
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed: torch.Tensor | None = None
    only: torch.Tensor | None = None


@dataclass(frozen=True)
class StepLogprobs:
    """Log-probabilities of an iteration's sampled tokens under the model's distribution (the
    log-softmax of its logits, before temperature, min-p, top-k and top-p: vLLM's default
    ``raw_logprobs``), one row per work item (rows that sampled nothing, or did not ask, hold
    anything). CPU tensors: ``sampled`` [len(work)] float32, the sampled token's; ``top_ids`` [len(work), K]
    int64 and ``top_logprobs`` [len(work), K] float32, the K = min(:data:`~.events.MAX_LOGPROBS`, vocabulary)
    most likely tokens, most likely first."""

    sampled: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def at_rows(cls, items: int, rows: Sequence[int], sampled: torch.Tensor, top_ids: torch.Tensor,
                top_logprobs: torch.Tensor) -> StepLogprobs:
        """Per work item, from the sampling rows' [S, …] (CPU; row s is item ``rows[s]``)."""
        k = top_ids.shape[1]
        out = cls(torch.full((items,), float("nan")), torch.zeros(items, k, dtype=torch.int64),
                  torch.full((items, k), float("nan")))
        out.sampled[list(rows)] = sampled[: len(rows)].float()
        out.top_ids[list(rows)] = top_ids[: len(rows)]
        out.top_logprobs[list(rows)] = top_logprobs[: len(rows)].float()
        return out


@dataclass(slots=True)
class SequenceWork:
    """One sequence's share of an iteration.

    ``tokens``: the new token ids to run (≥ 1): a prompt chunk, or the one token sampled last.
    ``position``: the position of ``tokens[0]`` in the sequence, i.e. how many of its tokens the
    model already holds in its KV cache (0 for a new sequence).
    ``blocks``: the sequence's KV block table, covering ``position + len(tokens)`` tokens.
    ``sample``: sample a token after the last new one (None: a prompt chunk that does not end the prompt).
    ``fed``: a decode whose token the previous step sampled at its sampling row ``fed`` (the host has
    not read it yet, see the module docstring): the model takes it from the device, ``tokens`` holds
    a placeholder.
    ``penalty_prompt_len``: for a sequence sampled with penalties or a logit bias, its prompt's length
    (tokens at positions ≥ it are its output) — the model keeps such a sequence's row (:mod:`.penalties`)
    from every item, sampling or not; −1 for the others.
    ``prompt_targets``: report prompt log-probabilities — for each of ``tokens``, the prompt token that
    follows it (its log-probability given the tokens up to this one), −1 where none is wanted; empty: none
    (:class:`PromptLogprobs`; such a step runs eagerly).
    """

    seq_id: int
    tokens: tuple[int, ...]
    position: int
    blocks: tuple[int, ...] = ()
    sample: SamplingSpec | None = None
    fed: int | None = None
    penalty_prompt_len: int = -1
    prompt_targets: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens an iteration computed: per work item index that gave
    ``prompt_targets``, for its targets ≥ 0 in order, (the target's log-probability [n] float32, the K most
    likely tokens' ids [n, K] int64 and log-probabilities [n, K] float32), on the CPU, under the model's
    distribution as :class:`StepLogprobs`; ``ranks``, where the model computes them, per item the targets' ranks
    [n] int64 (vLLM's: how many tokens are at least as likely; 1 is the most likely)."""

    items: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ranks: dict[int, torch.Tensor] = field(default_factory=dict)


class PendingStep(Protocol):
    """An iteration the model launched; its sampled tokens once it is done."""

    def result(self) -> torch.Tensor:
        """Wait for the iteration: [len(work)] int64 on the CPU, as :meth:`StepModel.step` returns."""
        ...

    def logprobs(self) -> StepLogprobs | None:
        """After :meth:`result`: the sampled tokens' log-probabilities when an item's spec asked for
        them (None: none asked, or a model that does not compute them)."""
        ...

    def prompt_logprobs(self) -> PromptLogprobs | None:
        """After :meth:`result`: the prompt log-probabilities items asked for (``prompt_targets``)."""
        ...


@dataclass(frozen=True)
class FinishedStep:
    """A :class:`PendingStep` already done (a model that computes while it launches)."""

    tokens: torch.Tensor
    sampled_logprobs: StepLogprobs | None = None
    prompt: PromptLogprobs | None = None

    def result(self) -> torch.Tensor:
        return self.tokens

    def logprobs(self) -> StepLogprobs | None:
        return self.sampled_logprobs

    def prompt_logprobs(self) -> PromptLogprobs | None:
        return self.prompt


class StepModel(Protocol):
    """A causal LM run one iteration at a time over a changing set of sequences."""

    vocab_size: int
    max_context: int  # the longest sequence (prompt + generated) the model accepts
    kv_block_size: int  # tokens per KV-cache block
    overlaps_steps: bool  # whether the scheduler may launch step i+1 before it reads step i (``fed``)

    @property
    def kv_num_blocks(self) -> int:
        """Blocks in the model's KV cache (block 0 is scratch)."""
        ...

    @property
    def kv_cache_bytes(self) -> int:
        """Device memory those blocks take."""
        ...

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence holds (all layers)."""
        ...

    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        """Run one iteration: [len(work)] int64 on the CPU, the token sampled for each item with a
        ``sample`` spec (−1 for the others). Blocks not in ``work`` keep their contents."""
        ...

    def launch(self, work: Sequence[SequenceWork]) -> PendingStep:
        """Enqueue one iteration (as :meth:`step`, whose tokens :meth:`PendingStep.result` returns).
        Only a model with ``overlaps_steps`` may receive ``fed`` items."""
        ...

    def release(self, seq_id: int) -> None:
        """A finished or cancelled sequence is gone (its blocks are back in the scheduler's pool)."""
        ...


class SynchronousSteps:
    """What a model whose :meth:`StepModel.step` is the whole iteration provides: ``launch`` runs it."""

    overlaps_steps = False

    def launch(self, work: Sequence[SequenceWork]) -> PendingStep:
        return FinishedStep(self.step(work))  # type: ignore[attr-defined]
