"""Sampling, incremental detokenization and stop handling: small pure pieces the scheduler composes.

Each request owns a :class:`torch.Generator` seeded from its ``seed``, so a seeded request samples
the same tokens whatever else shares its batch (the draws of one request never consume another's
random stream).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (dividing by ~0 only overflows)
_DETOKENIZE_CONTEXT = 6  # prompt tokens decoded before the first new one, so leading spaces come out right


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded when ``seed`` is given, else from fresh entropy."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def greedy(logits: torch.Tensor) -> int:
    """The most likely token (ties: the lowest id, as ``torch.argmax`` and HF ``generate`` pick)."""
    return int(torch.argmax(logits))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest most-likely set whose probability reaches ``top_p``.

    The most likely token always stays, so the result never sums to zero.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    sorted_probs[0] = probs[order[0]]
    return torch.zeros_like(probs).scatter(0, order, sorted_probs)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from a [vocab] row of logits: greedy at temperature 0, else temperature + top-p."""
    if temperature < GREEDY_BELOW:
        return greedy(logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs = top_p_filter(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def eos_token_ids(tokenizer: Any, extra: Iterable[int] = ()) -> frozenset[int]:
    """The ids that end generation: the tokenizer's EOS plus ``extra`` (e.g. the generation config's)."""
    ids = set(extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas whose concatenation equals the full decode.

    Decoding token by token breaks words that tokenizers join (leading spaces, multi-byte UTF-8
    split over tokens), so each step decodes a short window and emits only what it added; a window
    that ends in an incomplete character (U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character) at the end of the sequence."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


class StopChecker:
    """Finds stop strings in incrementally decoded text.

    :meth:`push` returns the text that is safe to send: it holds back a tail that could still grow
    into a stop string, and when a stop string appears it returns only the text before it (the
    stop string itself is never sent, as in the OpenAI API).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.pending = ""

    def _held_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stop), default=1) - 1
        for size in range(min(longest, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0

    def push(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return ``(text to send, stopped)``."""
        if not self.stop:
            return text, False
        buffer = self.pending + text
        hits = [i for i in (buffer.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.pending = ""
            return buffer[: min(hits)], True
        held = self._held_tail(buffer)
        self.pending = buffer[len(buffer) - held :] if held else ""
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        """The held-back text, sent when the sequence ends for another reason."""
        text, self.pending = self.pending, ""
        return text
