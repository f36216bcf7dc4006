"""The contract between a rank's scheduler and the model it drives.

A rank's scheduler decides, every iteration, which of its sequences run and which tokens each feeds
(a prompt chunk, or the token sampled last); the model runs them as one batch and returns the logits
at each sequence's last new token. Every EP rank calls :meth:`StepModel.step` once per iteration, in
lockstep — with an empty list when it has no work — because the MoE layers inside are collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SequenceWork:
    """One sequence's share of an iteration.

    ``tokens``: the new token ids to run (≥ 1): a prompt chunk, or the one token sampled last.
    ``position``: the position of ``tokens[0]`` in the sequence, i.e. how many of its tokens the
    model already holds in its KV cache (0 for a new sequence).
    """

    seq_id: int
    tokens: tuple[int, ...]
    position: int


class StepModel(Protocol):
    """A causal LM run one iteration at a time over a changing set of sequences."""

    vocab_size: int
    max_context: int  # the longest sequence (prompt + generated) the model accepts

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence holds (all layers)."""
        ...

    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        """Run one iteration: [len(work), vocab_size] float32 logits at each sequence's last new
        token (on the CPU). Sequences not in ``work`` keep their caches untouched."""
        ...

    def release(self, seq_id: int) -> None:
        """Drop a finished or cancelled sequence's KV cache."""
        ...
