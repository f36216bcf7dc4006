"""Prefix caching (``vexpert serve --prefix-caching``; serve/kv_cache.py, serve/scheduler.py): a prompt that
starts with whole blocks another prompt computed attaches them instead of computing them again.

The pool: digests name a block by its tokens and every token before it; attached blocks are shared
(counted per holder), a published block nobody holds stays cached until the pool needs the room (least
recently freed first), and a failed step unpublishes all.
The batched model on CPU: greedy tokens of prompts that attach cached blocks (part of the prompt, all
but its last token, or another request's prompt and output: a chat's next turn) equal transformers'
``generate``, and the ranks count the tokens they skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serve_support import IdText, build_tiny_checkpoint, id_text_tokens, load_model
from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.kv_cache import BlockPool, KVCacheFull, token_block_digests
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig


def test_digests_name_a_block_by_its_tokens_and_everything_before_it() -> None:
    a = token_block_digests(list(range(10)), 4)
    assert len(a) == 2  # two full blocks; the last two tokens are not a block
    b = token_block_digests([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], 4)
    assert b[0] == a[0] and b[1] != a[1] and len(b) == 3
    c = token_block_digests([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert c[1] != a[1]  # the same tokens after a different first block: another prefix
    assert token_block_digests(list(range(4, 12)), 4, parent=a[0]) == token_block_digests(list(range(12)), 4)[1:]


def test_blocks_are_shared_cached_and_evicted() -> None:
    pool = BlockPool(num_blocks=9, block_size=4)  # 8 usable
    digests = token_block_digests(list(range(12)), 4)
    pool.add(1)
    owner = list(pool.grow(1, 12))
    pool.publish(1, digests)
    pool.free(1)
    assert pool.cached_blocks == 3 and pool.free_blocks == 8 and pool.used_blocks == 0
    pool.add(2)
    assert pool.attach_prefix(2, digests[:2]) == 2 and pool.table(2) == owner[:2]
    pool.add(3)
    assert pool.attach_prefix(3, digests) == 3 and pool.table(3) == owner  # shares the first two with 2
    assert pool.cached_blocks == 0 and pool.used_blocks == 3
    pool.free(2)  # its two blocks are still held by 3: neither cached nor free
    assert pool.cached_blocks == 0 and pool.used_blocks == 3
    pool.free(3)
    assert pool.cached_blocks == 3 and (pool.hit_tokens, pool.query_tokens) == (20, 20)
    # the pool needs every block: the cached ones are taken, least recently freed first, and forgotten
    pool.add(4)
    taken = pool.grow(4, 32)
    assert sorted(taken) == list(range(1, 9)) and pool.cached_blocks == 0
    with pytest.raises(KVCacheFull):
        pool.grow(4, 33)
    pool.free(4)
    pool.add(5)
    assert pool.attach_prefix(5, digests) == 0  # evicted: nothing to attach
    pool.grow(5, 8)
    pool.publish(5, digests[:2])
    pool.free(5)
    pool.forget_published()  # a failed step: nothing cached is trusted
    pool.add(6)
    assert pool.attach_prefix(6, digests) == 0 and pool.free_blocks == 8


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_prompts_that_attach_cached_blocks_decode_what_generate_decodes(tmp_path: Path, family: str) -> None:
    build_tiny_checkpoint(tmp_path, family)
    reference = load_model(tmp_path)
    model = HFStepModel(tmp_path, dtype=torch.float32, kv_cache_tokens=512, block_size=4)
    model.overlaps_steps = True
    prompt_len = {0: 17, 1: 15, 2: 17, 3: 25}  # by sequence id: in the order submitted below
    computed: list[int] = []  # prompt tokens each launch computed
    launch = model.launch
    model.launch = lambda work: (computed.append(sum(  # type: ignore[method-assign]
        sum(1 for i in range(len(w.tokens)) if w.position + i < prompt_len[w.seq_id]) for w in work)), launch(work))[1]
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=8, max_running=4, prefix_caching=True)
    scheduler = Scheduler(model, IdText(), config)
    shared = list(range(5, 18))  # 13 tokens: 3 whole blocks of 4
    prompts = {"first": [*shared, 40, 41, 42, 43], "other_suffix": [*shared, 50, 51], "same": [*shared, 40, 41, 42, 43]}
    new_tokens = {"first": 6, "other_suffix": 5, "same": 6}
    texts: dict[str, list[str]] = {name: [] for name in prompts}
    details: dict[str, Any] = {}  # each request's last event's usage details

    def submit(name: str) -> None:
        def sink(event: Any) -> None:
            texts[name].append(event.text)
            if event.finished:
                details[name] = event.usage_details

        scheduler.submit(GenerationRequest(name, tuple(prompts[name]), SamplingParams(
            max_tokens=new_tokens[name], temperature=0, ignore_eos=True)), sink)

    submit("first")
    while scheduler.has_work():
        scheduler.run_iteration()
    computed_first = sum(computed)
    # a chat's next turn: the first prompt, its output, two more tokens; its KV was written for the prompt
    # and the first 5 output tokens (the 6th ended it): 22 tokens, 5 whole blocks to attach
    first_output = id_text_tokens("".join(texts["first"]))
    prompts["continues"] = [*prompts["first"], *first_output, 70, 71]
    new_tokens["continues"], texts["continues"] = 4, []
    submit("other_suffix")  # attaches 3 blocks (12 tokens), computes 3
    submit("same")  # attaches all 4 whole blocks, computes only its last prompt token
    submit("continues")  # attaches 5 blocks (20 tokens), computes 5
    while scheduler.has_work():
        scheduler.run_iteration()
    for name, prompt in prompts.items():
        x = torch.tensor([prompt])
        expected = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=new_tokens[name], eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        got = id_text_tokens("".join(texts[name]))
        assert got == expected.tolist(), name
    load = scheduler.load()
    assert (load.prefix_hit_tokens, load.prefix_query_tokens) == (12 + 16 + 20, 16 + 12 + 16 + 24)
    assert scheduler.pool.used_blocks == 0 and scheduler.pool.cached_blocks > 0
    assert computed_first == 17 and sum(computed) - computed_first == 3 + 1 + 5  # 57 without the cache
    # each request's usage names the prompt tokens the cache served (OpenAI's prompt_tokens_details)
    assert {name: d.cached_tokens for name, d in details.items()} == {
        "first": 0, "other_suffix": 12, "same": 16, "continues": 20}
    assert all(d.reasoning_tokens is None for d in details.values())


def test_a_cache_salt_shares_cached_blocks_only_with_prompts_of_the_same_salt(tmp_path: Path) -> None:
    """vLLM's ``cache_salt``: the salt seeds the prompt's first block digest, so a prompt attaches cached blocks only
    from prompts of its own salt (another tenant cannot tell a prompt by its cache hits); the usage says so."""
    build_tiny_checkpoint(tmp_path)
    model = HFStepModel(tmp_path, dtype=torch.float32, kv_cache_tokens=512, block_size=4)
    scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=32, max_running=4,
                                                           prefix_caching=True))
    prompt = tuple(range(5, 22))  # 17 tokens: 4 whole blocks, all attachable
    cached: dict[str, int] = {}

    def run(name: str, salt: str | None) -> None:
        def sink(event: Any) -> None:
            if event.finished:
                cached[name] = event.usage_details.cached_tokens

        scheduler.submit(GenerationRequest(name, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                        cache_salt=salt)), sink)
        while scheduler.has_work():
            scheduler.run_iteration()

    for name, salt in (("alice", "a-secret"), ("bob", "b-secret"), ("no salt", None), ("alice again", "a-secret"),
                       ("no salt again", None)):
        run(name, salt)
    assert cached == {"alice": 0, "bob": 0, "no salt": 0, "alice again": 16, "no salt again": 16}
