"""vLLM's ``bad_words``: the API tokenizes each word as vLLM does (:func:`~vexpert_runtime.serve.prompts.bad_word_ids`),
the scheduler bans a one-token word outright and a longer word's last token where the output ends with the rest
(:func:`~vexpert_runtime.serve.scheduler.banned_next`) — greedy tokens equal a reference decode that bans the same
tokens by hand, with overlapped steps too, and the other sequences of the batch are left alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("transformers")

from serve_support import (
    MODEL_NAME,
    build_tiny_checkpoint,
    load_model,
    load_tokenizer,
    make_server,
    serve_with_scheduler,
)
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.prompts import bad_word_ids
from vexpert_runtime.serve.scheduler import banned_next, split_bad_words


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny_checkpoint(directory, request.param)
    return directory, load_model(directory), load_tokenizer(directory)


def test_a_longer_words_last_token_is_banned_only_after_the_rest() -> None:
    words = ((5, 6, 7), (9, 7))
    assert banned_next([], words) == [] and banned_next([5], words) == []
    assert banned_next([1, 5, 6], words) == [7] and banned_next([9], words) == [7]
    assert banned_next([5, 6, 1], words) == [] and banned_next([6], words) == []
    bias, multi = split_bad_words(((3, 1.5), (8, -2.0)), ((4,), (5, 6, 7), (8,)))
    assert bias == ((3, 1.5), (4, float("-inf")), (8, float("-inf"))) and multi == ((5, 6, 7),)


def test_bad_words_tokenize_as_at_the_start_and_inside_a_text(checkpoint: tuple[Path, Any, Any]) -> None:
    _, _, tokenizer = checkpoint
    for word in ("fox", " quick brown", "jumps"):
        sequences = bad_word_ids([word], tokenizer)
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        assert sequences[0] == alone
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        assert sequences[1:] == ((spaced,) if len(spaced) == len(alone) and spaced[0] != alone[0] else ())
        assert all(tokenizer.decode(list(ids)).strip() == word.strip() for ids in sequences)


def _reference(model: Any, prompt: Sequence[int], bad_words: tuple[tuple[int, ...], ...], max_tokens: int) -> list[int]:
    """Greedy decoding with the bans written out: transformers' logits over the whole sequence, −inf on each word's
    last token where the output ends with the rest of it, the argmax."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        for word in bad_words:
            if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == list(word[:-1]):
                logits[word[-1]] = float("-inf")
        token = int(logits.argmax())
        ids.append(token)
        out.append(token)
    return out


def _tokens(events: list[Event], tokenizer: Any) -> list[int]:
    assert not any(e.error for e in events), [e.error for e in events]
    return list(tokenizer.encode("".join(e.text for e in events), add_special_tokens=False))


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_greedy_output_with_bad_words_is_the_reference_decode(checkpoint: tuple[Path, Any, Any], overlapped: bool
                                                              ) -> None:
    directory, model, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True)
    plain = serve_with_scheduler(directory, tokenizer, [GenerationRequest("free", prompt, free)], overlapped)["free"]
    output = [t for e in plain for t in getattr(e, "token_ids", ())]
    assert len(output) == 16
    # a pair the free output writes, a token it writes later, and a three-token word it never completes
    bad = ((output[2], output[3]), (output[6],), (output[0], output[1], 0 if output[2] else 1))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True, bad_words=bad)
    events = serve_with_scheduler(directory, tokenizer, [GenerationRequest("banned", prompt, params),
                                                         GenerationRequest("free", prompt, free)], overlapped)
    banned = [t for e in events["banned"] for t in getattr(e, "token_ids", ())]
    assert banned == _reference(model, prompt, bad, 16)
    assert banned != output and output[6] not in banned
    assert not any(banned[i:i + 2] == [output[2], output[3]] for i in range(len(banned) - 1))
    assert [t for e in events["free"] for t in getattr(e, "token_ids", ())] == output  # the batch's other sequence


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe-bad-words")
    build_tiny_checkpoint(directory)
    model = load_model(directory)
    srv = make_server(directory, model, model=HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=1024),
                      kv_budget_tokens=1024)
    yield srv, load_tokenizer(directory)
    srv.close()


def _holds(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


def test_bad_words_through_the_api(served: tuple[Any, Any]) -> None:
    """A word the free completion writes — as one of the token sequences vLLM bans for it — is not written once
    banned, and the completion differs; a blank word is a 400 naming ``bad_words``."""
    server, tokenizer = served
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    free = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    candidates = [(word, bad_word_ids([word], tokenizer)) for word in free["text"].split()]
    written = [(word, sequences) for word, sequences in candidates
               if any(_holds(free["token_ids"], ids) for ids in sequences)]
    assert written, free["text"]
    word, sequences = written[0]
    answer = httpx.post(f"{server.url}/v1/completions", json={**body, "bad_words": [word]}, timeout=30).json()
    choice = answer["choices"][0]
    assert choice["token_ids"] != free["token_ids"] and len(choice["token_ids"]) == 12
    assert not any(_holds(choice["token_ids"], ids) for ids in sequences)
    error = httpx.post(f"{server.url}/v1/completions", json={**body, "bad_words": ["  "]}, timeout=10)
    assert error.status_code == 400 and error.json()["error"]["param"] == "bad_words"
