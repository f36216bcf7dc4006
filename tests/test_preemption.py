"""KV blocks on demand and preemption (serve/scheduler.py): a rank whose decodes outgrow its KV cache
preempts its newest sequence, which later prefills its prompt and produced tokens again and goes on.

What it must show, with the batched model on CPU (paged cache, sequential and overlapped steps):
greedy tokens of sequences that were preempted equal transformers' ``generate``; seeded sampling
draws the same tokens as on a cache large enough for no preemption; each token reaches the client
once; with prefix caching a re-admitted sequence attaches the blocks it had published; every block
comes back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serve_support import IdText, build_tiny_checkpoint, id_text_tokens, load_model
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

CONTEXT = 256  # the tiny checkpoints' max_position_embeddings: the smallest KV cache a rank accepts
PROMPTS = [list(range(5 + 7 * i, 45 + 7 * i)) for i in range(4)]  # 40 tokens each
NEW_TOKENS = 40  # 4 × 80 tokens = 320 > 256: the decodes outgrow the cache


def _run(directory: Path, kv_tokens: int, overlapped: bool, params: SamplingParams,
         prefix_caching: bool = False) -> tuple[Scheduler, dict[str, list[Event]]]:
    model = HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=kv_tokens, block_size=4)
    model.overlaps_steps = overlapped
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=64, max_running=4, prefix_caching=prefix_caching)
    scheduler = Scheduler(model, IdText(), config)
    events: dict[str, list[Event]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        scheduler.submit(GenerationRequest(f"r{i}", tuple(prompt), params), events[f"r{i}"].append)
    for _ in range(2000):
        if not scheduler.has_work():
            break
        scheduler.run_iteration()
    assert not scheduler.has_work()
    return scheduler, events


def _tokens(events: list[Event]) -> list[int]:
    assert events[-1].finish_reason == "length" and not any(e.error for e in events)
    assert sum(e.new_tokens for e in events) == events[-1].completion_tokens == NEW_TOKENS  # each token once
    return id_text_tokens("".join(e.text for e in events))


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny_checkpoint(directory, request.param)
    return directory, load_model(directory)


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_preempted_sequences_decode_what_generate_decodes(checkpoint: tuple[Path, Any], overlapped: bool) -> None:
    directory, reference = checkpoint
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    scheduler, events = _run(directory, CONTEXT, overlapped, greedy)
    assert scheduler.load().preemptions >= 1
    assert scheduler.pool.used_blocks == 0 and scheduler.load().kv_tokens_used == 0
    for i, prompt in enumerate(PROMPTS):
        x = torch.tensor([prompt])
        expected = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert _tokens(events[f"r{i}"]) == expected.tolist(), f"request {i}"


def test_preemption_draws_the_same_sampled_tokens_and_reattaches_its_published_blocks(
    checkpoint: tuple[Path, Any],
) -> None:
    """Seeded sampling: a token's draw depends on the request's seed and the token's position, not on
    the batch, so a preempted sequence samples what it would have on a cache with room for all. With
    prefix caching, a preempted sequence publishes its full blocks and, re-admitted, attaches them."""
    directory, _ = checkpoint
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    roomy, expected = _run(directory, 4 * CONTEXT, True, sampled)
    assert roomy.load().preemptions == 0
    tight, got = _run(directory, CONTEXT, True, sampled, prefix_caching=True)
    load = tight.load()
    assert load.preemptions >= 1
    assert {r: _tokens(e) for r, e in got.items()} == {r: _tokens(e) for r, e in expected.items()}
    # The prompts share no block, so every hit is a re-admitted sequence attaching its own blocks. The
    # others grow into what it freed until it is re-admitted — its last blocks first (freed last-first,
    # evicted least recently freed first) — so the start of its prompt is what survives.
    assert load.prefix_hit_tokens >= 4
    assert tight.pool.used_blocks == 0


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_penalized_sequences_rebuild_their_penalties_after_preemption(checkpoint: tuple[Path, Any],
                                                                      overlapped: bool) -> None:
    """A preempted sequence, prefilled again, rebuilds its penalty row from the tokens it computes (the
    output counted past its prompt): greedy with a repetition penalty decodes what transformers'
    ``generate(repetition_penalty=…)`` does; sampled with presence and frequency penalties it draws what
    it draws on a cache where nothing is preempted. With prefix caching on, a penalized sequence attaches
    no cached block (its tokens must pass through the model to be counted)."""
    directory, reference = checkpoint
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.4)
    scheduler, events = _run(directory, CONTEXT, overlapped, greedy)
    assert scheduler.load().preemptions >= 1
    plain = []
    for i, prompt in enumerate(PROMPTS):
        x = torch.tensor([prompt])
        expected = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, repetition_penalty=1.4,
                                      max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert _tokens(events[f"r{i}"]) == expected.tolist(), f"request {i}"
        plain.append(reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                        max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(prompt):])
    assert any(_tokens(events[f"r{i}"]) != p.tolist() for i, p in enumerate(plain))  # the penalty changed tokens
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=5, ignore_eos=True, presence_penalty=0.8,
                             frequency_penalty=0.4)
    roomy, expected_events = _run(directory, 4 * CONTEXT, overlapped, sampled)
    tight, got = _run(directory, CONTEXT, overlapped, sampled, prefix_caching=True)
    assert roomy.load().preemptions == 0 and tight.load().preemptions >= 1
    assert {r: _tokens(e) for r, e in got.items()} == {r: _tokens(e) for r, e in expected_events.items()}
    assert tight.load().prefix_hit_tokens == 0 and tight.pool.used_blocks == 0


def test_prompt_log_probabilities_are_reported_once_through_chunks_and_preemption(checkpoint: tuple[Path, Any]) -> None:
    """A request asking for its prompt's log-probabilities (``echo`` with ``logprobs``) gets one per prompt token
    after the first, in order, in its first event with a token — the prompt's chunks computed in several
    steps, and a preempted sequence prefilling again reporting none twice — each transformers' log-softmax
    given the tokens before it, with the k most likely tokens' and its rank; prefix caching attaches no block for it."""
    directory, reference = checkpoint
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=3)
    scheduler, events = _run(directory, CONTEXT, True, params, prefix_caching=True)
    assert scheduler.load().preemptions >= 1 and scheduler.load().prefix_hit_tokens == 0
    for i, prompt in enumerate(PROMPTS):
        got = [entry for event in events[f"r{i}"] if event.logprobs for entry in event.logprobs.prompt]
        first = next(event for event in events[f"r{i}"] if event.new_tokens)
        assert first.logprobs is not None and tuple(got) == first.logprobs.prompt  # all in the first event with a token
        with torch.no_grad():
            expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        assert [entry.token for entry in got] == prompt[1:]
        assert [entry.logprob for entry in got] == pytest.approx(
            [float(expected[p, t]) for p, t in enumerate(prompt[1:])], abs=1e-4)
        for p, entry in enumerate(got):
            values, ids = expected[p].topk(3)
            assert [token for token, _ in entry.top] == ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert entry.rank == int((expected[p] >= expected[p, entry.token]).sum())  # vLLM's rank of the token
