"""The API's latency histogram (:class:`~vexpert_runtime.serve.histogram.CountedHistogram`): ``observe(v, n)``
exposes exactly what ``prometheus_client.Histogram`` shows after ``n`` observations of ``v``, and a
batch of tokens that reached the API together is one chunk on the stream and n latency observations."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from serve_support import MODEL_NAME, build_tiny_checkpoint, load_tokenizer
from vexpert_runtime.serve.api import ApiConfig, ServeApi
from vexpert_runtime.serve.events import Event, GenerationRequest, RankLoad
from vexpert_runtime.serve.histogram import CountedHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.1, 1.0)


def _series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """Sample name (labels included) → value, for ``name``'s bucket / sum / count lines."""
    lines = generate_latest(registry).decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith(name) and not line.startswith(name + "_created")}


def test_counted_observations_expose_what_one_by_one_observations_do() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counted = CountedHistogram("lat_seconds", "latency", BUCKETS, ours)
    reference = Histogram("lat_seconds", "latency", buckets=BUCKETS, registry=theirs)
    # values on bucket bounds, between them, below the first and past the last, with counts 0..5
    for value, count in ((0.0, 3), (0.005, 2), (0.0051, 1), (0.1, 5), (0.7, 0), (2.0, 4), (1.0, 1)):
        counted.observe(value, count)
        for _ in range(count):
            reference.observe(value)
    got, want = _series(ours, "lat_seconds"), _series(theirs, "lat_seconds")
    assert got.keys() == want.keys() and len(got) == len(BUCKETS) + 3  # buckets, +Inf, sum, count
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert got['lat_seconds_bucket{le="0.005"}'] == 5 and got["lat_seconds_count"] == 16


def test_buckets_must_ascend() -> None:
    with pytest.raises(ValueError, match="ascending"):
        CountedHistogram("bad_seconds", "x", (0.1, 0.05), CollectorRegistry())
    registry = CollectorRegistry()  # +Inf may be given; it is added when not
    CountedHistogram("ok_seconds", "x", (0.1, math.inf), registry).observe(5.0)
    assert _series(registry, "ok_seconds") == {'ok_seconds_bucket{le="0.1"}': 0, 'ok_seconds_bucket{le="+Inf"}': 1,
                                               "ok_seconds_count": 1, "ok_seconds_sum": 5.0}


class _BatchedDispatcher:
    """Hands a request its events in the given batches (what an EventChannel yields when the API's
    loop falls behind the ranks)."""

    def __init__(self, batches: list[list[Event]]) -> None:
        self.batches = batches

    async def submit(self, request: GenerationRequest) -> AsyncIterator[list[Event]]:
        async def events() -> AsyncIterator[list[Event]]:
            for batch in self.batches:
                yield [Event(request.request_id, e.text, e.new_tokens, e.finish_reason, e.prompt_tokens,
                             e.completion_tokens) for e in batch]
                await asyncio.sleep(0.01)

        return events()

    def cancel(self, request_id: str) -> None:
        pass

    def ready(self) -> str | None:
        return None

    def loads(self) -> list[RankLoad]:
        return [RankLoad()]

    async def shutdown(self, drain_timeout_s: float) -> None:
        pass


def test_a_batch_of_tokens_is_one_chunk_and_one_latency_per_token(tmp_path: Any) -> None:
    build_tiny_checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    batches = [[Event("", "a", 1)], [Event("", "b", 1), Event("", "c", 1), Event("", "d", 1)],
               [Event("", "e", 1), Event("", "", 1, "length", 3, 6)]]
    registry = CollectorRegistry()
    api = ServeApi(_BatchedDispatcher(batches), tokenizer, ApiConfig(MODEL_NAME, 256, 1000, 5.0), registry)

    async def stream() -> list[dict[str, Any]]:
        async with TestClient(TestServer(api.app())) as client:
            response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 6,
                                                                  "stream": True})
            assert response.status == 200
            body = (await response.read()).decode()
        return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]

    chunks = asyncio.run(stream())
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert texts == ["a", "bcd", "e"]  # one chunk per batch, the batch's text in order
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    series = _series(registry, "vexpert_serve_")
    assert series["vexpert_serve_time_to_first_token_seconds_count"] == 1
    assert series["vexpert_serve_inter_token_latency_seconds_count"] == 5  # 6 tokens: the first is the TTFT
    assert series["vexpert_serve_generated_tokens_total"] == 6
    # the zero gaps of a batch's later tokens land in the first bucket; the gaps between batches (>= 10 ms) above it
    assert series['vexpert_serve_inter_token_latency_seconds_bucket{le="0.005"}'] == 3
