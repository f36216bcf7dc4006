"""Reasoning parsers (``vexpert serve --reasoning-parser``, vLLM's): a chat reply split into ``reasoning`` and
``content`` — whole and streamed alike, however the text is cut into pieces —, where the reply starts (each family's
rule, the rendered prompt's last marker), tool calls read from the content, and structured output constraining only
what follows the reasoning (the grammar waits for the end-of-reasoning token)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("transformers")

from serve_support import (
    MODEL_NAME,
    ScriptedStepModel,
    build_tiny_checkpoint,
    joined_tool_calls,
    load_model,
    load_tokenizer,
    make_server,
    serve_with_scheduler,
)
from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
from vexpert_runtime.serve.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from vexpert_runtime.serve.structured_output import GrammarRequest, compile_grammar

QWEN3 = REASONING_PARSERS["qwen3"]
TEXTS = {  # (starts in reasoning, text) → (reasoning, content)
    (True, "<think>\nplan: add.\n</think>\n\nThe sum is 4."): ("\nplan: add.\n", "\n\nThe sum is 4."),
    (True, "plan first</think>answer"): ("plan first", "answer"),  # a template that opened <think> itself
    (True, "  <think>only thinking, cut off at max_tokens <th"): ("only thinking, cut off at max_tokens <th", None),
    (True, "thinking<tool_call>{\"name\": \"f\"}</tool_call>"): ("thinking", "<tool_call>{\"name\": \"f\"}</tool_call>"),
    (True, "a</think>b</think>c"): ("a", "bc"),  # a stray end marker in the content: dropped
    (True, "</think>"): ("", None),
    (False, "no reasoning here <think> at all"): (None, "no reasoning here <think> at all"),
    (False, "a</think>b"): (None, "a</think>b"),  # a reply that started in its content keeps every character
}


@pytest.mark.parametrize(("key", "expected"), list(TEXTS.items()), ids=[t[:24] for _, t in TEXTS])
def test_a_reply_splits_alike_whole_and_streamed_in_pieces_of_any_size(key: tuple[bool, str],
                                                                      expected: tuple[str | None, str | None]) -> None:
    in_reasoning, text = key
    assert split_reasoning(QWEN3, in_reasoning, text) == expected
    for size in range(1, len(text) + 1):
        stream, reasoning, content = ReasoningStream(QWEN3, in_reasoning), "", ""
        for start in range(0, len(text), size):
            thought, said = stream.push(text[start:start + size])
            reasoning, content = reasoning + thought, content + said
        thought, said = stream.finish()
        assert (reasoning + thought, content + said) == (expected[0] or "", expected[1] or ""), size


def test_each_family_starts_its_reply_where_vllm_does() -> None:
    r1, v3, kimi = (REASONING_PARSERS[name] for name in ("deepseek_r1", "deepseek_v3", "kimi_k2"))
    assert r1.thinks(None) and r1.thinks({"thinking": False})  # R1 always thinks
    assert not v3.thinks(None) and v3.thinks({"thinking": True}) and v3.thinks({"enable_thinking": True})
    assert QWEN3.thinks(None) and not QWEN3.thinks({"enable_thinking": False})
    assert kimi.thinks({}) and not kimi.thinks({"thinking": False})
    # the rendered prompt's last marker has the last word: Qwen3 without thinking, R1's and V3.1's templates
    assert not QWEN3.starts_in_reasoning(None, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r1.starts_in_reasoning(None, "<｜Assistant｜><think>\n")
    assert not v3.starts_in_reasoning({"thinking": True}, "<｜Assistant｜></think>")
    assert v3.starts_in_reasoning(None, "<｜Assistant｜><think>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("tiny-qwen3-think")
    build_tiny_checkpoint(directory, added_tokens=["<think>", "</think>"])  # Qwen3's: added tokens, not special
    return directory, load_model(directory), load_tokenizer(directory)


def test_the_grammar_waits_for_the_end_of_the_reasoning(checkpoint: tuple[Path, Any, Any]) -> None:
    """``reasoning_end`` = ``</think>``'s id, favoured by a logit bias: the model closes its reasoning at once (a
    token the regex does not allow), then writes what the regex allows; without ``reasoning_end`` the regex rules
    from the first token and ``</think>`` never comes."""
    directory, _, tokenizer = checkpoint
    end = tokenizer.convert_tokens_to_ids("</think>")
    assert tokenizer.encode("</think>", add_special_tokens=False) == [end]
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    grammar = compile_grammar(GrammarRequest("regex", "[a-c]{5}", "test"))
    common = {"max_tokens": 20, "temperature": 0.0, "grammar": grammar, "logit_bias": ((end, 100.0),)}
    requests = [GenerationRequest("after", prompt, SamplingParams(**common, reasoning_end=end)),  # type: ignore[arg-type]
                GenerationRequest("from start", prompt, SamplingParams(**common))]  # type: ignore[arg-type]
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped=True)
    texts = {name: "".join(e.text for e in batch) for name, batch in events.items()}
    assert not any(e.error for batch in events.values() for e in batch), texts
    assert re.fullmatch("</think>[a-c]{5}", texts["after"]), texts
    assert re.fullmatch("[a-c]{5}", texts["from start"]), texts


def test_reasoning_through_the_api(checkpoint: tuple[Path, Any, Any]) -> None:
    """``--reasoning-parser qwen3`` with ``--tool-call-parser hermes`` and a scripted reply that thinks, answers and
    calls a tool: ``message.reasoning``, the content without it, the call read from the content; streamed, the
    ``delta.reasoning`` chunks and the content add up to the same; ``include_reasoning: false`` leaves the
    reasoning out; ``enable_thinking: false`` (the template closes an empty think block) makes it all content.
    A regex-constrained request whose reply reasons first is served (the grammar starts after ``</think>``)."""
    directory, hf_model, tokenizer = checkpoint
    reply = '<think>\nthe user wants f.\n</think>\n\nCalling f.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    script = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.decode(script) == reply
    srv = make_server(directory, hf_model, model=ScriptedStepModel(hf_model, script, tokenizer.eos_token_id))
    srv.api.config = dataclasses.replace(srv.api.config, reasoning_parser="qwen3", tool_call_parser="hermes")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x?"}], "tools": tools,
                              "max_tokens": 120}
    thinking = len(tokenizer.encode('<think>\nthe user wants f.\n', add_special_tokens=False))  # before </think>
    try:
        answer = client.chat.completions.create(**kwargs)
        message = answer.choices[0].message
        assert answer.usage is not None and answer.usage.completion_tokens == len(script) + 1  # and EOS
        assert answer.usage.completion_tokens_details is not None
        assert answer.usage.completion_tokens_details.reasoning_tokens == thinking  # (vLLM's usage field)
        assert message.model_extra is not None and message.model_extra["reasoning"] == "\nthe user wants f.\n"
        assert message.content == "\n\nCalling f.\n" and [c.function.name for c in message.tool_calls or []] == ["f"]
        reasoning, content, calls = "", "", []
        for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            if not chunk.choices:  # the usage chunk
                assert chunk.usage.completion_tokens_details.reasoning_tokens == thinking  # type: ignore[union-attr]
                continue
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
        assert (reasoning, content) == ("\nthe user wants f.\n", "\n\nCalling f.\n")
        assert [(name, arguments) for _, _, name, arguments in joined_tool_calls(calls)] == [("f", '{"x": 1}')]
        hidden = client.chat.completions.create(**kwargs, extra_body={"include_reasoning": False}).choices[0].message
        assert "reasoning" not in (hidden.model_extra or {}) and hidden.content == "\n\nCalling f.\n"
        plain = client.chat.completions.create(**kwargs, tool_choice="none",
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert plain.choices[0].message.content == reply  # all content, as written
        assert plain.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
        srv.model.script = tokenizer.encode("<think>\nletters\n</think>abcab", add_special_tokens=False)
        constrained = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x?"}],
                                                     max_tokens=40, extra_body={"structured_outputs": {
                                                         "regex": "[a-c]{5}"}})
        choice = constrained.choices[0]
        assert (choice.message.content, choice.finish_reason) == ("abcab", "stop")
        assert (choice.message.model_extra or {})["reasoning"] == "\nletters\n"
    finally:
        srv.close()


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_a_thinking_budget_ends_the_reasoning_after_that_many_tokens(checkpoint: tuple[Path, Any, Any],
                                                                     overlapped: bool) -> None:
    """vLLM's ``thinking_token_budget``: a reply whose reasoning would go on (``</think>`` biased away) gets its
    ``</think>`` as the token after the budget's — 0, 1 or 3 reasoning tokens —, then writes its content; a budget
    beyond ``max_tokens`` changes nothing; a reply that ends its reasoning early is not held to it. Sequential and
    overlapped steps alike (an overlapped sequence near its budget reads each token before its next draw)."""
    directory, _, tokenizer = checkpoint
    end = tokenizer.convert_tokens_to_ids("</think>")
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    common: dict[str, Any] = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "reasoning_end": end}
    away, toward = ((end, -100.0),), ((end, 100.0),)
    budgets = {"b0": 0, "b1": 1, "b3": 3, "b20": 20}
    requests = [GenerationRequest(name, prompt, SamplingParams(**common, logit_bias=away, thinking_budget=budget))
                for name, budget in budgets.items()]
    requests.append(GenerationRequest("early", prompt, SamplingParams(**common, logit_bias=toward, thinking_budget=5)))
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped=overlapped)
    for name, batch in events.items():
        assert not any(e.error for e in batch), (name, batch)
        texts = [e.text for e in batch if e.new_tokens]  # one event per token
        details = batch[-1].usage_details
        assert details is not None and batch[-1].completion_tokens == 10, (name, batch[-1])
        expected = {"b20": None, "early": 0}.get(name, budgets.get(name))
        assert (texts.index("</think>") if "</think>" in texts else None) == expected, (name, texts)
        assert details.reasoning_tokens == (10 if expected is None else expected), (name, details)
        assert texts.count("</think>") <= 1 or name == "early", (name, texts)


def test_a_thinking_budget_through_the_api(checkpoint: tuple[Path, Any, Any]) -> None:
    """``thinking_token_budget`` on a chat request with ``--reasoning-parser qwen3``: the reasoning has that many
    tokens (the usage's ``reasoning_tokens``), the rest is content; −1 is no limit; without a reasoning parser, or on
    /v1/completions, it is a 400 naming it."""
    directory, hf_model, tokenizer = checkpoint
    end = tokenizer.convert_tokens_to_ids("</think>")
    srv = make_server(directory, hf_model)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x?"}], "max_tokens": 8,
                              "temperature": 0.0, "logit_bias": {str(end): -100}}
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**kwargs, extra_body={"thinking_token_budget": 2})
        assert refused.value.body["param"] == "thinking_token_budget" and "--reasoning-parser" in str(refused.value)
        with pytest.raises(openai.BadRequestError) as completion:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"thinking_token_budget": 2})
        assert completion.value.body["param"] == "thinking_token_budget"
        srv.api.config = dataclasses.replace(srv.api.config, reasoning_parser="qwen3")
        budgeted = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "thinking_token_budget": 2})
        assert budgeted.usage.completion_tokens_details.reasoning_tokens == 2  # type: ignore[union-attr]
        assert budgeted.choices[0].message.content and budgeted.usage.completion_tokens == 8  # type: ignore[union-attr]
        unlimited = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "thinking_token_budget": -1})
        assert unlimited.usage.completion_tokens_details.reasoning_tokens == 8  # type: ignore[union-attr]
        assert unlimited.choices[0].message.content is None
    finally:
        srv.close()
