"""The OpenAI-compatible HTTP server (aiohttp), one port.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, OpenAI's ``POST /v1/responses`` (and ``GET
/v1/responses/{id}`` where ``--responses-store`` keeps them: :mod:`.responses_api`) (all stream as SSE with
``"stream": true``: ``data: {chunk}\\n\\n`` … ``data: [DONE]\\n\\n``), ``GET /v1/models``,
``GET /health`` (200 ready / 503 not: starting, shutting down, rank loop dead), ``GET /metrics``, and vLLM's
``POST /tokenize`` (a ``prompt`` or ``messages``: the ids the generation endpoints would run), ``POST /detokenize``
and ``GET /version``.

Every error is an OpenAI error object, never a traceback: 400 invalid JSON / parameters (naming the
field) / prompt over the context, 401 a missing or wrong API key, 404 unknown model or route, 405 wrong
method, 413 a body over the limit, 415 a Content-Type other than JSON, 429 queue full and 503 shutting
down (both with ``Retry-After``), 500 a failed model step. The server keeps serving. Errors are this
module's own text naming the field and the fix; a dependency's exception text goes to the log only.

Bad input is refused cheaply and before it can hold the event loop: the body is limited by the
context (:func:`body_limit`: a prompt cannot hold more than ``_BYTES_PER_TOKEN`` bytes per token of
the context), checked from ``Content-Length`` before it is read; JSON nested deeper than
``MAX_JSON_DEPTH`` is refused by a scan before it is parsed (``json`` recurses); strings that are not
Unicode text (lone surrogates) are refused naming their field; a prompt longer than
``INLINE_TOKENIZE_CHARS`` is tokenized on a thread (shorter ones on the loop, with its own tokenizer
copy: a hand-off to a thread costs more than they do; :mod:`.prompts`). With :attr:`ApiConfig.api_key`, ``/v1/*`` needs ``Authorization: Bearer <key>``
and so do ``/tokenize`` and ``/detokenize`` (``/health``, ``/metrics`` and ``/version`` stay open); a connection has :attr:`ApiConfig.header_timeout_s` to send
its request's headers (aiohttp's keep-alive timer, which also runs from the connection's start).

Metrics (own registry, all prefixed ``vexpert_serve_``): ``requests_total{endpoint,status}``
(HTTP status of the generation endpoints), ``request_finish_total{reason}``,
``time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``request_duration_seconds``
(from the request's arrival: reading, tokenizing and queueing included; these four per choice: a request
of ``n`` choices is n sequences), ``prompt_tokens_total`` (a request's prompt once), ``generated_tokens_total``,
``requests_running``, ``requests_waiting``, ``kv_cache_usage_ratio`` (KV blocks held / blocks, summed
over ranks — what admission waits on), ``kv_cache_tokens`` (held), ``preemptions`` (sequences preempted
for KV blocks, the ranks' total), with ``--prefix-caching``, ``prefix_cache_queried_tokens`` /
``prefix_cache_hit_tokens`` (the ranks' totals), and the API process's own ``api_gc_seconds_total{generation}``
(time in Python's cyclic collector) and ``api_gc_frozen_objects`` (its startup heap, frozen once it
listens: :mod:`vexpert_runtime.gc_heap`).

The API tokenizes (prompt, chat template) and checks lengths itself, so a multi-rank dispatcher
sends ranks token ids only. Give it its own tokenizer instance: the rank's scheduler decodes with
another one on its thread (a Hugging Face fast tokenizer is not safe to share across threads).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError

from vexpert_runtime import __version__
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.gc_heap import GcClock, freeze_heap
from vexpert_runtime.ports import listen_error
from vexpert_runtime.serve import messages_api as ma
from vexpert_runtime.serve import openai_api as oa
from vexpert_runtime.serve import responses_api as ra
from vexpert_runtime.serve.api_errors import ApiError, refusal_error
from vexpert_runtime.serve.cors import CorsPolicy
from vexpert_runtime.serve.cors import install as install_cors
from vexpert_runtime.serve.dispatcher import Dispatcher
from vexpert_runtime.serve.events import (
    Event,
    EventWithTokenIds,
    GenerationRequest,
    RankLoad,
    SamplingParams,
    ServeRefusal,
    TokenLogprobs,
    UsageDetails,
    shutting_down,
)
from vexpert_runtime.serve.histogram import CountedHistogram
from vexpert_runtime.serve.metrics_share import MetricsShare
from vexpert_runtime.serve.prompts import PromptEncoder, special_tokens
from vexpert_runtime.serve.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    ReplyReasoning,
    split_reasoning,
)
from vexpert_runtime.serve.tool_call_stream import CallDelta, ToolCallStream
from vexpert_runtime.serve.tool_calls import (
    KEEPS_SPECIAL_TOKENS,
    TYPED_PARSERS,
    ToolCall,
    ToolFormat,
    TypedToolFormat,
    calls_finish_reason,
    parse_tool_calls,
)
from vexpert_runtime.serve.vllm_metrics import VllmSeries

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_PHASE_BUCKETS = (*_LATENCY_BUCKETS, 60.0, 120.0, 300.0)  # a request's queue / prefill / decode time
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_BYTES_PER_TOKEN = 16  # a token id in JSON is ≤ 7 bytes; a token of text rarely over 16 (escapes included)
_BODY_MARGIN_BYTES = 64 * 1024  # the other fields, chat framing
_BODY_CAP_BYTES = 4 * 1024 * 1024
_PARSE_ON_LOOP_BYTES = 64 * 1024  # larger bodies are parsed on a thread
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_Body = TypeVar("_Body", bound=BaseModel)
_Result = TypeVar("_Result")
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# vLLM's, outside /v1 and open there; here behind the API key like /v1 (each runs the tokenizer for anyone who asks)
_TOKENIZER_ENDPOINTS = ("/tokenize", "/detokenize")


@dataclass(frozen=True)
class ApiConfig:
    """What the API needs to know about the served model."""

    model_name: str
    max_context: int
    vocab_size: int
    drain_timeout_s: float = 30.0
    api_key: str | None = None  # ``/v1/*`` needs ``Authorization: Bearer <api_key>``
    header_timeout_s: float = 15.0  # to send a request's headers, and a keep-alive connection's idle time
    max_body_bytes: int | None = None  # None: :func:`body_limit` of the context
    sampling_defaults: oa.SamplingDefaults = field(default_factory=oa.SamplingDefaults)  # for fields a request leaves out
    tool_call_parser: str | None = None  # how chat replies' tool calls are read (tool_calls.PARSERS); None: not
    tokens_as_ids: bool = False  # logprobs name tokens by id where a request does not say (vLLM's server flag)
    reasoning_parser: str | None = None  # how chat replies' reasoning is told from their content (reasoning.py)
    chat_template: str | None = None  # --chat-template: the Jinja template chats render with (None: the model's)
    aliases: tuple[str, ...] = ()  # other names requests may give the model (--served-model-name's after the first)
    responses_store: int = 0  # the last N stored Responses API responses kept (--responses-store; 0: none)
    scheduling_policy: str = "fcfs"  # the ranks' (--scheduling-policy): a request's priority ≠ 0 needs "priority"
    log_requests: bool = False  # one INFO line per generation request as it is queued (--enable-log-requests, vLLM's)
    max_log_len: int | None = None  # prompt token ids per logged request at most (--max-log-len; None: all)
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # which browser origins may call it (vLLM's default: any)
    log_stats_s: float | None = 10.0  # seconds between StatsLog lines (None: --disable-log-stats)

    @property
    def body_limit(self) -> int:
        return self.max_body_bytes if self.max_body_bytes is not None else body_limit(self.max_context)


def body_limit(max_context: int) -> int:
    """The largest request body a context of ``max_context`` tokens can need (capped at 4 MiB)."""
    return min(max_context * _BYTES_PER_TOKEN + _BODY_MARGIN_BYTES, _BODY_CAP_BYTES)


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``raw`` nests arrays / objects deeper than ``limit`` (brackets inside strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for char in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        if char in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def not_text(value: Any, path: str = "") -> str | None:
    """The path (``messages.0.content``) of the first string in ``value`` that is not Unicode text (a lone
    surrogate, which JSON's ``\\ud800`` escapes can produce), or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and not_text(key) is not None:
            return path or "body"
        found = not_text(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of text strings, or a 400 (run on a thread for large bodies)."""
    if json_too_deep(raw):
        raise ApiError(400, f"the body nests arrays / objects deeper than {MAX_JSON_DEPTH} levels; send a flat "
                       "OpenAI request", code="invalid_json")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON (line {exc.lineno}, column {exc.colno}); send a JSON "
                       "object", code="invalid_json") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text; send JSON encoded as UTF-8", code="invalid_json") from None
    except RecursionError:  # json_too_deep should have caught it
        raise ApiError(400, "the body nests too deeply; send a flat OpenAI request", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    bad = not_text(body)
    if bad is not None:
        raise ApiError(400, f"{bad}: contains a lone surrogate (\\ud800–\\udfff without its pair), which is not "
                       "text; send valid Unicode", param=bad, code="invalid_value")
    return body


def _bad_http_response(status: int, exc: BaseException | None) -> web.Response:
    """aiohttp's answer to a request it could not parse (a header over 8 KB, a bad request line), as an
    OpenAI error object instead of plain text."""
    if status >= 500:
        body = oa.error_body("internal server error", "server_error", code="internal_error")
    elif isinstance(exc, LineTooLong):
        body = oa.error_body("a request line or header is too long (the limit is 8190 bytes each); send shorter "
                             "headers", code="header_too_large")
    else:
        body = oa.error_body("malformed HTTP request; send a valid HTTP/1.1 request", code="bad_request")
    response = web.json_response(body, status=status)
    response.force_close()
    return response


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering unparseable requests with OpenAI error objects."""

    __slots__ = ()

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response was already started
        return _bad_http_response(status, exc)


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # only __call__ differs: it builds the handler above
        return server


class _GcSeries(Collector):
    """The API process's time in Python's cyclic collector and its frozen startup heap, read at collection."""

    def __init__(self, clock: GcClock) -> None:
        self.clock = clock

    def collect(self) -> Any:
        seconds = CounterMetricFamily("vexpert_serve_api_gc_seconds", "Seconds the API process spent in Python's "
                                      "cyclic garbage collector", labels=["generation"])
        for generation, total in enumerate(self.clock.totals()):
            seconds.add_metric([str(generation)], total)
        yield seconds
        yield GaugeMetricFamily("vexpert_serve_api_gc_frozen_objects", "Objects of the API process's startup heap "
                                "frozen out of the collector's reach", value=gc.get_freeze_count())


class ServeMetrics:
    """The server's Prometheus series (see the module docstring) in ``registry``."""

    def __init__(self, registry: CollectorRegistry, gc_clock: GcClock | None = None) -> None:
        self.registry = registry
        reg = registry
        if gc_clock is not None:
            reg.register(_GcSeries(gc_clock))
        self.requests = Counter(
            "vexpert_serve_requests", "Generation requests by endpoint and HTTP status", ["endpoint", "status"], registry=reg
        )
        self.finished = Counter("vexpert_serve_request_finish", "Finished requests by finish reason", ["reason"], registry=reg)
        self.ttft = CountedHistogram(
            "vexpert_serve_time_to_first_token_seconds", "Request arrival to first token", _LATENCY_BUCKETS, reg
        )
        self.itl = CountedHistogram(
            "vexpert_serve_inter_token_latency_seconds", "Time between a request's tokens", _LATENCY_BUCKETS, reg
        )
        self.duration = CountedHistogram(
            "vexpert_serve_request_duration_seconds", "Request arrival to last token", _DURATION_BUCKETS, reg
        )
        # a finished request's time on its rank (the rank's clock: queued, to its first token, to its last; vLLM's)
        self.queue_time = CountedHistogram("vexpert_serve_request_queue_time_seconds",
                                           "Time a request waited on its rank before its first admission", _PHASE_BUCKETS, reg)
        self.prefill_time = CountedHistogram("vexpert_serve_request_prefill_time_seconds",
                                             "A request's first admission to its first token", _PHASE_BUCKETS, reg)
        self.decode_time = CountedHistogram("vexpert_serve_request_decode_time_seconds",
                                            "A request's first token to its last", _PHASE_BUCKETS, reg)
        self.inference_time = CountedHistogram("vexpert_serve_request_inference_time_seconds",
                                               "A request's first admission to its last token", _PHASE_BUCKETS, reg)
        self.request_prompt_tokens = CountedHistogram("vexpert_serve_request_prompt_tokens",
                                                      "Prompt tokens per finished request", _TOKEN_BUCKETS, reg)
        self.request_generation_tokens = CountedHistogram("vexpert_serve_request_generation_tokens",
                                                          "Generated tokens per finished sequence", _TOKEN_BUCKETS, reg)
        self.prompt_tokens = Counter("vexpert_serve_prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter("vexpert_serve_generated_tokens", "Tokens generated", registry=reg)
        self.running = Gauge("vexpert_serve_requests_running", "Requests in the ranks' batches", registry=reg)
        self.waiting = Gauge("vexpert_serve_requests_waiting", "Requests queued for admission", registry=reg)
        self.kv_usage = Gauge(
            "vexpert_serve_kv_cache_usage_ratio", "Paged KV-cache blocks held by sequences / blocks", registry=reg
        )
        self.kv_tokens = Gauge("vexpert_serve_kv_cache_tokens", "KV-cache tokens held by running sequences", registry=reg)
        self.kv_blocks = Gauge("vexpert_serve_kv_cache_blocks", "Paged KV-cache blocks of all ranks", registry=reg)
        self.kv_blocks_used = Gauge("vexpert_serve_kv_cache_blocks_used", "KV-cache blocks held by running sequences",
                                    registry=reg)
        self.kv_bytes = Gauge("vexpert_serve_kv_cache_bytes", "Device memory of the ranks' KV caches", registry=reg)
        # the ranks' own running totals (every API server reads the same: gauges, not summed across servers)
        self.prefix_query_tokens = Gauge("vexpert_serve_prefix_cache_queried_tokens",
                                         "Prompt tokens looked up in the prefix cache since the ranks started "
                                         "(--prefix-caching)", registry=reg)
        self.prefix_hit_tokens = Gauge("vexpert_serve_prefix_cache_hit_tokens",
                                       "Prompt tokens served from cached KV blocks since the ranks started", registry=reg)
        self.preemptions = Gauge("vexpert_serve_preemptions", "Sequences preempted since the ranks started (KV cache "
                                 "full: blocks freed, recomputed when re-admitted)", registry=reg)

    def observe_phases(self, details: UsageDetails | None) -> None:
        """A finished sequence's time on its rank (its last event's details)."""
        if details is None:  # (an event the API made itself: a refusal or a lost rank)
            return
        self.queue_time.observe(details.queue_seconds)
        if details.prefill_seconds is not None and details.decode_seconds is not None:
            self.prefill_time.observe(details.prefill_seconds)
            self.decode_time.observe(details.decode_seconds)
            self.inference_time.observe(details.prefill_seconds + details.decode_seconds)

    def refresh(self, loads: list[RankLoad]) -> None:
        """Set the gauges from the ranks' loads (at scrape time)."""
        self.running.set(sum(load.running for load in loads))
        self.waiting.set(sum(load.waiting for load in loads))
        blocks = sum(load.kv_blocks_total for load in loads)
        used = sum(load.kv_blocks_used for load in loads)
        self.kv_usage.set(used / blocks if blocks else 0.0)
        self.kv_tokens.set(sum(load.kv_tokens_used for load in loads))
        self.kv_blocks.set(blocks)
        self.kv_blocks_used.set(used)
        self.preemptions.set(sum(load.preemptions for load in loads))
        self.kv_bytes.set(sum(load.kv_cache_bytes for load in loads))
        self.prefix_query_tokens.set(sum(load.prefix_query_tokens for load in loads))
        self.prefix_hit_tokens.set(sum(load.prefix_hit_tokens for load in loads))


# request key: time.monotonic() when the middleware first saw the request (typed keys from aiohttp 3.12)
_ARRIVED: Any = web.RequestKey("vexpert_arrived", float) if hasattr(web, "RequestKey") else "vexpert_arrived"


class _RequestTimer:
    """Observes one choice's latencies and token counts as its event batches arrive (a request of
    ``n`` choices: n sequences, n timers; its prompt counted once, by ``counts_prompt``'s); ``start``:
    the request's arrival (before its body is read, parsed and tokenized and a rank accepts it)."""

    def __init__(self, metrics: ServeMetrics, start: float, counts_prompt: bool = True) -> None:
        self.metrics = metrics
        self.start = start
        self.counts_prompt = counts_prompt
        self.last: float | None = None

    def observe(self, batch: Sequence[Event]) -> None:
        """A batch's n tokens reached the API together: the first after the gap since the last
        token (or the arrival: the TTFT), the other n - 1 with no gap."""
        now = time.monotonic()
        tokens = sum(event.new_tokens for event in batch)
        if tokens:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last)
            self.metrics.itl.observe(0.0, tokens - 1)
            self.last = now
            self.metrics.generation_tokens.inc(tokens)
        last = batch[-1]
        if last.finished:
            self.metrics.duration.observe(now - self.start)
            if self.counts_prompt:
                self.metrics.prompt_tokens.inc(last.prompt_tokens)
                self.metrics.request_prompt_tokens.observe(last.prompt_tokens)
            self.metrics.request_generation_tokens.observe(last.completion_tokens)
            self.metrics.finished.labels(last.finish_reason).inc()
            self.metrics.observe_phases(last.usage_details)


def _failed(event: Event) -> ApiError | None:
    """The error an aborted or failed request ends with (None for stop / length)."""
    if event.finish_reason == "abort":
        return ApiError(503, f"request aborted: {event.error or 'server shutting down'}", "server_error", code="aborted")
    if event.finish_reason == "error":
        return ApiError(500, f"generation failed: {event.error or 'unknown error'}", "server_error", code="internal_error")
    return None


def _sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


_TEXT_MARK = "\uf8ffvexpert-text\uf8ff"  # stands for a chunk's text in :func:`_text_frame`
_TEXT_MARK_JSON = json.dumps(_TEXT_MARK, ensure_ascii=False)


def _text_frame(payload: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """The bytes of ``payload``'s server-sent event before and after its text, which it holds as
    :data:`_TEXT_MARK` — then ``before + json.dumps(text) + after`` is the event of the same chunk with
    that text, as :func:`_sse` would write it (a stream's chunks differ only in their text: JSON-encoding
    the whole chunk each time was ~3 µs of the ~4 a chunk took). None if the mark shows up elsewhere."""
    parts = _sse(payload).split(_TEXT_MARK_JSON.encode())
    return (parts[0], parts[1]) if len(parts) == 2 else None


def sampling_params(req: oa.CompletionRequest | oa.ChatCompletionRequest, prompt_len: int, chat: bool,
                    config: ApiConfig, bad_words: tuple[tuple[int, ...], ...] = (), reasoning_end: int | None = None,
                    in_reasoning: bool = False) -> SamplingParams:
    """A request's sampling for one of its prompts: the defaults resolved (``config.sampling_defaults``),
    the lengths checked against the context (a 400 naming the field); ``bad_words``: its bad words' ids
    (:func:`~.prompts.bad_word_ids`); ``reasoning_end``: the token ending the reply's reasoning (a reply that starts
    in it: ``in_reasoning``; None there where the marker is several tokens)."""
    limit = config.max_context
    prompt_param = "messages" if chat else "prompt"
    if prompt_len == 0:
        raise ApiError(400, f"{prompt_param}: is empty", param=prompt_param)
    if prompt_len >= limit:
        raise ApiError(400, f"{prompt_param}: {prompt_len} tokens leave no room to generate: the context is {limit} "
                       "tokens", param=prompt_param, code="context_length_exceeded")
    requested = req.requested_max_tokens()
    default = config.sampling_defaults
    if requested is not None and prompt_len + requested > limit:
        param = "max_completion_tokens" if chat and req.max_tokens is None else "max_tokens"
        raise ApiError(400, f"{param}: {requested} + the prompt's {prompt_len} tokens exceed the context of {limit} "
                       "tokens", param=param, code="context_length_exceeded")
    max_tokens = requested if requested is not None else min(limit - prompt_len, default.max_tokens or limit)
    budget = thinking_budget(req, config, in_reasoning and reasoning_end is None)
    if (req.min_tokens or 0) > max_tokens:
        raise ApiError(400, f"min_tokens: {req.min_tokens} is more than the {max_tokens} tokens this request may "
                       "generate (max_tokens, or what the context leaves)", param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=default.temperature if req.temperature is None else req.temperature,
        top_p=default.top_p if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=req.stop_strings,
        ignore_eos=req.ignore_eos,
        top_k=default.top_k if req.top_k is None else max(req.top_k, 0),
        min_p=default.min_p if req.min_p is None else float(req.min_p),
        stop_token_ids=frozenset(req.stop_token_ids or ()),
        logprobs=req.requested_logprobs(),
        prompt_logprobs=req.requested_prompt_logprobs(),
        repetition_penalty=default.repetition_penalty if req.repetition_penalty is None else float(req.repetition_penalty),
        presence_penalty=float(req.presence_penalty or 0),
        frequency_penalty=float(req.frequency_penalty or 0),
        logit_bias=req.bias_pairs(),
        min_tokens=req.min_tokens or 0,
        include_stop_str=req.include_stop_str_in_output,
        grammar=req.grammar,
        return_token_ids=req.return_token_ids,
        bad_words=bad_words,
        allowed_token_ids=tuple(sorted(set(req.allowed_token_ids or ()))),
        cache_salt=req.cache_salt,
        reasoning_end=reasoning_end,
        thinking_budget=budget if reasoning_end is not None else None,
        # a tool-call format whose markers may be special tokens needs them in the text (as vLLM's parsers ask)
        skip_special_tokens=req.skip_special_tokens and tool_format(req, config) not in KEEPS_SPECIAL_TOKENS,
    )


def thinking_budget(req: oa.CompletionRequest | oa.ChatCompletionRequest, config: ApiConfig, marker_split: bool
                    ) -> int | None:
    """A chat request's ``thinking_token_budget`` (vLLM's; None and −1: no limit); a 400 naming it where it cannot be
    honoured: no ``--reasoning-parser`` tells the reasoning from the content, or the reply's end-of-reasoning marker is
    several tokens (``marker_split``: one forced token could not end it). A reply that does not start in its reasoning
    has nothing to limit: the budget is moot there."""
    budget = getattr(req, "thinking_token_budget", None)
    if budget is None or budget == -1:
        return None
    if config.reasoning_parser is None or marker_split:
        why = ("needs a server started with --reasoning-parser (the reasoning it limits is what that parser tells from "
               "the content)" if config.reasoning_parser is None else "this model's end-of-reasoning marker is several "
               "tokens: a budget cannot force it")
        raise ApiError(400, f"thinking_token_budget: {why}; leave it out", param="thinking_token_budget")
    return int(budget)


def tool_format(req: oa.CompletionRequest | oa.ChatCompletionRequest, config: ApiConfig) -> ToolFormat | None:
    """The format to read the reply's tool calls in: a forced choice's JSON, else ``config.tool_call_parser``; None
    when the request's tools may not be called."""
    if not isinstance(req, oa.ChatCompletionRequest) or not req.calls_tools:
        return None
    if req.forced_tool_choice is not None:
        return req.forced_tool_choice
    if config.tool_call_parser in TYPED_PARSERS:  # its calls' arguments are typed by the request's tools
        assert req.tools is not None  # calls_tools
        return TypedToolFormat.of(config.tool_call_parser, [tool.model_dump(exclude_none=True) for tool in req.tools])
    return config.tool_call_parser


def _with_tool_calls(job: _Job, choice: oa.Choice) -> oa.Choice:
    """A finished chat choice with its reply's tool calls read out (finish reason "tool_calls" when the
    reply ended by itself), for a request whose tools may be called."""
    if job.tools is None or choice.text is None:
        return choice
    content, calls = parse_tool_calls(job.tools, choice.text)
    calls = calls[:1] if job.one_call else calls
    if not calls:
        return choice
    reason = calls_finish_reason(job.tools, choice.finish_reason or "stop")
    return replace(choice, text=content, finish_reason=reason, tool_calls=[call.as_json() for call in calls])


@dataclass
class _UsageCounts:
    """A response's usage, summed over its choices' last events: their output tokens; the prompt tokens the prefix
    cache served (each prompt once: its first choice's; None where the ranks report none) and the reasoning tokens
    (a reasoning parser's, else None)."""

    completion_tokens: int = 0
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None

    def add(self, job: _Job, index: int, last: Event) -> None:
        self.completion_tokens += last.completion_tokens
        details = last.usage_details
        if details is None:
            return
        if details.cached_tokens is not None and index % job.choices_per_prompt == 0:
            self.cached_tokens = (self.cached_tokens or 0) + details.cached_tokens
        if job.reasoning is not None:
            self.reasoning_tokens = (self.reasoning_tokens or 0) + (details.reasoning_tokens or 0)

    def usage(self, job: _Job) -> dict[str, Any]:
        reasoning = (self.reasoning_tokens or 0) if job.reasoning is not None else None
        return oa.usage(job.prompt_tokens, self.completion_tokens, self.cached_tokens, reasoning)


def _renamed(error: ApiError, names: dict[str, str]) -> ApiError:
    """``error`` with the field it names (its first part) renamed by ``names`` — in its message too."""
    param = str(error.body["error"].get("param") or "")
    head, dot, rest = param.partition(".")
    if head not in names:
        return error
    return ApiError(error.status, str(error).replace(head, names[head], 1), error.body["error"].get("type"),
                    names[head] + dot + rest, error.body["error"].get("code"), error.headers)


async def _response_writes(job: _Job, store: ra.ResponseStore | None, token_texts: _TokenTexts
                           ) -> AsyncIterator[bytes]:
    """A streamed Responses API answer (:class:`~.responses_api.ResponseEvents`): its reasoning and content deltas and
    its function calls as they come, ``response.completed`` at the end (kept in ``store`` where the request asks);
    an error ends it with ``response.failed``. Where the request asks for log-probabilities a content delta carries
    its tokens' (``token_texts`` names them) — with those of tokens that wrote no text yet (half a character), not
    those of a stretch that was reasoning only (as vLLM's stream)."""
    assert isinstance(job.reply_api, ra.ResponsesRequest)
    store = store if job.reply_api.store else None
    events = ra.ResponseEvents(job.request_id, job.created, job.reply_api, store=store is not None)
    yield events.start()
    reply = _StreamedReply(job)
    counts = _UsageCounts()
    held: list[TokenLogprobs] = []  # tokens whose log-probabilities wait for the content delta they wrote
    async for index, batch in job.events:
        last = batch[-1]
        thought, text, deltas, _ = reply.push("".join([event.text for event in batch]), last.finished)
        logprobs = None
        if job.logprobs:
            held += [token for event in batch if event.logprobs is not None for token in event.logprobs.output]
            if text and held:
                logprobs = (await token_texts.logprobs_object(held, True, job.tokens_as_ids))["content"]
            if text or thought:
                held = []
        out = (events.reasoning(thought) if job.reasoning is not None and job.reasoning.shown else b"") + \
            events.content(text, logprobs) + events.calls(deltas)
        if last.finished:
            error = _failed(last)
            if error is not None:
                yield out + events.failed(str(error))
                return
            counts.add(job, index, last)
            yield out + events.finish(last.finish_reason, ra.usage_object(counts.usage(job)))
            if store is not None and events.final is not None:
                store.put(events.final, job.reply_api)
            continue  # (read to the end: see _collect)
        if out:
            yield out


async def _message_writes(job: _Job) -> AsyncIterator[bytes]:
    """A streamed Messages API answer (:class:`~.messages_api.MessageEvents`): its thinking, text and tool calls as
    content blocks as they come, the stop reason and usage at the end; an error ends it with an ``error`` event."""
    events = ma.MessageEvents(job.request_id, job.model, job.prompt_tokens)
    yield events.start()
    reply = _StreamedReply(job)
    async for _, batch in job.events:
        last = batch[-1]
        thought, text, deltas, _ = reply.push("".join([event.text for event in batch]), last.finished)
        out = (events.thinking(thought) if job.reasoning is not None and job.reasoning.shown else b"") + \
            events.text(text) + events.calls(deltas)
        if last.finished:
            error = _failed(last)
            if error is not None:
                yield out + events.failed(str(error))
                return
            yield out + events.finish(last.finish_reason, last.completion_tokens, stop_reason(last))
            continue  # (read to the end: see _collect)
        if out:
            yield out


def _with_reasoning(job: _Job, choice: oa.Choice) -> oa.Choice:
    """A finished chat choice's reply split into its reasoning and its content (a server with a reasoning parser)."""
    if job.reasoning is None or choice.text is None:
        return choice
    reasoning, content = split_reasoning(job.reasoning.fmt, job.reasoning.in_reasoning, choice.text)
    return replace(choice, text=content, reasoning=reasoning if job.reasoning.shown else None)


class _StreamedReply:
    """One streamed chat reply's text, split as it arrives: its reasoning first (a reasoning parser's), then its
    content until a tool call starts, then the calls as they are written (a tool-call format's;
    ``parallel_tool_calls`` false: the first; :mod:`.tool_call_stream`)."""

    def __init__(self, job: _Job) -> None:
        self.thoughts = None if job.reasoning is None else ReasoningStream(job.reasoning.fmt, job.reasoning.in_reasoning)
        self.tools = ToolCallStream(job.tools, job.one_call) if job.tools is not None else None

    def push(self, text: str, last: bool) -> tuple[str, str, list[CallDelta], list[ToolCall]]:
        """A batch's (reasoning, content, the calls' new pieces); at the reply's last batch with what was held back,
        and the calls."""
        thought, deltas, calls = "", list[CallDelta](), list[ToolCall]()
        if self.thoughts is not None:
            thought, text = self.thoughts.push(text)
            if last:
                tail_thought, tail = self.thoughts.finish()
                thought, text = thought + tail_thought, text + tail
        if self.tools is not None:
            text, deltas = self.tools.push(text)
            if last:
                tail, more, calls = self.tools.finish()
                text, deltas = text + tail, deltas + more
        return thought, text, deltas, calls


def _truncated(req: oa.CompletionRequest | oa.ChatCompletionRequest, prompt_ids: list[int], context: int) -> list[int]:
    """``truncate_prompt_tokens`` applied (vLLM's; a 400 naming it when it asks for more than the context)."""
    try:
        return req.truncated(prompt_ids, context)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="truncate_prompt_tokens") from None


def _chunk(job: _Job, index: int, text: str | None, finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None, token_ids: list[int] | None = None,
           prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """A streamed chunk of choice ``index``; ``token_ids`` (vLLM's ``return_token_ids``): the output ids it accounts
    for, and in a completion's first chunk the prompt's (``prompt_token_ids``; a chat's come in its role chunk)."""
    if job.chat:
        delta = {"content": text} if text is not None else {}
        chunk = oa.chat_chunk(job.request_id, job.created, job.model, delta, finish_reason, index, logprobs)
    else:
        chunk = oa.completion_chunk(job.request_id, job.created, job.model, text or "", finish_reason, index, logprobs)
    if token_ids is not None:
        choice = chunk["choices"][0]
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
        choice["token_ids"] = token_ids
    return _stamped(job, index, chunk)


def _delta_chunk(job: _Job, index: int, delta: dict[str, Any]) -> dict[str, Any]:
    """A chat stream's chunk of choice ``index`` that says ``delta`` (its role, reasoning, tool calls)."""
    return _stamped(job, index, oa.chat_chunk(job.request_id, job.created, job.model, delta, index=index))


def _stamped(job: _Job, index: int, chunk: dict[str, Any]) -> dict[str, Any]:
    """``chunk`` with the usage so far where the request asks for it in every chunk (vLLM's
    ``continuous_usage_stats``: the prompt's tokens, and its choice's)."""
    if job.generated is not None:
        chunk["usage"] = oa.usage(job.prompt_tokens, job.generated[index])
    return chunk


def _text_parts(job: _Job, index: int, text: str, logprobs: dict[str, Any] | None, frame: tuple[bytes, bytes] | None,
                batch: Sequence[Event], first: bool) -> list[bytes]:
    """The SSE chunk of a batch's text, if it has something to say: from the choice's prebuilt ``frame`` where it is
    text alone; with ``return_token_ids`` each with its ids (the prompt's in a completion choice's ``first``), also
    one without text."""
    if logprobs is None and frame is not None:  # the usual chunk: text only
        return [b"".join((frame[0], json.dumps(text, ensure_ascii=False).encode(), frame[1]))] if text else []
    if job.prompt_ids is not None:
        ids = _batch_token_ids(batch)
        prompt_ids = job.prompt_ids[index] if first else None
        return [_sse(_chunk(job, index, text, logprobs=logprobs, token_ids=ids, prompt_token_ids=prompt_ids))
                ] if text or logprobs or ids or prompt_ids is not None else []
    return [_sse(_chunk(job, index, text, logprobs=logprobs))] if text or logprobs else []


def _finish_parts(job: _Job, index: int, last: Event, error: ApiError | None, called: bool,
                  counts: _UsageCounts) -> list[bytes]:
    """A choice's finish chunk (or the error that ends the response) — the usage chunk and ``[DONE]`` after the
    last choice's (``counts``: all choices' so far)."""
    reason = calls_finish_reason(job.tools, last.finish_reason or "stop") if called and job.tools else last.finish_reason
    parts = [_sse(error.body if error is not None else _finish_chunk(job, index, last, reason))]
    if job.done or error is not None:
        if job.include_usage:
            obj = "chat.completion.chunk" if job.chat else "text_completion"
            parts.append(_sse(oa.usage_chunk(obj, job.request_id, job.created, job.model, counts.usage(job))))
        parts.append(b"data: [DONE]\n\n")
    return parts


def _finish_chunk(job: _Job, index: int, last: Event, reason: str | None) -> dict[str, Any]:
    """A choice's last chunk: its finish reason and vLLM's ``stop_reason`` (the stop string or token that ended it)."""
    chunk = _chunk(job, index, None, reason, token_ids=[] if job.prompt_ids is not None else None)
    chunk["choices"][0]["stop_reason"] = stop_reason(last)
    return chunk


def stop_reason(last: Event) -> str | int | None:
    """vLLM's ``stop_reason`` of a choice's last event: the stop string or stop token that ended it, else None."""
    return last.usage_details.stop_reason if last.usage_details is not None else None


def _role_chunk(job: _Job, index: int) -> dict[str, Any]:
    """A chat stream's first chunk of choice ``index``: the assistant's role — with the prompt's ids where the request
    asks for them (vLLM's ``return_token_ids`` puts them on this chunk, beside its choices)."""
    chunk = _delta_chunk(job, index, {"role": "assistant", "content": ""})
    if job.prompt_ids is not None:
        chunk["prompt_token_ids"] = job.prompt_ids[index]
    return chunk


def _batch_token_ids(batch: Sequence[Event]) -> list[int]:
    """The output ids a batch of a choice's events carries (each event its own: vLLM's ``return_token_ids``)."""
    return [token for event in batch if isinstance(event, EventWithTokenIds) for token in event.token_ids]


class _TokenTexts:
    """Token ids as text, for log-probabilities: each id decoded once (the cache is bounded by the
    vocabulary), on the event loop with its own tokenizer copy, else on the tokenizer thread."""

    def __init__(self, loop_tokenizer: Any, tokenizer: Any, pool: ThreadPoolExecutor) -> None:
        self._loop_tokenizer = loop_tokenizer
        self._tokenizer = tokenizer
        self._pool = pool
        self._known: dict[int, str] = {}

    async def decoded(self, tokens: Sequence[TokenLogprobs]) -> list[oa.DecodedLogprob]:
        return await self._run(self._decode, tokens)

    async def logprobs_object(self, tokens: Sequence[TokenLogprobs], chat: bool, as_ids: bool, text_offset: int = 0,
                              first: int | None = None) -> dict[str, Any]:
        """A choice's (or a chunk's) ``logprobs`` object for ``tokens``, their ids decoded to text — or named by id
        (``as_ids``: vLLM's ``return_tokens_as_token_ids``) — (``first``: an echoed prompt's first token, which has no
        log-probability)."""
        decoded = await self.decoded(tokens)
        if as_ids:  # (a chat entry's bytes stay its text's; completions' text offsets count the names, as vLLM's)
            name = oa.token_id_name
            decoded = [oa.DecodedLogprob(name(t.token), t.logprob, tuple((name(i), lp) for i, lp in t.top), d.token)
                       for t, d in zip(tokens, decoded, strict=True)]
        if chat:
            return oa.chat_logprobs(decoded)
        lead = None if first is None else oa.token_id_name(first) if as_ids else await self.text(first)
        return oa.completion_logprobs(decoded, text_offset, lead)

    async def text(self, token: int) -> str:
        return (await self._run(self._decode, [TokenLogprobs(token, 0.0)]))[0].token

    async def texts(self, tokens: Sequence[TokenLogprobs]) -> dict[int, str]:
        """Each id of ``tokens`` (and of their most likely ones) as text."""
        ids = list(dict.fromkeys([i for t in tokens for i in (t.token, *(top for top, _ in t.top))]))
        decoded = await self._run(self._decode, [TokenLogprobs(i, 0.0) for i in ids])
        return {i: d.token for i, d in zip(ids, decoded, strict=True)}

    async def _run(self, decode: Callable[[Sequence[TokenLogprobs], Any], list[oa.DecodedLogprob]],
                   tokens: Sequence[TokenLogprobs]) -> list[oa.DecodedLogprob]:
        if self._loop_tokenizer is not None:
            return decode(tokens, self._loop_tokenizer)
        return await asyncio.get_running_loop().run_in_executor(self._pool, decode, tokens, self._tokenizer)

    def _decode(self, tokens: Sequence[TokenLogprobs], tokenizer: Any) -> list[oa.DecodedLogprob]:
        known = self._known

        def text(token: int) -> str:
            found = known.get(token)
            if found is None:
                found = known[token] = str(tokenizer.decode([token]))
            return found

        return [oa.DecodedLogprob(text(t.token), t.logprob, tuple((text(i), lp) for i, lp in t.top)) for t in tokens]


@dataclass
class _Job:
    """One accepted generation request — its ``n`` choices, each a sequence of its own on the ranks — as
    the response writers need it."""

    request_id: str  # the response's id
    choice_ids: list[str]  # the ranks' request id of each choice (:func:`choice_requests`)
    created: int
    model: str
    chat: bool
    stream: bool
    include_usage: bool
    events: AsyncIterator[tuple[int, list[Event]]]  # (choice, one of its batches; see Dispatcher.submit)
    prompt_tokens: int  # the usage's: each prompt once, however many choices it has
    logprobs: bool = False  # the request asked for its tokens' log-probabilities
    echo: list[tuple[str, int]] | None = None  # per choice: the prompt's text and first token, to lead with
    tools: ToolFormat | None = None  # how to read the replies' tool calls (a parser, a forced choice); None: don't
    finished: set[int] = field(default_factory=set)  # the choices whose last event arrived
    one_call: bool = False  # parallel_tool_calls false: a reply's first call only (as vLLM filters them)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked (each choice's, or the chat response's)
    prompt_ids: list[list[int]] | None = None  # per choice its prompt's token ids (vLLM's return_token_ids)
    tokens_as_ids: bool = False  # logprobs name each token "token_id:{id}" (vLLM's return_tokens_as_token_ids)
    reasoning: ReplyReasoning | None = None  # chat replies split into reasoning and content (--reasoning-parser)
    choices_per_prompt: int = 1  # n: choice c is of prompt c // n
    generated: list[int] | None = None  # vLLM's continuous_usage_stats: each choice's tokens so far (else None)
    # the Responses or Messages API request it answers (else chat or completions)
    reply_api: ra.ResponsesRequest | ma.MessagesRequest | None = None

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.choice_ids)


def choice_requests(request_id: str, prompts: Sequence[tuple[tuple[int, ...], SamplingParams]], n: int,
                    priority: int = 0) -> list[GenerationRequest]:
    """The ranks' requests for ``n`` choices of each of ``prompts`` ((token ids, sampling), in order), each of
    ``priority``: one choice in all takes the response's own id; else choice c = prompt index · n + i is
    ``{c}_{id}``, and with a seed, samples with seed + i (vLLM's child requests): a prompt's choices differ, and the
    same request gives the same choices again."""
    if len(prompts) == 1 and n == 1:
        return [GenerationRequest(request_id, *prompts[0], priority=priority)]
    return [GenerationRequest(f"{p * n + i}_{request_id}", prompt_ids,
                              params if params.seed is None else replace(params, seed=params.seed + i),
                              priority=priority)
            for p, (prompt_ids, params) in enumerate(prompts) for i in range(n)]


def configure_logging() -> None:
    """An API process's log: vexpert's INFO lines and above (requests with --enable-log-requests, disconnects, where
    it listens) to stderr in vLLM's form, ``INFO 12-07 23:40:01 [api] …``; other libraries' loggers are left as they
    are (aiohttp's access log would be a line per request). Once per process."""
    logger = logging.getLogger("vexpert_runtime")
    if any(getattr(handler, "vexpert_serve", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(module)s] %(message)s", "%m-%d %H:%M:%S"))
    handler.vexpert_serve = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class StatsLog:
    """vLLM's periodic log line of a busy server: prompt and generation throughput since the last line, the ranks'
    running and waiting requests, KV-cache usage and prefix-cache hit rate (since the ranks started). The tokens are
    this API server's (with several, each logs its own); nothing is logged for an idle interval."""

    def __init__(self, api: ServeApi) -> None:
        self.api = api
        self._last = (time.monotonic(), *self._totals())

    def _totals(self) -> tuple[float, float]:
        registry = self.api.metrics.registry
        return (registry.get_sample_value("vexpert_serve_prompt_tokens_total") or 0.0,
                registry.get_sample_value("vexpert_serve_generated_tokens_total") or 0.0)

    def line(self) -> str | None:
        (then, prompt0, generated0), now = self._last, time.monotonic()
        prompt, generated = self._totals()
        self._last = (now, prompt, generated)
        loads = self.api.dispatcher.loads()
        running, waiting = sum(load.running for load in loads), sum(load.waiting for load in loads)
        if not (running or waiting or prompt > prompt0 or generated > generated0):
            return None
        span = max(now - then, 1e-9)
        blocks, used = sum(load.kv_blocks_total for load in loads), sum(load.kv_blocks_used for load in loads)
        queried, hit = sum(load.prefix_query_tokens for load in loads), sum(load.prefix_hit_tokens for load in loads)
        return (f"Avg prompt throughput: {(prompt - prompt0) / span:.1f} tokens/s, Avg generation throughput: "
                f"{(generated - generated0) / span:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * used / blocks if blocks else 0:.1f}%, Prefix cache hit rate: "
                f"{100 * hit / queried if queried else 0:.1f}%")

    async def run(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            line = self.line()
            if line is not None:
                log.info("%s", line)


def log_request(path: str, request_id: str, prompts: Sequence[Sequence[int]], params: SamplingParams,
                req: oa.CompletionRequest | oa.ChatCompletionRequest, max_log_len: int | None) -> None:
    """One INFO line for a generation request as it is queued (``--enable-log-requests``, as vLLM logs them): its id
    and route, its prompts' lengths and token ids (at most ``max_log_len`` each) and the sampling it asked for."""
    shown = [list(ids[:max_log_len]) if max_log_len is not None else list(ids) for ids in prompts]
    log.info("request %s: %s, %d choice(s), prompt tokens %s, max_tokens %d, temperature %s, top_p %s, top_k %s, "
             "seed %s, stream %s, prompt ids %s", request_id, path, len(prompts) * req.choices,
             [len(ids) for ids in prompts], params.max_tokens, params.temperature, params.top_p, params.top_k,
             params.seed, bool(req.stream), shown)


def request_priority(req: oa.CompletionRequest | oa.ChatCompletionRequest, config: ApiConfig) -> int:
    """``req``'s ``priority`` (null: 0); another value than 0 is a 400 naming it unless the ranks schedule by
    priority (``--scheduling-policy priority``), as vLLM refuses it: it would otherwise be silently ignored."""
    priority = req.priority or 0
    if priority != 0 and config.scheduling_policy != "priority":
        raise ApiError(400, f"priority: this server serves requests first come, first served (--scheduling-policy "
                       f"{config.scheduling_policy}): send 0, or start it with --scheduling-policy priority",
                       param="priority")
    return priority


class _ChoiceStreams:
    """A request's choices' event batches, each tagged with its choice's index, in arrival order, each
    handed to ``observe`` (index, batch) before it is yielded (one choice: its own iterator, no task
    and no other generator in between — at hundreds of streams every layer per batch shows in the API
    process's CPU per request). :meth:`close` stops the pumps of choices still running (their
    requests are cancelled by the caller)."""

    def __init__(self, streams: list[AsyncIterator[list[Event]]], observe: Callable[[int, list[Event]], None]) -> None:
        self._streams = streams
        self._observe = observe
        self._queue: asyncio.Queue[tuple[int, list[Event]]] | None = None  # several choices: where their pumps put
        self._pumps: list[asyncio.Future[None]] = []

    async def __aiter__(self) -> AsyncIterator[tuple[int, list[Event]]]:
        observe = self._observe
        if len(self._streams) == 1:
            async for batch in self._streams[0]:
                observe(0, batch)
                yield 0, batch
            return
        queue = self._queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(i, stream)) for i, stream in enumerate(self._streams)]
        running = len(self._streams)
        while running:
            index, batch = await queue.get()
            running -= batch[-1].finished
            observe(index, batch)
            yield index, batch

    async def _pump(self, index: int, stream: AsyncIterator[list[Event]]) -> None:
        assert self._queue is not None
        async for batch in stream:
            self._queue.put_nowait((index, batch))

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()


def check_model(config: ApiConfig, model: str) -> None:
    """A request for a model this server does not serve is a 404."""
    if model != config.model_name and model not in config.aliases:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{config.model_name}'",
                       param="model", code="model_not_found")


class ServeApi:
    """The request handlers over a :class:`Dispatcher`; :meth:`app` builds the aiohttp app."""

    def __init__(
        self, dispatcher: Dispatcher, tokenizer: Any, config: ApiConfig, registry: CollectorRegistry | None = None,
        node_metrics: Callable[[], bytes] | None = None, metrics_share: MetricsShare | None = None,
    ) -> None:
        """``registry``: where the API's series go (a new one if None); ``node_metrics``: the node's
        own exposition, appended on ``/metrics`` (it runs in another process: a blocking call, made
        off the event loop); ``metrics_share``: with several API servers, where they publish their
        series so that ``/metrics`` on any of them counts all (:mod:`.metrics_share`)."""
        self.dispatcher = dispatcher
        self.node_metrics = node_metrics
        self.metrics_share = metrics_share
        self.prompts = PromptEncoder(tokenizer, config.vocab_size)
        self._validation_context = {"special_tokens": special_tokens(tokenizer)}  # (structural tags' triggers)
        self.config = config
        self.gc_clock = GcClock().install()
        self.metrics = ServeMetrics(registry if registry is not None else CollectorRegistry(), self.gc_clock)
        self.metrics.registry.register(VllmSeries(self.metrics, lambda: self.config.model_name))
        self.created = oa.now()
        self.shutting_down = False
        self.server_load = 0  # generation requests this API server is answering now (GET /load)
        self._token_texts = _TokenTexts(self.prompts.loop_tokenizer, tokenizer, self.prompts.pool)
        self.responses_store = ra.ResponseStore(config.responses_store) if config.responses_store > 0 else None

    def close(self) -> None:
        """Stop the tokenizer thread (after the server stopped); publish the final counts."""
        self.prompts.close()
        self.gc_clock.uninstall()
        if self.metrics_share is not None:
            self.metrics_share.stop(self.metrics.registry)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.config.body_limit)
        install_cors(app, self.config.cors)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        info, other = _InfoRoutes(self), _OtherApiRoutes(self)
        app.router.add_post("/v1/responses", other.responses)
        app.router.add_post("/v1/messages", other.messages)
        app.router.add_post("/v1/messages/count_tokens", other.count_tokens)
        app.router.add_get("/v1/responses/{response_id}", info.stored_response)
        app.router.add_get("/v1/models", info.models)
        app.router.add_get("/v1/models/{model:.+}", info.model)  # (a model id may hold slashes: org/name)
        app.router.add_post("/tokenize", info.tokenize)
        app.router.add_post("/detokenize", info.detokenize)
        app.router.add_get("/version", info.version)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/ping", info.ping)  # (vLLM's and SageMaker's name of /health: GET and POST)
        app.router.add_get("/load", info.load)
        app.router.add_get("/metrics", self._metrics)
        return app

    # ---- middleware -------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Turn every failure into an OpenAI error object and count the generation requests; stamp
        the request's arrival (its latencies count from there, as vLLM's do)."""
        request[_ARRIVED] = time.monotonic()
        generation = request.path in GENERATION_ENDPOINTS
        self.server_load += generation  # until its reply (a stream: its last chunk) is written: vLLM's /load
        try:
            if self.config.api_key and (request.path.startswith("/v1/") or request.path in _TOKENIZER_ENDPOINTS):
                self._authorize(request, self.config.api_key)
            response = await handler(request)
        except ApiError as exc:
            response = exc.response()
        except web.HTTPException as exc:  # unknown route, wrong method
            if exc.status < 400:
                raise
            code = "not_found" if exc.status == 404 else None
            path = request.path[:200]
            response = ApiError(exc.status, f"{exc.reason}: {request.method} {path}", code=code).response()
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, request.path)
            response = ApiError(500, "internal server error", "server_error", code="internal_error").response()
        finally:
            self.server_load -= generation
        if request.path.startswith(ma.ROUTE) and response.status >= 400 and isinstance(response, web.Response):
            response.text = json.dumps(ma.error_body(json.loads(response.text or "{}"), response.status))
        if generation:
            self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    @staticmethod
    def _authorize(request: web.Request, key: str) -> None:
        """``Authorization: Bearer <key>`` or Anthropic's ``x-api-key: <key>`` (either), else a 401 (compared in
        constant time)."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        offered = [token] if scheme.lower() == "bearer" else []
        offered += request.headers.getall("x-api-key", [])
        expected = key.encode("utf-8")
        if not any([hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), expected) for given in offered]):
            raise ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with "
                "the key the server was started with (--api-key or VEXPERT_API_KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    # ---- routes -----------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req = self._parse(oa.CompletionRequest, await self._json(request))
        check_model(self.config, req.model)
        prompts, texts = [], []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids = await self.prompts.run(partial(self.prompts.prompt_ids, add_special_tokens=req.add_special_tokens),
                                             prompt, len(prompt))
            else:  # token ids: only checked
                ids = self.prompts.prompt_ids(prompt)
            kept = _truncated(req, ids, self.config.max_context)
            prompts.append(kept)
            if not req.echo:
                texts.append("")
            else:  # the prompt as the model sees it
                texts.append(prompt if isinstance(prompt, str) and kept is ids else await self.prompts.text(kept))
        # (an empty prompt is refused by _generate, before any of this is read)
        echo = [(text, ids[0] if ids else 0) for text, ids in zip(texts, prompts, strict=True) for _ in range(req.choices)]
        return await self._generate(request, req, prompts, chat=False, echo=echo if req.echo else None)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = self._parse(oa.ChatCompletionRequest, await self._json(request))
        check_model(self.config, req.model)
        return await self._chat(request, req)

    async def _chat(self, request: web.Request, req: oa.ChatCompletionRequest,
                    reply_api: ra.ResponsesRequest | ma.MessagesRequest | None = None) -> web.StreamResponse:
        if req.calls_tools and req.forced_tool_choice is None and self.config.tool_call_parser is None:
            raise ApiError(400, 'tool_choice: this server reads no tool calls (start it with --tool-call-parser '
                           'hermes for Qwen / Hermes models, qwen3_coder for Qwen3-Coder, deepseek_v3 for DeepSeek-V3, '
                           'kimi_k2 for Kimi K2): send "none" (the template '
                           "shows the tools, the reply is text) or leave tools out", param="tool_choice")
        prompt_ids = _truncated(req, await self.chat_ids(req), self.config.max_context)
        fmt = REASONING_PARSERS.get(self.config.reasoning_parser or "")
        reasoning = None if fmt is None else ReplyReasoning(fmt, fmt.starts_in_reasoning(
            req.chat_template_kwargs, await self.prompts.text(prompt_ids[-8:])), req.include_reasoning)
        return await self._generate(request, req, [prompt_ids], chat=True, reasoning=reasoning, reply_api=reply_api)

    async def chat_ids(self, req: oa.ChatTemplateInputs) -> list[int]:
        """A conversation's prompt ids, as every chat route renders (the server's template) and tokenizes it."""
        encode = partial(self.prompts.chat_ids, add_special_tokens=req.add_special_tokens,
                         chat_template=self.config.chat_template)
        return await self.prompts.run(encode, req, sum(len(m.text()) for m in req.messages))

    async def _health(self, request: web.Request) -> web.Response:
        reason = "shutting down" if self.shutting_down else self.dispatcher.ready()
        if reason is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.refresh(self.dispatcher.loads())
        if self.metrics_share is not None:
            body = self.metrics_share.merged(self.metrics.registry)
        else:
            body = generate_latest(self.metrics.registry)
        if self.node_metrics is not None:
            body += await asyncio.get_running_loop().run_in_executor(None, self.node_metrics)
        elif self.metrics_share is not None:  # another API server owns the node
            body += self.metrics_share.node_text()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- request parsing --------------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict[str, Any]:
        """The body as a JSON object: 415 unless it is declared JSON, 413 over the limit, else a 400."""
        declared = request.headers.get("Content-Type")
        if declared is not None and request.content_type != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got '{declared[:100]}'; send the body as "
                           "JSON", code="unsupported_media_type")
        limit = self.config.body_limit
        too_large = ApiError(413, f"the request body is over {limit} bytes, more than a prompt of the model's "
                             f"{self.config.max_context}-token context needs; shorten the prompt (or messages), or "
                             "split a batch of prompts over several requests", code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large  # before reading a byte of it
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # chunked, no Content-Length
            raise too_large from None
        if len(raw) <= _PARSE_ON_LOOP_BYTES:
            return parse_body(raw)
        return await asyncio.to_thread(parse_body, raw)

    def _parse(self, model: type[_Body], body: dict[str, Any]) -> _Body:
        if body.get("model") is None:  # left out or null: the served model, as vLLM's (and the answer names it)
            body = {**body, "model": self.config.model_name}
        try:
            return model.model_validate(body, context=self._validation_context)
        except ValidationError as exc:
            message, param = oa.describe_validation_error(exc)
            raise ApiError(400, message, param=param, code="invalid_value") from None

    # ---- generation -------------------------------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        req: oa.CompletionRequest | oa.ChatCompletionRequest,
        prompts: list[list[int]],
        chat: bool,
        echo: list[tuple[str, int]] | None = None,
        reasoning: ReplyReasoning | None = None,
        reply_api: ra.ResponsesRequest | ma.MessagesRequest | None = None,
    ) -> web.StreamResponse:
        """Submit the request's choices (``n`` per prompt) to the dispatcher — all of them or none (a
        refusal of one cancels those queued before it) — and answer as one JSON body or an SSE stream
        (``echo``: each choice's prompt text and first token, to lead its text and log-probabilities; ``reasoning``:
        how a chat reply's reasoning is told from its content; ``reply_api``: the Responses or Messages API request it
        answers)."""
        bad = await self.prompts.run(self.prompts.bad_words, req.bad_words, sum(map(len, req.bad_words))) \
            if req.bad_words else ()
        after = self.prompts.single_token(reasoning.fmt.end) if reasoning is not None and reasoning.in_reasoning else None
        params = [sampling_params(req, len(prompt_ids), chat, self.config, bad, after,
                                  reasoning is not None and reasoning.in_reasoning) for prompt_ids in prompts]
        request_id = f"resp_{uuid.uuid4().hex}" if isinstance(reply_api, ra.ResponsesRequest) else \
            ma.new_message_id() if reply_api is not None else oa.new_request_id("chatcmpl" if chat else "cmpl")
        requests = choice_requests(request_id, [(tuple(ids), p) for ids, p in zip(prompts, params, strict=True)],
                                   req.choices, request_priority(req, self.config))
        if self.shutting_down:
            raise refusal_error(shutting_down())
        if self.config.log_requests:
            log_request(request.path, request_id, prompts, params[0], req, self.config.max_log_len)
        streams: list[AsyncIterator[list[Event]]] = []
        try:
            for choice in requests:
                streams.append(await self.dispatcher.submit(choice))
        except BaseException as exc:
            for queued in requests[: len(streams)]:
                self.dispatcher.cancel(queued.request_id)
            if isinstance(exc, ServeRefusal):
                raise refusal_error(exc) from None
            if isinstance(exc, VExpertInputError):
                raise ApiError(400, str(exc), param=exc.field) from None
            raise
        arrived = request.get(_ARRIVED, time.monotonic())
        timers = [_RequestTimer(self.metrics, arrived, counts_prompt=i % req.choices == 0) for i in range(len(requests))]
        finished: set[int] = set()

        def observe(index: int, batch: list[Event]) -> None:  # each event timed, a choice finished at its last
            timers[index].observe(batch)
            if batch[-1].finished:
                finished.add(index)

        choices = _ChoiceStreams(streams, observe)
        job = _Job(request_id, [r.request_id for r in requests], oa.now(), req.model, chat, bool(req.stream),
                   req.include_usage, choices.__aiter__(), sum(map(len, prompts)), params[0].logprobs is not None, echo,
                   tool_format(req, self.config), finished,
                   isinstance(req, oa.ChatCompletionRequest) and req.parallel_tool_calls is False,
                   req.prompt_logprobs is not None,
                   [list(ids) for ids in prompts for _ in range(req.choices)] if req.return_token_ids else None,
                   self.config.tokens_as_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids,
                   reasoning, req.choices, [0] * len(requests) if req.continuous_usage else None, reply_api)
        try:
            return await (self._stream(request, job) if job.stream else self._collect(job))
        finally:
            choices.close()
            for index, choice_id in enumerate(job.choice_ids):  # client gone (handler cancelled, write
                if index not in job.finished:  # failed) or an error: free the sequences still running
                    self.dispatcher.cancel(choice_id)

    async def _collect(self, job: _Job) -> web.Response:
        texts: list[list[str]] = [[] for _ in job.choice_ids]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in job.choice_ids]
        prompts: list[list[TokenLogprobs]] = [[] for _ in job.choice_ids]  # the prompt's (echo, prompt_logprobs)
        token_ids: list[list[int]] = [[] for _ in job.choice_ids]  # return_token_ids
        finish: dict[int, str] = {}
        stops: dict[int, str | int | None] = {}
        counts = _UsageCounts()
        async for index, batch in job.events:
            texts[index].extend(event.text for event in batch)
            if job.prompt_ids is not None:
                token_ids[index] += _batch_token_ids(batch)
            for event in batch:
                if event.logprobs is not None:
                    prompts[index] += event.logprobs.prompt
                    logprobs[index] += event.logprobs.output
            last = batch[-1]
            if last.finished:
                error = _failed(last)
                if error is not None:
                    raise error
                finish[index], stops[index] = last.finish_reason or "stop", stop_reason(last)
                counts.add(job, index, last)
        # (read to their end, not left after the last event: an async generator left suspended is closed
        # by the event loop's finalizer — a task per request)
        if not job.done:
            raise ApiError(500, "the request ended without a result", "server_error", code="internal_error")
        none: list[tuple[str, int | None]] = [("", None)] * len(texts)
        echo: list[tuple[str, int | None]] = list(job.echo) if job.echo else none
        choices = [_with_tool_calls(job, _with_reasoning(job, oa.Choice(
            i, echo[i][0] + "".join(parts), finish[i],
            await self._logprobs_object(job, [*prompts[i], *logprobs[i]] if job.echo else logprobs[i], 0, echo[i][1])
            if job.logprobs else None, None,
            oa.vllm_prompt_logprobs(prompts[i], await self._token_texts.texts(prompts[i])) if job.prompt_logprobs
            else None, token_ids[i] if job.prompt_ids is not None else None,
            job.prompt_ids[i] if job.prompt_ids is not None else None, stop_reason=stops[i])))
            for i, parts in enumerate(texts)]
        if isinstance(job.reply_api, ma.MessagesRequest):
            (choice,) = choices
            return web.json_response(ma.message_object(job.request_id, job.model, choice.reasoning, choice.text,
                                                       choice.tool_calls or [], choice.finish_reason,
                                                       ma.usage_object(counts.usage(job)), choice.stop_reason))
        if job.reply_api is not None:
            (choice,) = choices
            output = ra.output_items(choice.reasoning, choice.text, choice.tool_calls or [],
                                     (choice.logprobs or {}).get("content"))
            store = self.responses_store if job.reply_api.store else None
            response = ra.response_object(job.request_id, job.created, job.reply_api, output, choice.finish_reason,
                                          ra.usage_object(counts.usage(job)), store=store is not None)
            if store is not None:
                store.put(response, job.reply_api)
            return web.json_response(response)
        build = oa.chat_response if job.chat else oa.completion_response
        return web.json_response(build(job.request_id, job.created, job.model, choices, counts.usage(job)))

    async def _logprobs_object(self, job: _Job, tokens: Sequence[TokenLogprobs], text_offset: int = 0,
                               first: int | None = None) -> dict[str, Any]:
        return await self._token_texts.logprobs_object(tokens, job.chat, job.tokens_as_ids, text_offset, first)

    async def _stream(self, request: web.Request, job: _Job) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        try:
            writes = _message_writes(job) if isinstance(job.reply_api, ma.MessagesRequest) else \
                _response_writes(job, self.responses_store, self._token_texts) if job.reply_api is not None \
                else self._sse_writes(job)
            async for data in writes:
                await response.write(data)
            await response.write_eof()
        except ConnectionError:  # the client went away mid-stream; _generate cancels the request
            log.info("client of %s disconnected", job.request_id)
        return response

    async def _sse_writes(self, job: _Job) -> AsyncIterator[bytes]:
        """The SSE body of one request, one ``bytes`` per socket write: the role chunk of each choice,
        then per batch of a choice's events one chunk with their text — and, in its last, the choice's
        finish chunk; after the last choice's, the usage chunk and ``[DONE]`` (an error ends the whole
        response) — together (at hundreds of streams the API's event loop spent most of its time in
        one send per chunk, then in one JSON chunk per token). A batch is what arrived while this
        request's writer waited: one token when the loop keeps up, several when it falls behind (as
        vLLM's API server merges a request's outputs under backpressure)."""
        if job.chat:
            yield b"".join(_sse(_role_chunk(job, index)) for index in range(len(job.choice_ids)))
        counts = _UsageCounts()
        offsets = [0] * len(job.choice_ids)  # each choice's text offset so far (completions' logprobs)
        replies = [_StreamedReply(job) for _ in job.choice_ids] \
            if job.reasoning is not None or job.tools is not None else None
        echoing = set(range(len(job.choice_ids))) if job.echo else set()  # choices whose prompt is still to send
        frames = [_text_frame(_chunk(job, index, _TEXT_MARK)) if job.prompt_ids is None and job.generated is None
                  else None for index in range(len(job.choice_ids))]
        ids_pending = set(range(len(job.choice_ids))) if job.prompt_ids is not None and not job.chat else set()
        async for index, batch in job.events:
            text = "".join([event.text for event in batch])
            if job.generated is not None:
                job.generated[index] += sum(event.new_tokens for event in batch)
            first = None
            if index in echoing and job.echo is not None:  # the first chunk leads with the prompt
                echoing.discard(index)
                text, first = job.echo[index][0] + text, job.echo[index][1]
            logprobs = None
            if job.logprobs:
                tokens = [entry for event in batch if event.logprobs is not None  # (the prompt's: only echoed)
                          for entry in (*(event.logprobs.prompt if job.echo else ()), *event.logprobs.output)]
                if tokens or first is not None:
                    logprobs = await self._logprobs_object(job, tokens, offsets[index], first)
                    offsets[index] += sum(len(token) for token in logprobs.get("tokens", ()))
            thought, deltas, calls = "", list[CallDelta](), list[ToolCall]()
            if replies is not None:  # the reasoning first, the content after it, the calls as they are written
                thought, text, deltas, calls = replies[index].push(text, batch[-1].finished)
            parts = _text_parts(job, index, text, logprobs, frames[index], batch, index in ids_pending)
            if thought and job.reasoning is not None and job.reasoning.shown:
                parts.insert(0, _sse(_delta_chunk(job, index, {"reasoning": thought})))
            ids_pending.discard(index)
            if deltas:
                parts.append(_sse(_delta_chunk(job, index, {"tool_calls": [delta.as_json() for delta in deltas]})))
            last = batch[-1]
            if last.finished:
                error = _failed(last)
                counts.add(job, index, last)
                parts += _finish_parts(job, index, last, error, bool(calls), counts)
                if job.done or error is not None:
                    yield b"".join(parts)
                    if error is not None:
                        return
                    continue  # the choices' events end here: read to their end (see _collect)
            if parts:
                yield b"".join(parts)


class _InfoRoutes:
    """The routes that answer about the served model, its tokenizer and the server: ``/v1/models`` (and one model),
    vLLM's ``/tokenize``, ``/detokenize``, ``/version``, ``/ping`` and ``/load`` — over a :class:`ServeApi`'s config,
    body reading and prompts."""

    def __init__(self, api: ServeApi) -> None:
        self.api = api

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: a ``prompt`` or ``messages`` as the generation endpoints tokenize them."""
        body = await self.api._json(request)
        req: oa.TokenizeChatRequest | oa.TokenizeCompletionRequest = (
            self.api._parse(oa.TokenizeChatRequest, body) if "messages" in body
            else self.api._parse(oa.TokenizeCompletionRequest, body))
        check_model(self.api.config, req.model)
        prompts = self.api.prompts
        if isinstance(req, oa.TokenizeChatRequest):
            ids = await self.api.chat_ids(req)
        else:
            ids = await prompts.run(partial(prompts.prompt_ids, add_special_tokens=req.add_special_tokens),
                                    req.prompt, len(req.prompt))
        strs = await prompts.off_loop(prompts.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return web.json_response(oa.tokenize_response(ids, self.api.config.max_context, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: ``tokens`` (ids of the vocabulary, else a 400 naming them) as text."""
        req = self.api._parse(oa.DetokenizeRequest, await self.api._json(request))
        check_model(self.api.config, req.model)
        if any(not 0 <= token < self.api.config.vocab_size for token in req.tokens):
            raise ApiError(400, f"tokens: token ids must be in [0, {self.api.config.vocab_size})", param="tokens")
        return web.json_response({"prompt": await self.api.prompts.text(req.tokens)})

    async def stored_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/responses/{id}``: a response the server stored (``--responses-store``), else a 404."""
        response_id = request.match_info["response_id"]
        store = self.api.responses_store
        response = store.response(response_id) if store is not None else None
        if response is None:
            raise ApiError(404, f"no stored response {response_id!r}" + (
                "" if store is not None else " (this server stores none: start it with --responses-store N)"),
                param="response_id")
        return web.json_response(response)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def ping(self, request: web.Request) -> web.Response:
        return await self.api._health(request)

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /load``: the generation requests this API server is answering now (each of several API
        servers its own connections'; vLLM counts them with --enable-server-load-tracking, here always)."""
        return web.json_response({"server_load": self.api.server_load})

    async def models(self, request: web.Request) -> web.Response:
        config = self.api.config
        names = (config.model_name, *config.aliases)
        return web.json_response(oa.models_response(names, self.api.created, config.max_context))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        check_model(self.api.config, name)
        return web.json_response(oa.model_object(name, self.api.created, self.api.config.max_context))


class _OtherApiRoutes:
    """The other APIs whose requests become chat completions: OpenAI's Responses API (:mod:`.responses_api`) and
    Anthropic's Messages API (:mod:`.messages_api`) — over a :class:`ServeApi`'s chat path."""

    def __init__(self, api: ServeApi) -> None:
        self.api = api

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's ``POST /v1/responses``: the chat completion it amounts to, answered as a response
        (:mod:`.responses_api`)."""
        api = self.api
        resp = api._parse(ra.ResponsesRequest, await api._json(request))
        check_model(api.config, resp.model)
        if resp.previous_response_id is not None:
            if api.responses_store is None:
                raise ApiError(400, "previous_response_id: this server stores no responses (start it with "
                               "--responses-store N): send the whole conversation as input",
                               param="previous_response_id")
            try:
                resp = api.responses_store.continued(resp)
            except KeyError:
                raise ApiError(404, f"previous_response_id: no stored response {resp.previous_response_id!r} (this "
                               f"server keeps its last {api.responses_store.capacity})",
                               param="previous_response_id") from None
        try:
            body = ra.chat_body(resp)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=str(exc).split(":")[0]) from None
        try:
            return await api._chat(request, api._parse(oa.ChatCompletionRequest, body), resp)
        except ApiError as exc:  # a chat field's error, named as the Responses API names the field
            raise _renamed(exc, ra.FIELD_NAMES) from None

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's ``POST /v1/messages``: the chat completion it amounts to, answered as a message."""
        api = self.api
        req = api._parse(ma.MessagesRequest, await api._json(request))
        check_model(api.config, req.model)
        chat = self._chat_request(req)
        try:
            return await api._chat(request, chat, req)
        except ApiError as exc:  # a chat field's error, named as the Messages API names the field
            raise _renamed(exc, ma.FIELD_NAMES) from None

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens, as ``/v1/messages`` would run it."""
        api = self.api
        req = api._parse(ma.CountTokensRequest, await api._json(request))
        check_model(api.config, req.model)
        return web.json_response({"input_tokens": len(await api.chat_ids(self._chat_request(req)))})

    def _chat_request(self, req: ma.MessagesRequest | ma.CountTokensRequest) -> oa.ChatCompletionRequest:
        try:
            return self.api._parse(oa.ChatCompletionRequest, ma.chat_body(req))
        except ValueError as exc:
            raise ApiError(400, str(exc), param=str(exc).split(":")[0]) from None
        except ApiError as exc:
            raise _renamed(exc, ma.FIELD_NAMES) from None


class ApiServer:
    """Runs a :class:`ServeApi` on ``host:port`` (port 0: a free one) and stops it gracefully."""

    def __init__(self, api: ServeApi, host: str = "0.0.0.0", port: int = 8000, reuse_port: bool = False) -> None:
        """``reuse_port``: bind with ``SO_REUSEPORT`` (several API server processes on one port)."""
        self.api = api
        self.host = host
        self.port = port
        self.reuse_port = reuse_port
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the request;
        # keepalive_timeout runs from the connection's start too: the time to send a request's headers
        self._runner = _AppRunner(api.app(), handler_cancellation=True, access_log=None,
                                  keepalive_timeout=api.config.header_timeout_s)

    async def start(self) -> int:
        """Bind and serve; returns the port."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_port=self.reuse_port or None)
        try:
            await site.start()
        except OSError as exc:  # checked before the model loaded (check_listen_address): taken since
            await self._runner.cleanup()
            raise listen_error(self.host, self.port, exc) from None
        if self.api.metrics_share is not None:
            self.api.metrics_share.start(self.api.metrics.registry, self.api.node_metrics)
        self.port = int(self._runner.addresses[0][1])
        log.info("vexpert serve: listening on %s:%d (model %s)", self.host, self.port, self.api.config.model_name)
        return self.port

    async def stop(self) -> None:
        """503 for new requests, drain (or abort after the timeout) the running ones, close."""
        self.api.shutting_down = True
        await self.api.dispatcher.shutdown(self.api.config.drain_timeout_s)
        await self._runner.cleanup()
        self.api.close()


# The API process's threads (the event loop, the tokenizer, the reader of the ranks' events and, in
# `vexpert serve`, the node's supervisor) share one GIL. A thread that released it — for a pipe read,
# or a tokenizer call that runs without it — waits for the switch interval (5 ms by default) before a
# busy event loop hands it back — and a loop that itself releases the GIL often (a socket write per
# token per stream) keeps restarting the waiter's interval, so it can starve for seconds: with the loop
# busy, a message from another process reached it in 1.6-1.9 ms (p50) at 5 ms and 0.6-0.9 ms at 0.2 ms,
# a job on the tokenizer thread in > 5 s and 5.5-6.6 ms (benchmarks/gil_handoff.py, 2-core dev machine).
API_SWITCH_INTERVAL_S = 0.0002


def run_server(api: ServeApi, host: str, port: int, reuse_port: bool = False,
               on_stop: Callable[[], None] | None = None, announce: bool = True) -> None:
    """Serve until SIGTERM / SIGINT, then shut down gracefully (the CLI's entry point).
    ``on_stop()`` runs as the drain begins (the first API server stops the others); ``announce``:
    say so on stderr (the first API server speaks for all)."""
    sys.setswitchinterval(API_SWITCH_INTERVAL_S)

    async def main() -> None:
        server = ApiServer(api, host, port, reuse_port)
        await server.start()
        freeze_heap()  # the tokenizers, the app and the node's handles are built (gc_heap)
        every = api.config.log_stats_s
        stats = None if every is None else asyncio.get_running_loop().create_task(StatsLog(api).run(every))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if on_stop is not None:
            on_stop()
        if announce:
            print(f"vexpert serve: stopping: the requests in flight finish (up to {api.config.drain_timeout_s:.0f} s)",
                  file=sys.stderr, flush=True)
        await server.stop()
        if stats is not None:
            stats.cancel()

    asyncio.run(main())
