"""Sampling, incremental detokenization and stop handling: small pure pieces the scheduler composes.

:func:`sample_tokens` picks a whole batch's next tokens on the model's device (greedy, temperature,
min-p, top-k, top-p) without a host sync, so it runs inside the decode step's CUDA graph. Its randomness is a hash
of (request seed, draw index, token id), not a generator's stream: a seeded request samples the same
tokens whatever else shares its batch, and nothing carries state from one iteration to the next.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vexpert_runtime.serve.step import SamplingSpec

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (dividing by ~0 only overflows)
_DETOKENIZE_CONTEXT = 6  # prompt tokens decoded before the first new one, so leading spaces come out right


_MASK32 = 0xFFFFFFFF


def engine_seeds(seed: int | None, rank: int) -> random.Random | None:
    """The seeds one rank gives requests that bring none, under ``vexpert serve --seed`` (vLLM's engine seed): a
    stream of its own per rank — two ranks of one seed must not hand identical prompts identical samples — that
    repeats from the start after every restart. ``None`` (no ``--seed``): no stream, fresh entropy per request."""
    return None if seed is None else random.Random(f"vexpert-serve/{seed}/{rank}")  # a str seeds by its SHA-512


def request_seed(seed: int | None, engine: random.Random | None = None) -> int:
    """The seed a request samples with: its own (reduced to 63 bits), else the next of the rank's ``engine`` stream
    (:func:`engine_seeds`), else fresh entropy."""
    if seed is not None:
        return seed % 2**63
    return engine.getrandbits(63) if engine is not None else secrets.randbits(63)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2³²). The products
    wrap modulo 2⁶⁴; their low 32 bits are what the 32-bit hash keeps."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, draw: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 numbers, a pure function of (seed [B], draw [B], token [B, V]) → [B, V]."""
    lo, hi = (seed & _MASK32).unsqueeze(1), ((seed >> 32) & _MASK32).unsqueeze(1)
    x = _mix32(lo ^ _mix32(hi ^ _mix32((draw.unsqueeze(1) * 0x9E3779B1 + 0x7F4A7C15) & _MASK32)))
    x = _mix32(x ^ ((token * 0x27D4EB2F + 0x165667B1) & _MASK32))
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)


def truncates(spec: SamplingSpec) -> bool:
    """Whether ``spec`` draws from fewer tokens than the whole vocabulary (min-p, top-k or top-p on a
    sampled row): such a batch sorts the vocabulary (a CUDA graph of its own; the others skip it)."""
    return spec.temperature >= GREEDY_BELOW and (spec.top_p < 1.0 or spec.top_k > 0 or spec.min_p > 0.0)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  min_p: torch.Tensor, seed: torch.Tensor, draw: torch.Tensor, truncate: bool = True) -> torch.Tensor:
    """Next tokens [B] int64 from logits [B, V]: rows with temperature < :data:`GREEDY_BELOW` take the
    argmax (ties: the lowest id, as ``torch.argmax`` and HF ``generate``); the others sample from
    p = softmax(logits / temperature) restricted as vLLM's sampler does, in its order: min-p (tokens with
    p ≥ min_p · max p), then top-k (the k most likely), then top-p over what is left, renormalised (the
    smallest most-likely set whose mass reaches ``top_p``: a token stays while the mass ranked above it
    is < top_p; the most likely always stays) — by an exponential race over :func:`uniform_noise`
    (argmax of p / −log u is a draw from p).

    temperature, top_p, min_p: [B] float32; top_k: [B] int64 (0: off); seed, draw: [B] int64 (see
    :class:`~.step.SamplingSpec`). ``truncate=False`` (no row restricted: :func:`truncates`) skips the
    sort. No host sync: graph-capturable.
    """
    greedy_rows = temperature < GREEDY_BELOW
    best = torch.argmax(logits, dim=-1)
    scaled = logits.float() / torch.where(greedy_rows, torch.ones_like(temperature), temperature).unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)
    if truncate:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
        keep = (sorted_probs >= min_p.unsqueeze(1) * sorted_probs[:, :1]) & (
            (rank < top_k.unsqueeze(1)) | (top_k.unsqueeze(1) <= 0))
        kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        before = (torch.cumsum(kept, dim=-1) - kept) / kept.sum(dim=-1, keepdim=True)
        keep &= (before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
        keep[:, 0] = True
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        race = sorted_probs / -torch.log(uniform_noise(seed, draw, order))
        sampled = order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    else:
        token = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
        sampled = (probs / -torch.log(uniform_noise(seed, draw, token))).argmax(dim=-1)
    return torch.where(greedy_rows, best, sampled)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the model's distribution — the log-softmax of the raw logits [S, V], before
    temperature and truncation (vLLM's default ``raw_logprobs``) — of the sampled ``ids`` [S] → [S]
    float32, and the ``k`` most likely tokens → ids [S, k] int64 and log-probabilities [S, k] float32,
    most likely first (see :class:`~.step.StepLogprobs`). No host sync: graph-capturable."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_logprobs, top_ids = torch.topk(logp, k, dim=-1)
    return logp.gather(1, ids.unsqueeze(1)).squeeze(1), top_ids, top_logprobs


def token_ranks(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's token ``ids`` [S] rank in logits [S, V] → [S] int64: how many tokens are at least as likely
    (vLLM's rank: 1 is the most likely, ties share the larger rank)."""
    logits = logits.float()
    return (logits >= logits.gather(1, ids.unsqueeze(1))).sum(dim=-1)


def sampling_tensors(specs: Sequence[SamplingSpec], device: torch.device | str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """:func:`sample_tokens`' arguments after the logits, for ``specs`` (one per row)."""
    temperature = torch.tensor([s.temperature for s in specs], dtype=torch.float32)
    top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32)
    top_k = torch.tensor([s.top_k for s in specs], dtype=torch.int64)
    min_p = torch.tensor([s.min_p for s in specs], dtype=torch.float32)
    seed = torch.tensor([s.seed for s in specs], dtype=torch.int64)
    draw = torch.tensor([s.draw for s in specs], dtype=torch.int64)
    return (temperature.to(device), top_p.to(device), top_k.to(device), min_p.to(device), seed.to(device),
            draw.to(device), any(truncates(s) for s in specs))


def eos_token_ids(tokenizer: Any, extra: Iterable[int] = ()) -> frozenset[int]:
    """The ids that end generation: the tokenizer's EOS plus ``extra`` (e.g. the generation config's)."""
    ids = set(extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def fast_decoder(tokenizer: Any) -> Any:
    """The Rust ``tokenizers`` decode behind a transformers fast tokenizer, where calling it directly
    gives what ``tokenizer.decode`` gives (no post-hoc clean-up of spaces): ~8× less time per call,
    and the rank decodes twice per generated token. None: use ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas whose concatenation equals the full decode.

    Decoding token by token breaks words that tokenizers join (leading spaces, multi-byte UTF-8
    split over tokens), so each step decodes a short window and emits only what it added; a window
    that ends in an incomplete character (U+FFFD) waits for the next token. With a fast tokenizer
    that is one call into ``tokenizers``' own incremental decoder (``DecodeStream``, as vLLM uses)
    per token — ~3× less host time than the two window decodes, and the serving loop detokenizes
    every sequence of every iteration; other tokenizers (or a stream that gives up) decode windows.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        """``skip_special_tokens`` False: special tokens are text too (a tool-call format's markers)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast = fast_decoder(tokenizer)
        self.ids: list[int] = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._stream = _decode_stream(self.ids, skip_special_tokens) if self._fast is not None else None
        # (a transformers property: looked up once, not per token)
        self._backend = tokenizer.backend_tokenizer if self._stream is not None else None

    def _decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return str(self._fast(list(ids), skip_special_tokens=self.skip_special_tokens))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens))

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:  # the stream's own consistency check failed: decode windows from here on
                self._stream = None
            else:
                if text:
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text or ""
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


def _decode_stream(context: list[int], skip_special_tokens: bool = True) -> Any:
    """A ``tokenizers`` ``DecodeStream`` primed with ``context`` (the prompt's last tokens), or None
    where this ``tokenizers`` has none."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    try:
        return DecodeStream(context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # a tokenizers without the ids argument: no priming, so no stream
        return None


class StopChecker:
    """Finds stop strings in incrementally decoded text.

    :meth:`push` returns the text that is safe to send: it holds back a tail that could still grow
    into a stop string, and when a stop string appears it returns only the text before it (the
    stop string itself is not sent, as in the OpenAI API; ``include`` — vLLM's
    ``include_stop_str_in_output`` — sends it too). Of stop strings found together, the one that starts
    first ends the text (the first listed, where two start at the same place).
    """

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include = include
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text (vLLM's ``stop_reason``)

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
        hits = [(i, n) for n, i in enumerate(buffer.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.pending = ""
            at, which = min(hits)
            self.matched = self.stop[which]
            return buffer[: at + (len(self.stop[which]) if self.include else 0)], True
        held = self._held_tail(buffer)
        self.pending = buffer[len(buffer) - held :] if held else ""
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        """The held-back text, sent when the sequence ends for another reason."""
        text, self.pending = self.pending, ""
        return text
