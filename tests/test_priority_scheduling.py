"""Priority scheduling (``vexpert serve --scheduling-policy priority``, vLLM's): serve/waiting_queue.py, the
scheduler's admission and preemption order, the API's ``priority`` field and the CRD's ``schedulingPolicy``.

What it must show: under ``priority`` waiting requests are admitted by (priority, arrival) and the KV cache's
victim is the least urgent running sequence; under ``fcfs`` (the default) nothing changes — arrival order, the
newest preempted — and a request's ``priority`` other than 0 is a 400 naming it (vLLM refuses it too); every
request still gets exactly its own tokens (the property test in test_scheduler_properties.py runs both policies).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from serve_support import IdText, build_tiny_checkpoint, id_text_tokens, load_model, make_server
from test_scheduler_properties import BLOCK, CONTEXT, PagedStandIn, expected_tokens
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.waiting_queue import WaitingQueue, order_key


def test_the_waiting_queue_orders_by_the_policys_key_and_removes_any_item() -> None:
    arrivals = [("a", 3), ("b", -1), ("c", 3), ("d", 0), ("e", -1)]  # (name, priority), in arrival order
    for policy, expected in (("fcfs", "abcde"), ("priority", "bedac")):
        queue: WaitingQueue[str] = WaitingQueue()
        for arrival, (name, priority) in enumerate(arrivals):
            queue.push(order_key(policy, priority, arrival), name)
        assert "".join(queue) == expected and len(queue) == 5
        assert queue.remove("d") and not queue.remove("d")
        assert "".join(queue.pop() for _ in range(len(queue))) == expected.replace("d", "")
        assert not queue


def test_an_unknown_policy_is_refused_naming_the_field() -> None:
    config = SchedulerConfig(kv_budget_tokens=None, scheduling_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(VExpertInputError, match=r"scheduling_policy: 'lifo' is not a scheduling policy.*fcfs, priority"):
        config.check(CONTEXT)


def _serve(policy: str, requests: list[tuple[str, list[int], int, int]], blocks: int, max_running: int
           ) -> tuple[list[str], dict[str, list[Event]], Scheduler]:
    """Run (request id, prompt, max tokens, priority) — all submitted before the first iteration — to the end on
    the paged stand-in; returns the request ids in the order they finished, their events and the scheduler."""
    model = PagedStandIn(blocks, overlaps_steps=False)
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=16, max_running=max_running,
                             scheduling_policy=policy)  # type: ignore[arg-type]
    scheduler = Scheduler(model, IdText(), config)
    events: dict[str, list[Event]] = {}
    finished: list[str] = []

    def sink(rid: str, event: Event) -> None:
        events[rid].append(event)
        if event.finished:
            finished.append(rid)

    for rid, prompt, max_tokens, priority in requests:
        events[rid] = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        scheduler.submit(GenerationRequest(rid, tuple(prompt), params, priority=priority),
                         lambda e, rid=rid: sink(rid, e))
    for _ in range(1000):
        if not scheduler.has_work():
            break
        scheduler.run_iteration()
    for rid, prompt, max_tokens, _ in requests:  # whatever the order, each request's own tokens
        assert id_text_tokens("".join(e.text for e in events[rid])) == expected_tokens(prompt, max_tokens), rid
    assert scheduler.pool.used_blocks == 0
    return finished, events, scheduler


def test_one_running_slot_serves_waiting_requests_by_priority_then_arrival() -> None:
    requests = [("r0", [1, 2], 4, 5), ("r1", [2, 0], 4, 5), ("r2", [0, 1], 4, -3), ("r3", [1, 1], 4, 0)]
    order, _, _ = _serve("priority", requests, blocks=CONTEXT // BLOCK + 1, max_running=1)
    assert order == ["r2", "r3", "r0", "r1"]
    order, _, _ = _serve("fcfs", requests, blocks=CONTEXT // BLOCK + 1, max_running=1)
    assert order == ["r0", "r1", "r2", "r3"]


def test_a_full_cache_preempts_the_least_urgent_sequence_not_the_newest() -> None:
    """Two sequences that outgrow a one-context cache together: the first to arrive is the less urgent. First
    come first served preempts the newer one (the first finishes first); by priority the less urgent one."""
    requests = [("low", [1, 2, 0, 1], 24, 1), ("high", [2, 2, 1, 0], 24, 0)]
    blocks = CONTEXT // BLOCK + 1  # 8 usable blocks: 32 tokens, the two need 56
    order, _, fcfs = _serve("fcfs", requests, blocks, max_running=2)
    assert fcfs.load().preemptions >= 1 and order == ["low", "high"]
    order, _, by_priority = _serve("priority", requests, blocks, max_running=2)
    assert by_priority.load().preemptions >= 1 and order == ["high", "low"]


# ---- through the API ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-priority")
    build_tiny_checkpoint(directory)
    return directory, load_model(directory)


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url + path, json=body) as response:
        return response.status, await response.json()


def test_a_priority_other_than_0_is_refused_first_come_first_served(checkpoint: tuple[Path, Any]) -> None:
    server = make_server(*checkpoint)
    try:
        async def requests() -> list[tuple[int, Any]]:
            async with aiohttp.ClientSession() as session:
                base = {"model": "tiny-qwen3-moe", "max_tokens": 2}
                return [
                    await _post(session, server.url, "/v1/completions", {**base, "prompt": "hi", "priority": 1}),
                    await _post(session, server.url, "/v1/chat/completions",
                                {**base, "messages": [{"role": "user", "content": "hi"}], "priority": -2}),
                    await _post(session, server.url, "/v1/responses", {"model": "tiny-qwen3-moe", "input": "hi",
                                                                       "max_output_tokens": 2, "priority": 7}),
                    await _post(session, server.url, "/v1/completions", {**base, "prompt": "hi", "priority": True}),
                    await _post(session, server.url, "/v1/completions", {**base, "prompt": "hi", "priority": 0}),
                    await _post(session, server.url, "/v1/completions", {**base, "prompt": "hi", "priority": None}),
                ]
        answers = server.run(requests())
    finally:
        server.close()
    for status, body in answers[:3]:
        assert status == 400 and body["error"]["param"] == "priority", body
        assert "--scheduling-policy priority" in body["error"]["message"]
    assert answers[3][0] == 400 and answers[3][1]["error"]["param"] == "priority"  # a boolean is not an integer
    assert [status for status, _ in answers[4:]] == [200, 200]


def test_requests_queued_behind_a_running_one_finish_by_priority(checkpoint: tuple[Path, Any]) -> None:
    """One running slot, the model held at its first step: three requests queue (priorities 4, 0, −1, in that
    order of arrival, one of them through the Responses API); released, they finish by priority."""
    server = make_server(*checkpoint, max_running=1, scheduling_policy="priority")
    server.model.gate = gate = threading.Event()
    finished: list[str] = []
    try:
        async def requests() -> None:
            async with aiohttp.ClientSession() as session:
                async def send(name: str, priority: int, responses: bool = False) -> None:
                    if responses:
                        body: dict[str, Any] = {"model": "tiny-qwen3-moe", "input": "hello", "max_output_tokens": 3,
                                                "priority": priority}
                    else:
                        body = {"model": "tiny-qwen3-moe", "prompt": "hello", "max_tokens": 3, "priority": priority,
                                "ignore_eos": True}
                    status, answer = await _post(session, server.url, "/v1/responses" if responses
                                                 else "/v1/completions", body)
                    assert status == 200, answer
                    finished.append(name)

                first = asyncio.ensure_future(send("first", 9))
                while server.dispatcher.scheduler.load().running < 1:  # admitted, its step held by the gate
                    await asyncio.sleep(0.01)
                later = []
                for name, priority, responses in (("p4", 4, False), ("p0", 0, True), ("m1", -1, False)):
                    later.append(asyncio.ensure_future(send(name, priority, responses)))
                    while server.dispatcher.scheduler.load().waiting < len(later):  # arrived in this order
                        await asyncio.sleep(0.01)
                gate.set()
                await asyncio.gather(first, *later)
        server.run(requests())
    finally:
        gate.set()
        server.close()
    assert finished == ["first", "m1", "p0", "p4"]


def test_a_requests_time_on_its_rank_splits_into_queue_prefill_and_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's request_{queue,prefill,decode}_time_seconds, on the scheduler's clock (one second a model step here): with
    one batch slot the second request waits for the first to finish; each then takes a step to its first token and two
    to its last (3 tokens)."""
    from types import SimpleNamespace

    from vexpert_runtime.serve import scheduler as scheduler_module

    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    step = PagedStandIn.step

    def timed_step(self: PagedStandIn, work: Any) -> Any:
        clock[0] += 1.0
        return step(self, work)

    monkeypatch.setattr(PagedStandIn, "step", timed_step)
    _, events, _ = _serve("fcfs", [("r0", [1, 2], 3, 0), ("r1", [2, 0], 3, 0)], blocks=CONTEXT // BLOCK + 1,
                          max_running=1)
    phases = {rid: events[rid][-1].usage_details for rid in events}
    assert all(details is not None for details in phases.values())
    assert [(d.queue_seconds, d.prefill_seconds, d.decode_seconds) for d in phases.values()] == [  # type: ignore[union-attr]
        (0.0, 1.0, 2.0), (3.0, 1.0, 2.0)]
    assert all(d.cached_tokens is None and d.reasoning_tokens is None for d in phases.values())  # type: ignore[union-attr]
