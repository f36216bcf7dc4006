"""Property test of one rank's scheduler over a paged KV cache (serve/scheduler.py, serve/kv_cache.py).

Random requests (prompts from a small alphabet, so prefixes repeat) arrive at random iterations into a
small cache, some are cancelled, with and without overlapped steps and prefix caching, first come first served
or by random priorities (``--scheduling-policy priority``: another admission and preemption order). The model is a
paged stand-in: it writes each token id into its cache slot (the block table's), and its next token
is a function of every token it *reads back* through the block table — so a block freed, reused or
shared wrongly, a preemption that loses a token or a prefix attached at the wrong place changes what
a request produces. What must hold: every request ends once; an uncancelled one produces exactly the
tokens a reference computes from its prompt alone (however often it was preempted); no grow ever
fails; every block is back at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_support import IdText, id_text_tokens
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.step import FinishedStep, PendingStep, SequenceWork
from vexpert_runtime.serve.waiting_queue import SchedulingPolicy

VOCAB = 40
BLOCK = 4
CONTEXT = 32


def next_token(tokens: Sequence[int]) -> int:
    """The stand-in model's "forward": a token from every token before it, position-weighted."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


class PagedStandIn:
    """A StepModel whose KV cache holds token ids, read back through the block tables."""

    vocab_size = VOCAB
    max_context = CONTEXT
    kv_block_size = BLOCK
    kv_cache_bytes = 0

    def __init__(self, num_blocks: int, overlaps_steps: bool) -> None:
        self.kv_num_blocks = num_blocks
        self.overlaps_steps = overlaps_steps
        self.slots: dict[int, int] = {}
        self.last_sampled: list[int] = []

    def kv_bytes_per_token(self) -> int:
        return 1

    def _slot(self, blocks: tuple[int, ...], position: int) -> int:
        return blocks[position // BLOCK] * BLOCK + position % BLOCK

    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        out = []
        for item in work:
            assert len(item.blocks) * BLOCK >= item.position + len(item.tokens)
            assert 0 not in item.blocks, "the scratch block is never a sequence's"
            tokens = [self.last_sampled[item.fed]] if item.fed is not None else list(item.tokens)
            for offset, token in enumerate(tokens):
                self.slots[self._slot(item.blocks, item.position + offset)] = token
            if item.sample is None:
                out.append(-1)
            else:
                end = item.position + len(tokens)
                out.append(next_token([self.slots[self._slot(item.blocks, p)] for p in range(end)]))
        self.last_sampled = [t for t, item in zip(out, work, strict=True) if item.sample is not None]
        return torch.tensor(out, dtype=torch.int64)

    def launch(self, work: Sequence[SequenceWork]) -> PendingStep:
        return FinishedStep(self.step(work))

    def release(self, seq_id: int) -> None:
        pass


def expected_tokens(prompt: Sequence[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2), min_size=1, max_size=20),  # prompt: 3 letters, so prefixes repeat
        st.integers(1, 12),  # max_tokens (capped by the context below)
        st.integers(0, 12),  # arrival iteration
        st.one_of(st.none(), st.integers(0, 40)),  # cancelled at this iteration, or not
        st.integers(-2, 2),  # priority (its order only under the priority policy)
    ),
    min_size=1, max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(requests=requests, extra_blocks=st.integers(0, 8), max_batch_tokens=st.integers(6, 16),
       max_running=st.integers(1, 6), overlapped=st.booleans(), prefix_caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_every_request_gets_its_own_tokens_whatever_the_cache_does(
    requests: list[tuple[list[int], int, int, int | None, int]], extra_blocks: int, max_batch_tokens: int,
    max_running: int, overlapped: bool, prefix_caching: bool, policy: SchedulingPolicy,
) -> None:
    # one context (8 blocks) + scratch is the smallest cache a rank accepts
    model = PagedStandIn(CONTEXT // BLOCK + 1 + extra_blocks, overlapped)
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=max(max_batch_tokens, max_running),
                             max_running=max_running, max_waiting=64, prefix_caching=prefix_caching,
                             scheduling_policy=policy)
    scheduler = Scheduler(model, IdText(), config)
    events: dict[str, list[Event]] = {}
    specs: dict[str, tuple[list[int], int, int | None]] = {}
    for i, (prompt, max_tokens, _, cancel, _) in enumerate(requests):
        specs[f"r{i}"] = (prompt, min(max_tokens, CONTEXT - len(prompt)), cancel)
    iteration = 0
    while iteration <= 12 or scheduler.has_work():
        for i, (prompt, _, arrival, _, priority) in enumerate(requests):
            rid = f"r{i}"
            if arrival == iteration:
                events[rid] = []
                params = SamplingParams(max_tokens=specs[rid][1], temperature=0, ignore_eos=True)
                scheduler.submit(GenerationRequest(rid, tuple(prompt), params, priority=priority), events[rid].append)
            if specs[rid][2] == iteration and rid in events:
                scheduler.cancel(rid)
        scheduler.run_iteration()
        iteration += 1
        assert iteration < 3000, "the scheduler stopped making progress"
    load = scheduler.load()
    for rid, got in events.items():
        prompt, max_tokens, cancel = specs[rid]
        finished = [e for e in got if e.finished]
        assert len(finished) == 1 and got[-1].finished, (rid, got)
        tokens = id_text_tokens("".join(e.text for e in got))
        assert sum(e.new_tokens for e in got) == len(tokens)
        if got[-1].finish_reason == "abort":
            assert cancel is not None
            assert tokens == expected_tokens(prompt, max_tokens)[: len(tokens)], rid
        else:
            assert got[-1].finish_reason == "length", (rid, got[-1])
            assert tokens == expected_tokens(prompt, max_tokens), (rid, prompt, load)
    assert scheduler.pool.used_blocks == 0 and load.kv_tokens_used == 0
    assert load.running == 0 and load.waiting == 0


def test_a_tight_cache_preempts_and_still_serves_every_token() -> None:
    """A concrete case of the property that must preempt: 4 requests of 8 + 16 tokens on a 9-block cache."""
    model = PagedStandIn(CONTEXT // BLOCK + 1, overlaps_steps=True)
    scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=16, max_running=4))
    events: dict[str, list[Event]] = {}
    prompts = [[i % 3, 1, 2, 0, 1, 2, i, 1] for i in range(4)]
    for i, prompt in enumerate(prompts):
        events[f"r{i}"] = []
        scheduler.submit(GenerationRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=16, temperature=0)),
                         events[f"r{i}"].append)
    while scheduler.has_work():
        scheduler.run_iteration()
    assert scheduler.load().preemptions >= 2
    for i, prompt in enumerate(prompts):
        assert id_text_tokens("".join(e.text for e in events[f"r{i}"])) == expected_tokens(prompt, 16)
