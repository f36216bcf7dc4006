"""Overlapped steps (serve/step.py): the scheduler launches step i+1 before it reads step i.

The CPU twin of what CUDA graphs do on a GPU: the same scheduler protocol (``fed`` decodes read the
previous step's sampled ids on the device, a stopped sequence's row in the next step is wasted and its
blocks return only after it), with a model whose launch computes at once. What it must show: the
same tokens, texts and finish reasons as the sequential scheduler, every block back, the release
only once the last step holding a sequence is done — and, with the real batched model, greedy tokens
equal to transformers' ``generate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serve_support import (
    IdText,
    RecomputeStepModel,
    build_tiny_checkpoint,
    id_text_tokens,
    load_model,
    load_tokenizer,
)
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.step import SequenceWork


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-overlap")
    build_tiny_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return load_tokenizer(checkpoint)


def _requests(stop: tuple[str, ...] = ()) -> list[GenerationRequest]:
    greedy = [GenerationRequest(f"g{i}", tuple(range(3 + i, 10 + 2 * i)), SamplingParams(max_tokens=4 + 3 * i, temperature=0))
              for i in range(3)]
    sampled = GenerationRequest("t", (7, 8, 9, 10, 11), SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8,
                                                                       seed=123))
    stopping = GenerationRequest("s", (20, 21, 22), SamplingParams(max_tokens=12, temperature=0, stop=stop))
    return [*greedy, sampled, stopping]


def _serve(model: RecomputeStepModel, tokenizer: Any, requests: list[GenerationRequest],
           cancel: tuple[str, int] | None = None) -> tuple[Scheduler, dict[str, list[Event]]]:
    """Submit every request at once (max 5 tokens a step: prompts are chunked) and run to the end;
    ``cancel`` = (request, iteration) cancels one mid-way."""
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(kv_budget_tokens=400, max_batch_tokens=6, max_running=5),
                          frozenset({int(tokenizer.eos_token_id)}))
    events: dict[str, list[Event]] = {r.request_id: [] for r in requests}
    for request in requests:
        scheduler.submit(request, events[request.request_id].append)
    iteration = 0
    while scheduler.has_work():
        if cancel is not None and iteration == cancel[1]:
            scheduler.cancel(cancel[0])
        scheduler.run_iteration()
        iteration += 1
        assert iteration < 200
    return scheduler, events


def _outcome(events: list[Event]) -> tuple[str, str | None, int]:
    last = events[-1]
    assert last.finished and all(not e.finished for e in events[:-1])
    return "".join(e.text for e in events), last.finish_reason, last.completion_tokens


def _fed(model: RecomputeStepModel) -> list[SequenceWork]:
    return [item for step in model.steps for item in step if item.fed is not None]


def test_overlapped_steps_serve_what_sequential_steps_serve(hf_model: Any, tokenizer: Any) -> None:
    sequential = RecomputeStepModel(hf_model)
    _, reference = _serve(sequential, tokenizer, _requests())
    text = _outcome(reference["s"])[0]
    assert len(text) >= 4
    stop = (text[2:4],)  # a stop string the request meets mid-way (held back, then cut)

    sequential = RecomputeStepModel(hf_model)
    _, expected = _serve(sequential, tokenizer, _requests(stop))
    overlapped = RecomputeStepModel(hf_model, overlaps_steps=True)
    scheduler, got = _serve(overlapped, tokenizer, _requests(stop))

    assert {r: _outcome(e) for r, e in got.items()} == {r: _outcome(e) for r, e in expected.items()}
    assert _outcome(got["s"])[1] == "stop"
    assert not _fed(sequential)
    assert len(_fed(overlapped)) >= 20  # decodes ran before the host read their tokens
    assert sorted(overlapped.released) == sorted(sequential.released) == list(range(5))
    assert scheduler.pool.used_blocks == 0
    # a sequence is never scheduled past its length limit: as many decodes as sequentially
    assert sum(len(s) for s in overlapped.steps) <= sum(len(s) for s in sequential.steps) + 1


def test_a_stopped_sequence_keeps_its_blocks_until_the_step_holding_it_is_done(hf_model: Any, tokenizer: Any) -> None:
    """Cancelled while a launched step holds it: the finish event goes out at once, the sequence is
    not scheduled again, and its blocks return only once that step is read (a reuse before would let
    the step write into another sequence's cache)."""
    model = RecomputeStepModel(hf_model, overlaps_steps=True)
    released_after: dict[int, int] = {}
    release = model.release

    def recording_release(seq_id: int) -> None:
        released_after[seq_id] = len(model.steps)  # steps launched when the blocks came back
        release(seq_id)

    model.release = recording_release  # type: ignore[method-assign]
    scheduler, events = _serve(model, tokenizer, _requests(), cancel=("g2", 8))
    assert _outcome(events["g2"])[1] == "abort"
    holding = [i for i, step in enumerate(model.steps) if any(w.seq_id == 2 for w in step)]
    # iteration 8 launches step 8 and then reads step 7, the one in flight at the cancel
    assert holding[-1] == 7
    assert released_after[2] == 9
    assert scheduler.pool.used_blocks == 0 and sorted(model.released) == list(range(5))


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_overlapped_batched_model_matches_generate(tmp_path: Path, family: str) -> None:
    """The batched model (paged cache, batched attention) with overlapped steps: greedy tokens of
    sequences joining, chunked and leaving equal ``generate`` one prompt at a time."""
    build_tiny_checkpoint(tmp_path, family)
    reference = load_model(tmp_path)
    model = HFStepModel(tmp_path, dtype=torch.float32, kv_cache_tokens=512, block_size=4)
    model.overlaps_steps = True
    scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=7, max_running=4))
    prompts = [list(range(5, 12)), list(range(30, 33)), list(range(40, 53))]
    new_tokens = [6, 9, 4]
    texts: dict[str, list[str]] = {f"r{i}": [] for i in range(len(prompts))}
    iteration = 0
    while iteration < 2 * len(prompts) or scheduler.has_work():
        if iteration % 2 == 0 and iteration // 2 < len(prompts):  # joins at iterations 0, 2, 4
            i = iteration // 2
            scheduler.submit(GenerationRequest(f"r{i}", tuple(prompts[i]),
                                               SamplingParams(max_tokens=new_tokens[i], temperature=0, ignore_eos=True)),
                             lambda e, rid=f"r{i}": texts[rid].append(e.text))
        scheduler.run_iteration()
        iteration += 1
    for i, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        expected = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=new_tokens[i], eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        got = id_text_tokens("".join(texts[f"r{i}"]))
        assert got == expected.tolist(), f"request {i}"
    assert scheduler.pool.used_blocks == 0


def test_a_failed_step_ends_its_sequences_and_the_one_in_flight_and_the_rank_goes_on(hf_model: Any,
                                                                                     tokenizer: Any) -> None:
    """Overlapped: step i+1 fails at launch while step i is in flight — every sequence of both ends
    with an error event, every block returns, and a later request is served."""
    model = RecomputeStepModel(hf_model, overlaps_steps=True)
    step = model.step
    calls = {"n": 0}

    def failing_step(work: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("device lost")
        return step(work)

    model.step = failing_step  # type: ignore[method-assign]
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(kv_budget_tokens=400, max_batch_tokens=6, max_running=5))
    events: dict[str, list[Event]] = {}
    for request in _requests()[:3]:
        events[request.request_id] = []
        scheduler.submit(request, events[request.request_id].append)
    with pytest.raises(RuntimeError, match="device lost"):
        while scheduler.has_work():
            scheduler.run_iteration()
    assert {r: e[-1].finish_reason for r, e in events.items()} == {"g0": "error", "g1": "error", "g2": "error"}
    assert all("device lost" in (e[-1].error or "") for e in events.values())
    assert scheduler.pool.used_blocks == 0 and not scheduler.has_work()
    after: list[Event] = []
    scheduler.submit(GenerationRequest("later", (5, 6, 7), SamplingParams(max_tokens=3, temperature=0)), after.append)
    while scheduler.has_work():
        scheduler.run_iteration()
    assert after[-1].finish_reason == "length" and after[-1].completion_tokens == 3
