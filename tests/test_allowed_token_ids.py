"""vLLM's ``allowed_token_ids``: every other token's logit is −inf (written once into the sequence's logit-bias row,
:mod:`vexpert_runtime.serve.penalties`), so greedy tokens are the argmax over the allowed ones, every sampling mode
draws only them, a grammar's mask narrows them further, and the other sequences of a batch are left alone."""

from __future__ import annotations

import re
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
from vexpert_runtime.serve.structured_output import (
    GrammarRequest,
    compile_grammar,
    pack_allowed,
    unpack_allowed,
)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny_checkpoint(directory, request.param)
    return directory, load_model(directory), load_tokenizer(directory)


def test_a_packed_set_of_token_ids_unpacks_to_exactly_them() -> None:
    for vocab in (1, 31, 32, 33, 400, 129_280):
        ids = sorted({0, vocab - 1, *range(min(vocab, 40), vocab, 97)})
        words = pack_allowed(ids, vocab)
        assert words.dtype == torch.int32 and words.shape == ((vocab + 31) // 32,)
        assert unpack_allowed(words.unsqueeze(0), vocab)[0].nonzero().flatten().tolist() == ids


def _reference(model: Any, prompt: Sequence[int], allowed: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy decoding over the allowed tokens only, written out: transformers' logits over the whole sequence,
    the argmax among ``allowed``."""
    ids, out, keep = list(prompt), [], torch.tensor(sorted(allowed))
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(keep[logits[keep].argmax()])
        ids.append(token)
        out.append(token)
    return out


def _ids(events: list[Event]) -> list[int]:
    assert not any(e.error for e in events), [e.error for e in events]
    return [t for e in events for t in getattr(e, "token_ids", ())]


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_greedy_output_is_the_argmax_over_the_allowed_tokens(checkpoint: tuple[Path, Any, Any], overlapped: bool
                                                             ) -> None:
    directory, model, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True)
    alone = _ids(serve_with_scheduler(directory, tokenizer, [GenerationRequest("free", prompt, free)],
                                      overlapped)["free"])
    # tokens the free output does not write, and one it does (its third): the output must change
    allowed = tuple(sorted({alone[2], *(t for t in range(3, 60, 7) if t not in alone)}))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True,
                            allowed_token_ids=allowed, logit_bias=((allowed[0], 3.0), (alone[0], 100.0)))
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True, return_token_ids=True,
                            allowed_token_ids=allowed[:3])
    events = serve_with_scheduler(directory, tokenizer, [
        GenerationRequest("only", prompt, params), GenerationRequest("free", prompt, free),
        GenerationRequest("sampled", prompt, seeded)], overlapped)
    only = _ids(events["only"])
    # the bias is added first, the mask after it: +100 on a token outside the set does not let it through
    expected = _reference(_Biased(model, {allowed[0]: 3.0, alone[0]: 100.0}), prompt, allowed, 16)
    assert only == expected and set(only) <= set(allowed) and only != alone
    assert _ids(events["free"]) == alone  # the batch's other sequences
    sampled = _ids(events["sampled"])
    assert len(sampled) == 24 and set(sampled) <= set(allowed[:3]) and len(set(sampled)) > 1


class _Biased(torch.nn.Module):
    """``model`` with a logit bias added to its last logits (OpenAI's ``logit_bias``)."""

    def __init__(self, model: Any, bias: dict[int, float]) -> None:
        super().__init__()
        self.model, self.bias = model, bias

    def forward(self, ids: torch.Tensor) -> Any:
        out = self.model(ids)
        for token, value in self.bias.items():
            out.logits[..., token] += value
        return out


def test_a_grammar_takes_only_the_allowed_tokens_it_accepts(checkpoint: tuple[Path, Any, Any]) -> None:
    """Regex ``[a-c]{10}`` and allowed_token_ids naming the tokens "a" and "c" (and others the regex never
    accepts): every character is a or c, with temperature sampling too."""
    directory, _, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "ac"]
    grammar = compile_grammar(GrammarRequest("regex", "[a-c]{10}", "test"))
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(
        max_tokens=30, temperature=1.0, seed=i, grammar=grammar,
        allowed_token_ids=tuple(sorted({*letters, *range(200, 260)})))) for i in range(3)]
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped=True)
    texts = ["".join(e.text for e in events[f"r{i}"]) for i in range(3)]
    assert all(re.fullmatch("[ac]{10}", text) for text in texts), texts


def test_min_tokens_yields_when_it_would_leave_no_allowed_token(checkpoint: tuple[Path, Any, Any]) -> None:
    """Only EOS allowed and ``min_tokens`` 4: min_tokens would ban the one token left (vLLM would sample from
    nothing); the output ends at once, as for a complete grammar."""
    directory, _, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=4, allowed_token_ids=(tokenizer.eos_token_id,))
    events = serve_with_scheduler(directory, tokenizer, [GenerationRequest("eos", prompt, params)], False)["eos"]
    assert not any(e.error for e in events)
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == 1


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe-allowed")
    build_tiny_checkpoint(directory)
    model = load_model(directory)
    srv = make_server(directory, model, model=HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=1024),
                      kv_budget_tokens=1024)
    yield srv, model
    srv.close()


def test_allowed_token_ids_through_the_api(served: tuple[Any, Any]) -> None:
    """Both endpoints draw only the allowed ids; an empty list, a negative id and an id outside the vocabulary
    are each a 400 naming ``allowed_token_ids``."""
    server, model = served
    allowed = [11, 23, 37, 41]
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0.8, "seed": 3,
            "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert len(answer["choices"][0]["token_ids"]) == 12 and set(answer["choices"][0]["token_ids"]) <= set(allowed)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed[:2], "stream": False}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).json()
    assert set(reply["choices"][0]["token_ids"]) <= set(allowed[:2]) and len(reply["choices"][0]["token_ids"]) == 8
    for bad in ([], [-1], [model.config.vocab_size + 5]):
        error = httpx.post(f"{server.url}/v1/completions", json={**body, "allowed_token_ids": bad}, timeout=10)
        assert error.status_code == 400 and error.json()["error"]["param"] == "allowed_token_ids", error.text
