"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``; serve/messages_api.py), driven by
Anthropic's own SDK: a request answers as the chat completion it amounts to — the same tokens —, as a message or the
events the SDK reads; thinking and tool calls come as their own content blocks; tool results sent back render as the
chat's tool turns; errors take Anthropic's shape, and its ``x-api-key`` header is an API key."""

from __future__ import annotations

import dataclasses
from typing import Any

import anthropic
import httpx
import openai
import pytest

pytest.importorskip("transformers")

from serve_support import (
    MODEL_NAME,
    ScriptedStepModel,
    build_tiny_checkpoint,
    load_model,
    load_tokenizer,
    make_server,
)
from vexpert_runtime.serve.messages_api import MessagesRequest, chat_body

TOOLS: Any = [{"name": "get_weather", "description": "the weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}]


def test_a_messages_request_is_the_chat_request_it_amounts_to() -> None:
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 4, "tools": TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 64},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "needs the tool", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "rain"}]},
                {"type": "text", "text": "and tomorrow?"}]}]})
    assert chat_body(req) == {
        "model": "m", "max_completion_tokens": 9, "stream": False, "stop": ["END"], "temperature": 0.5, "top_k": 4,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "user", "content": "and tomorrow?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                                    "parameters": TOOLS[0]["input_schema"]}}],
        "tool_choice": "required", "parallel_tool_calls": False, "thinking_token_budget": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}}
    named = chat_body(MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "tools": TOOLS, "messages": [],
                                                      "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    off = chat_body(MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "tools": TOOLS, "messages": [],
                                                    "tool_choice": {"type": "none"}, "thinking": {"type": "disabled"}}))
    assert off["tools"] and off["tool_choice"] == "none" and off["reasoning_effort"] == "none"
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0"):
        chat_body(MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]}))
    with pytest.raises(ValueError, match=r"tools\.0\.type"):
        chat_body(MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [], "tools": [
            {"type": "web_search_20250305", "name": "web_search"}]}))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("tiny-qwen3-messages")
    build_tiny_checkpoint(directory, added_tokens=["<think>", "</think>"])
    model = load_model(directory)
    srv = make_server(directory, model)
    yield (srv, anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60),
           openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60), directory, model)
    srv.close()


def test_a_message_has_the_tokens_of_its_chat_completion_whole_and_streamed(served: Any) -> None:
    srv, client, chat_client = served[:3]
    chat = chat_client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}])
    # (Anthropic's SDK has no temperature any more; the server reads it where a client sends one, as vLLM's)
    asked: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 12, "extra_body": {"temperature": 0},
                             "system": "be brief", "messages": [{"role": "user", "content": "the quick brown fox"}]}
    message = client.messages.create(**asked)
    assert message.id.startswith("msg_") and message.model == MODEL_NAME and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert chat.usage is not None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                         chat.usage.completion_tokens)
    assert client.messages.count_tokens(model=MODEL_NAME, system="be brief", messages=asked["messages"]
                                        ).input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == message.content[0].text  # type: ignore[union-attr]
    assert (final.stop_reason, final.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)
    assert int(httpx.get(f"{srv.url}/load", timeout=10).json()["server_load"]) == 0
    full = client.messages.create(**{**asked, "extra_body": {"temperature": 0, "ignore_eos": True}}).content[0].text  # type: ignore[union-attr]
    stop = full[4:7]
    stopped = client.messages.create(**{**asked, "extra_body": {"temperature": 0, "ignore_eos": True}},
                                     stop_sequences=["never appears", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == full[: full.index(stop)]  # type: ignore[union-attr]
    with client.messages.stream(**{**asked, "extra_body": {"temperature": 0, "ignore_eos": True}},
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_errors_take_anthropics_shape(served: Any) -> None:
    """A bad field is a 400 the SDK reads as its ``BadRequestError``, in Anthropic's error shape, naming the field as
    the Messages API names it (the chat request's ``max_completion_tokens`` is ``max_tokens`` here)."""
    srv, client = served[:2]
    with pytest.raises(anthropic.BadRequestError) as over:
        client.messages.create(model=MODEL_NAME, max_tokens=250, messages=[{"role": "user", "content": "hi"}])
    body: Any = over.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("max_tokens")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    image = httpx.post(f"{srv.url}/v1/messages", timeout=30, json={"model": MODEL_NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]})
    assert image.status_code == 400 and "messages.0.content.0" in image.json()["error"]["message"]
    missing = httpx.post(f"{srv.url}/v1/messages", timeout=30, json={"model": MODEL_NAME, "messages": []})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]


def test_an_api_key_may_come_as_x_api_key(served: Any) -> None:
    directory, model = served[3:]
    keyed = make_server(directory, model)
    keyed.api.config = dataclasses.replace(keyed.api.config, api_key="k")
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    try:
        assert anthropic.Anthropic(base_url=keyed.url, api_key="k", max_retries=0).messages.create(**body).content
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(**body)
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        both = httpx.post(f"{keyed.url}/v1/messages", json=body, timeout=30,  # either header may carry the key
                          headers={"Authorization": "Bearer k", "x-api-key": "stale"})
        assert both.status_code == 200
    finally:
        keyed.close()


def test_thinking_and_tool_calls_are_content_blocks(served: Any) -> None:
    """``--reasoning-parser qwen3`` and ``--tool-call-parser hermes`` with a scripted reply that thinks, says and
    calls: thinking, text and tool_use blocks with stop reason tool_use — whole and streamed —; the call and its
    result sent back render as the chat's tool turn."""
    _, _, _, directory, model = served
    tokenizer = load_tokenizer(directory)
    reply = '<think>\nneeds f\n</think>\n\nCalling.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
        '</tool_call>'
    scripted = make_server(directory, model, model=ScriptedStepModel(
        model, tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id))
    scripted.api.config = dataclasses.replace(scripted.api.config, reasoning_parser="qwen3", tool_call_parser="hermes")
    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0, timeout=60)
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]  # (a short prompt: the reply fits)
    asked: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 100, "tools": tools,
                             "messages": [{"role": "user", "content": "x?"}]}
    try:
        message = client.messages.create(**asked)
        assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
        thinking, text, call = message.content
        assert thinking.thinking == "\nneeds f\n" and text.text == "\n\nCalling.\n"  # type: ignore[union-attr]
        assert (call.name, call.input) == ("get_weather", {"city": "Oslo"})  # type: ignore[union-attr]
        assert message.stop_reason == "tool_use"
        with client.messages.stream(**asked) as stream:
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[2].input == {"city": "Oslo"} and final.stop_reason == "tool_use"  # type: ignore[union-attr]
        follow_up: Any = [{"role": "user", "content": "x?"},
                          {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,  # type: ignore[union-attr]
                                                        "content": "rain"}]}]
        counted = client.messages.count_tokens(model=MODEL_NAME, tools=tools, messages=follow_up).input_tokens
        tokenized = httpx.post(f"{scripted.url}/tokenize", json={"tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}], "messages": [
            {"role": "user", "content": "x?"}, {"role": "assistant", "content": "\n\nCalling.\n", "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather",  # type: ignore[union-attr]
                                                                 "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "rain"}]}).json()  # type: ignore[union-attr]
        assert counted == tokenized["count"]  # the same chat
    finally:
        scripted.close()
