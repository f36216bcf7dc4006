"""Plain data between the API and the ranks: requests in, events out, load reports, refusals.

Everything here pickles (dataclasses of builtins), so a multi-process dispatcher can send a
:class:`GenerationRequest` to a worker over a ``multiprocessing`` queue and get its :class:`Event`\\ s
back the same way; the in-process dispatcher passes the same objects through a thread-safe callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import starmap
from operator import attrgetter

# finish reasons: "stop" (EOS or a stop string), "length" (max_tokens or the context), "abort" (shut down
# or cancelled), "error" (the model or the sampler failed; ``Event.error`` says why).
FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_LOGPROBS = 20  # the most likely tokens a step reports with a sampled token's log-probability (vLLM's default cap)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``min_p`` 0 keep every token; ``seed`` None draws a
    fresh seed (not reproducible); ``max_tokens`` is already resolved by the API (never more than the
    context leaves); ``stop_token_ids`` end the sequence as EOS does, also with ``ignore_eos``;
    ``logprobs`` k (≤ :data:`MAX_LOGPROBS`): each sampled token's log-probability and the k most
    likely tokens' (:class:`TokenLogprobs`), None: none; ``prompt_logprobs`` k: the same for every prompt
    token after the first (given the tokens before it); the penalties are vLLM's (1, 0, 0: off);
    ``logit_bias``: (token id, bias) added to those tokens' logits (OpenAI's), sorted by id; ``min_tokens``:
    neither EOS nor a stop token id is sampled, nor a stop string looked for, before that many tokens (vLLM's);
    ``skip_special_tokens`` False: the text keeps the special tokens the model writes (not EOS / stop ids, which end it);
    ``include_stop_str``: the stop string that ended the text is part of it (vLLM's ``include_stop_str_in_output``);
    ``grammar``: the output follows this llguidance grammar (:mod:`.structured_output`, compiled by the API);
    ``bad_words``: token sequences the output never completes — a one-token word is never drawn, a longer one's last
    token not where the output ends with the rest (vLLM's ``bad_words``, tokenized by the API);
    ``allowed_token_ids``: the only tokens it may draw, sorted (vLLM's; (): all); ``reasoning_end``: a reply that
    starts in its reasoning — the token that ends it: the tokens before it are reasoning tokens (the usage's), and the
    grammar constrains only what follows it (vLLM's ``reasoning_ended``); None: the reply is all content;
    ``thinking_budget`` (with ``reasoning_end``): after that many reasoning tokens the next one is ``reasoning_end``
    (vLLM's ``thinking_token_budget``).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    grammar: str | None = None
    return_token_ids: bool = False  # vLLM's: each event carries the output ids it accounts for
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's, as token ids: a word's last token never completes it
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: every other token's logit is −inf
    reasoning_end: int | None = None  # a reasoning reply's end-of-reasoning token (the grammar waits for it)
    cache_salt: str | None = None  # vLLM's: its prompt shares cached KV blocks only with prompts of the same salt
    thinking_budget: int | None = None  # vLLM's thinking_token_budget: reasoning tokens before reasoning_end is forced

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def holds_row(self) -> bool:
        """Whether the model keeps a row of per-sequence tables for it (penalties, a logit bias, min_tokens, a
        grammar — its bias row masks the tokens the grammar does not allow —, bad words, allowed token ids, a thinking
        budget: its row forces the end of the reasoning)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None
                or bool(self.bad_words) or bool(self.allowed_token_ids) or self.thinking_budget is not None)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token with its log-probability under the model's distribution (before temperature
    and truncation) and the k most likely tokens' (``top``: (token id, log-probability), most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # a prompt token's rank (vLLM's ``prompt_logprobs``; 1: the most likely), when computed


@dataclass(frozen=True)
class GenerationRequest:
    """One tokenized request as a rank's scheduler receives it. ``reply_to``: the API server that
    sent it (its events go to that server's queue; ``vexpert serve --api-servers``); ``priority``: vLLM's (lower
    first; its order only under ``--scheduling-policy priority``, :mod:`.waiting_queue`)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    reply_to: int = 0
    priority: int = 0


@dataclass(frozen=True, slots=True)
class EventLogprobs:
    """The log-probabilities an :class:`Event` carries: ``output``, one per token it accounts for, in order;
    ``prompt`` (in the request's first event with a token, when it asked) the prompt's tokens' after the first."""

    output: tuple[TokenLogprobs, ...] = ()
    prompt: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class UsageDetails:
    """A finished request's usage beyond its counts (OpenAI's ``prompt_tokens_details`` / ``completion_tokens_details``):
    prompt tokens its prefill took from the prefix cache (None: not reported — neither prefix caching nor a reasoning
    parser), and output tokens of its reasoning (None: the reply was not split into reasoning and content); and its
    time on the rank in seconds, as vLLM's ``request_{queue,prefill,decode}_time_seconds`` measure it: waiting before
    its first admission, from then to its first token, from that to its last (None: it produced no token); and what
    stopped it where a request's own stop string or stop token did (vLLM's ``stop_reason``)."""

    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    queue_seconds: float = 0.0
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string, or stop_token_ids token, that ended it (else None)


@dataclass(slots=True)  # one per sequence per iteration: a slotted dataclass (made 5× faster than a frozen one)
class Event:
    """What a request produced in one iteration.

    ``text`` is the newly decoded text (may be empty: held back as a possible stop-string prefix or
    an incomplete UTF-8 character); ``new_tokens`` how many tokens this event accounts for, and
    ``logprobs`` their log-probabilities when the request asked (None otherwise: one field, pickled as
    one byte in the steady state).
    ``finish_reason`` is set on the request's last event only, together with the final usage.
    """

    request_id: str
    text: str = ""
    new_tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: EventLogprobs | None = None
    usage_details: UsageDetails | None = None  # the last event's (None on the others)

    @property
    def finished(self) -> bool:
        """Whether this is the request's last event."""
        return self.finish_reason is not None


@dataclass(slots=True)
class EventWithTokenIds(Event):
    """An event of a request that asks for its token ids (vLLM's ``return_token_ids``): the output ids produced
    since its previous event — the one that ended it too, in the last. (A class of its own: a field on every event
    would cost each one a slot to pickle.)"""

    token_ids: tuple[int, ...] = ()


def with_token_ids(event: Event, token_ids: tuple[int, ...]) -> EventWithTokenIds:
    """``event`` carrying ``token_ids``."""
    return EventWithTokenIds(event.request_id, event.text, event.new_tokens, event.finish_reason, event.prompt_tokens,
                             event.completion_tokens, event.error, event.logprobs, event.usage_details, token_ids)


@dataclass(frozen=True)
class RankLoad:
    """A rank's load, for a least-loaded dispatcher and the gauges."""

    running: int = 0
    waiting: int = 0
    kv_tokens_budget: int = 0
    kv_tokens_used: int = 0
    kv_blocks_total: int = 0  # usable blocks of the rank's paged KV cache
    kv_blocks_used: int = 0  # blocks held by running sequences
    kv_cache_bytes: int = 0  # device memory of the rank's KV cache
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (over the rank's life)
    prefix_hit_tokens: int = 0  # of them, served from cached blocks
    preemptions: int = 0  # sequences preempted for KV blocks (over the rank's life)

    @property
    def score(self) -> tuple[int, int]:
        """Sort key of a least-loaded choice: queued requests first, then KV blocks held."""
        return (self.running + self.waiting, self.kv_blocks_used)


class ServeRefusal(Exception):
    """A request refused before it started: the API answers ``status`` with ``Retry-After``.

    429 when the waiting queue is full (overload), 503 while the server shuts down. Pickles (its
    ``args`` are its fields), so a worker process can send one back.
    """

    def __init__(self, status: int, message: str, retry_after_s: int = 1, code: str = "overloaded") -> None:
        super().__init__(status, message, retry_after_s, code)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code

    def __str__(self) -> str:
        return self.message


def overloaded(max_waiting: int) -> ServeRefusal:
    """The refusal for a full waiting queue."""
    return ServeRefusal(429, f"server overloaded: {max_waiting} requests already waiting; retry later", 1, "overloaded")


def shutting_down() -> ServeRefusal:
    """The refusal while the server drains for shutdown."""
    return ServeRefusal(503, "server is shutting down; retry on another replica", 5, "shutting_down")


# ---- between the API process and the ranks (multi-rank servers; all plain picklable data) -------


@dataclass(frozen=True)
class CancelRequest:
    """API → rank: the client went away."""

    request_id: str


@dataclass(frozen=True)
class StopAccepting:
    """API → every rank: the server drains (new requests are refused already by the API)."""


@dataclass(frozen=True)
class AbortAll:
    """API → every rank: the drain timed out; finish what runs with ``finish_reason="abort"``."""

    message: str


@dataclass(frozen=True)
class RankEvent:
    """Rank → API: what one iteration produced, in one message — the events of its requests (one
    message per iteration, not one per token: at hundreds of streams the queue's per-message cost
    would dominate), the requests it queued since the last message (``accepted``, handled before the
    events) and its load when that changed (``load``, else None; an idle rank sends its load alone). One message, not three: each one
    wakes the API process's reader thread, which then waits for the GIL behind a busy event loop."""

    rank: int
    events: tuple[Event, ...]
    accepted: tuple[str, ...] = ()
    load: RankLoad | None = None

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Pickled as plain tuples (one per Event, its fields in order), not as Event objects: a
        # slotted dataclass pickles its state field by field, ~3.5 µs an event — 0.9 ms an
        # iteration at 256 streams on the rank's thread (the queue's feeder shares its GIL). The
        # token ids of the events that carry them (EventWithTokenIds) go beside the rows, by position;
        # the scan for them runs only where the batch holds one (a type test in C, ~1 µs at 256).
        ids = tuple((i, e.token_ids) for i, e in enumerate(self.events) if type(e) is EventWithTokenIds) \
            if EventWithTokenIds in map(type, self.events) else ()
        return _rank_event_from_rows, (self.rank, tuple(map(_event_row, self.events)), self.accepted, self.load, ids)


_event_row = attrgetter(*Event.__dataclass_fields__)


def _rank_event_from_rows(rank: int, rows: tuple[tuple[object, ...], ...], accepted: tuple[str, ...] = (),
                          load: RankLoad | None = None, ids: tuple[tuple[int, tuple[int, ...]], ...] = ()
                          ) -> RankEvent:
    """Unpickle a :class:`RankEvent` (see ``RankEvent.__reduce__``)."""
    events = tuple(starmap(Event, rows))
    if ids:
        listed = list(events)
        for index, token_ids in ids:
            listed[index] = with_token_ids(listed[index], token_ids)
        events = tuple(listed)
    return RankEvent(rank, events, accepted, load)

