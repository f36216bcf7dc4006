"""OpenAI's Responses API (``POST /v1/responses``, stateless; serve/responses_api.py): a request answers as the chat
completion it amounts to — the same tokens —, as a response object or the ``response.*`` events OpenAI's SDK reads;
reasoning and function calls come as their own output items; what would need stored state is refused by name."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import jsonschema
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
from vexpert_runtime.serve.responses_api import ResponseEvents, ResponsesRequest, ResponseStore, chat_body
from vexpert_runtime.serve.tool_call_stream import ToolCallStream


def test_a_response_request_is_the_chat_request_it_amounts_to() -> None:
    req = ResponsesRequest.model_validate({
        "model": "m", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text",
                                                                                          "text": "in Oslo?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
                  {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "store": False, "include": ["reasoning.encrypted_content"]})
    assert chat_body(req) == {
        "model": "m", "stream": False, "parallel_tool_calls": True, "max_completion_tokens": 9, "temperature": 0.5,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [  # consecutive calls: one turn
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "assistant", "content": "Rain."}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                    "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                    "strict": True}},
        "reasoning_effort": "low"}
    plain = chat_body(ResponsesRequest.model_validate({"model": "m", "input": "hi"}))
    assert plain["messages"] == [{"role": "user", "content": "hi"}] and "tools" not in plain


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("tiny-qwen3-responses")
    build_tiny_checkpoint(directory, added_tokens=["<think>", "</think>"])
    model = load_model(directory)
    srv = make_server(directory, model)
    yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60), directory, model
    srv.close()


def test_a_response_has_the_tokens_of_its_chat_completion_whole_and_streamed(served: Any) -> None:
    client = served[1]
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}])
    response = client.responses.create(model=MODEL_NAME, instructions="be brief", input="the quick brown fox",
                                       max_output_tokens=12, temperature=0, metadata={"run": "1"})
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.id.startswith("resp_") and response.metadata == {"run": "1"} and response.model == MODEL_NAME
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                         chat.usage.completion_tokens)
    events = list(client.responses.create(model=MODEL_NAME, instructions="be brief", input="the quick brown fox",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{response.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text


def test_log_probabilities_are_the_chat_completions_whole_and_streamed(served: Any) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` 3: the message's ``output_text`` carries each
    output token's log-probability and its 3 most likely alternatives — the chat completion's for the same request —,
    and streamed, the ``response.output_text.delta`` events' add up to them (and ``output_text.done``'s are them).
    Without the include there are none (as vLLM's)."""
    client = served[1]
    common: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0}
    chat = client.chat.completions.create(**common, max_tokens=12, logprobs=True, top_logprobs=3,
                                          messages=[{"role": "user", "content": "the quick brown fox"}])
    expected = [(e.token, round(e.logprob, 5), [(t.token, round(t.logprob, 5)) for t in e.top_logprobs])
                for e in chat.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert len(expected) == chat.usage.completion_tokens  # type: ignore[union-attr]

    def entries(logprobs: Any) -> list[Any]:
        return [(e.token, round(e.logprob, 5), [(t.token, round(t.logprob, 5)) for t in e.top_logprobs])
                for e in logprobs]

    asked: dict[str, Any] = {**common, "input": "the quick brown fox", "max_output_tokens": 12, "top_logprobs": 3,
                             "include": ["message.output_text.logprobs"]}
    response = client.responses.create(**asked)
    (part,) = response.output[0].content  # type: ignore[union-attr]
    assert entries(part.logprobs) == expected and all(len(e[2]) == 3 for e in expected)  # type: ignore[union-attr]
    events = list(client.responses.create(**asked, stream=True))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert entries(streamed) == expected
    done = next(event for event in events if event.type == "response.output_text.done")
    assert entries(done.logprobs) == expected
    plain = client.responses.create(**{**asked, "include": []})
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{**asked, "top_logprobs": 21})
    assert refused.value.body["param"] == "top_logprobs"  # type: ignore[index]


def test_reasoning_and_function_calls_are_output_items(served: Any) -> None:
    """``--reasoning-parser qwen3`` and ``--tool-call-parser hermes`` with a scripted reply that thinks, says and
    calls: a reasoning item, a message, a function call — whole and streamed —; the call and its output sent back
    as input items render as the chat's tool turn."""
    _, _, directory, model = served
    tokenizer = load_tokenizer(directory)
    reply = '<think>\nneeds f\n</think>\n\nCalling.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    scripted = make_server(directory, model, model=ScriptedStepModel(
        model, tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id))
    scripted.api.config = dataclasses.replace(scripted.api.config, reasoning_parser="qwen3", tool_call_parser="hermes")
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tools: Any = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    try:
        response = client.responses.create(model=MODEL_NAME, input="x?", tools=tools, max_output_tokens=90)
        assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
        reasoning, message, call = response.output
        assert reasoning.content[0].text == "\nneeds f\n" and message.content[0].text == "\n\nCalling.\n"  # type: ignore[union-attr,index]
        assert (call.name, json.loads(call.arguments)) == ("f", {"x": 1})  # type: ignore[union-attr]
        assert response.status == "completed"
        events = list(client.responses.create(model=MODEL_NAME, input="x?", tools=tools, max_output_tokens=90,
                                              stream=True))
        final = events[-1].response  # type: ignore[union-attr]
        assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nneeds f\n"  # type: ignore[union-attr]
        assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [  # type: ignore[union-attr]
            call.arguments]  # type: ignore[union-attr]
        follow_up = client.responses.create(model=MODEL_NAME, tools=tools, max_output_tokens=4, input=[
            {"role": "user", "content": "x?"}, *[item.model_dump() for item in response.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "42"}])  # type: ignore[union-attr]
        tokenized = httpx.post(f"{scripted.url}/tokenize", json={"tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "messages": [
            {"role": "user", "content": "x?"}, {"role": "assistant", "content": "\n\nCalling.\n", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "f", "arguments": call.arguments}}]},  # type: ignore[union-attr]
            {"role": "tool", "tool_call_id": call.call_id, "content": "42"}]}).json()  # type: ignore[union-attr]
        assert follow_up.usage is not None and follow_up.usage.input_tokens == tokenized["count"]  # the same chat
        with pytest.raises(openai.BadRequestError) as over:  # an error of the chat it amounts to, named as here
            client.responses.create(model=MODEL_NAME, input="x?", tools=tools, max_output_tokens=250)
        assert over.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    finally:
        scripted.close()


def test_function_calls_stream_as_they_are_written() -> None:
    """A reply streamed through the Responses events: content, then two DeepSeek-V3.1 calls whose arguments go out
    in pieces as the model writes them (``response.function_call_arguments.delta``), each call's item added at its
    first piece and done (with the joined arguments) before the next is added; ``response.completed`` lists the
    message and both calls, in that order, and sends no call twice."""
    begin, end, call, call_end, sep = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                       "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
    reply = f'Looking.{begin}{call}f{sep}{{"text": "{"y" * 40}"}}{call_end}{call}g{sep}{{"n": 2}}{call_end}{end}'
    events = ResponseEvents("resp_1", 0, ResponsesRequest.model_validate({"model": "m", "input": "x"}))
    stream, raw = ToolCallStream("deepseek_v31"), events.start()
    for at in range(0, len(reply), 5):
        content, deltas = stream.push(reply[at:at + 5])
        raw += events.content(content) + events.calls(deltas)
    tail, deltas, calls = stream.finish()
    raw += events.content(tail) + events.calls(deltas)
    raw += events.finish("stop", {"input_tokens": 1, "output_tokens": 2})
    sent = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    argument_deltas = [e for e in sent if e["type"] == "response.function_call_arguments.delta"]
    assert len(argument_deltas) > 4  # in pieces, not one per call
    done = [e for e in sent if e["type"] == "response.function_call_arguments.done"]
    for event in done:
        pieces = "".join(d["delta"] for d in argument_deltas if d["item_id"] == event["item_id"])
        assert pieces == event["arguments"]
    assert [json.loads(e["arguments"]) for e in done] == [{"text": "y" * 40}, {"n": 2}]
    kinds = [e["type"] for e in sent]
    assert kinds.index("response.function_call_arguments.done") < [
        i for i, e in enumerate(sent) if e["type"] == "response.output_item.added"][-1]  # f done before g is added
    final = sent[-1]["response"]
    assert final["status"] == "completed" and [item["type"] for item in final["output"]] == [
        "message", "function_call", "function_call"]
    assert [(item["name"], item["call_id"]) for item in final["output"][1:]] == [(c.name, c.id) for c in calls]
    assert final["output"][0]["content"][0]["text"] == "Looking."


def test_a_json_schema_text_format_constrains_the_output(served: Any) -> None:
    """``text.format`` json_schema: every token of the output is one the schema's grammar accepts (a random model
    writes JSON's flexible whitespace for long: the reply stops at max_output_tokens, incomplete, but in the grammar)."""
    from vexpert_runtime.serve.sampling import eos_token_ids
    from vexpert_runtime.serve.structured_output import GrammarRequest, GrammarTokens, compile_grammar

    _, client, directory, _ = served
    tokenizer = load_tokenizer(directory)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL_NAME, input="yes or no?", max_output_tokens=64, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                        "strict": True}})
    text = response.output_text
    assert text.startswith("{") and response.status in ("completed", "incomplete")
    matcher = GrammarTokens(tokenizer, len(tokenizer), eos_token_ids(tokenizer)).matcher(
        compile_grammar(GrammarRequest("json", schema, "text.format")))
    assert all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False)), text
    if response.status == "completed":
        jsonschema.validate(json.loads(text), schema)


def test_stored_responses_continue_their_conversation_and_are_retrieved(served: Any) -> None:
    """With a store (``--responses-store 2``): a response continued by ``previous_response_id`` sees the conversation
    it ends — its reply is the chat completion of the whole exchange, token for token, whole and streamed —; ``GET
    /v1/responses/{id}`` returns a stored one; ``store: false`` keeps none; the oldest goes first (a 404 naming
    ``previous_response_id``); the CLI refuses the store with several API processes (each would keep its own)."""
    from vexpert_runtime.cli import build_parser
    from vexpert_runtime.commands.serve import _checked_api_key
    from vexpert_runtime.errors import VExpertInputError

    srv, client = served[0], served[1]
    srv.api.responses_store = ResponseStore(2)
    ask: dict[str, Any] = {"model": MODEL_NAME, "max_output_tokens": 8, "temperature": 0}
    try:
        first = client.responses.create(input="the quick brown fox", **ask)
        assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(input="and then?", previous_response_id=first.id, **ask)
        chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then?"}])
        assert second.output_text == chat.choices[0].message.content
        assert second.usage is not None and chat.usage is not None
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        events = list(client.responses.create(input="more", previous_response_id=second.id, stream=True, **ask))
        third = events[-1].response
        chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then?"}, {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "more"}])
        assert third.store and third.output_text == chat.choices[0].message.content
        assert client.responses.retrieve(third.id).output_text == third.output_text
        unkept = client.responses.create(input="hi", store=False, **ask)
        assert not unkept.store
        for gone in (unkept.id, first.id):  # not stored; dropped (the store holds the last 2: second, third)
            assert httpx.get(f"{srv.url}/v1/responses/{gone}", timeout=30).status_code == 404
        answer = httpx.post(f"{srv.url}/v1/responses", json={**ask, "input": "x", "previous_response_id": first.id},
                            timeout=30)
        assert answer.status_code == 404 and answer.json()["error"]["param"] == "previous_response_id"
    finally:
        srv.api.responses_store = None
    assert httpx.get(f"{srv.url}/v1/responses/{second.id}", timeout=30).status_code == 404  # no store: none
    with pytest.raises(VExpertInputError) as error:
        _checked_api_key(build_parser().parse_args(["serve", "--responses-store", "8", "--api-servers", "2",
                                                    "--port", "8000"]))
    assert error.value.field == "--responses-store"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"thinking_token_budget": 8}, "thinking_token_budget"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"model": "other"}, "model"),
])
def test_what_a_response_cannot_be_is_a_400_naming_the_field(served: Any, body: dict[str, Any], param: str) -> None:
    srv = served[0]
    answer = httpx.post(f"{srv.url}/v1/responses", json={"model": MODEL_NAME, "input": "hi", **body}, timeout=30)
    assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param, answer.text
