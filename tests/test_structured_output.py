"""Structured output (serve/structured_output.py): ``response_format`` and vLLM's ``structured_outputs``.

What it must show, with the product's batched model on CPU (a tiny random Qwen3-MoE and DeepSeek-V3, float32):
greedy constrained output equals a reference decode that applies llguidance's own mask to transformers'
logits, token for token, sequential and overlapped; sampled output (temperature 1, several choices) always
parses and follows its schema / regex / choices; unconstrained sequences in the same batch are untouched; a
constrained sequence's next draw never comes from the device (``fed``): it sits out the step that samples its
token; the bitmask unpacks as llguidance lays it out; bad schemas and patterns are 400s naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import openai
import pytest
import torch

from serve_support import (
    MODEL_NAME,
    build_tiny_checkpoint,
    grammar_reference,
    joined_tool_calls,
    load_model,
    load_tokenizer,
    make_server,
    serve_with_scheduler,
)
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.scheduler import only_among
from vexpert_runtime.serve.step import SequenceWork
from vexpert_runtime.serve.structured_output import GrammarRequest, compile_grammar, unpack_allowed

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny_checkpoint(directory, request.param)
    return directory, load_model(directory), load_tokenizer(directory)


def _grammar(kind: str, spec: Any, flexible: bool = True) -> str:
    return compile_grammar(GrammarRequest(kind, spec, "test", whitespace_flexible=flexible))  # type: ignore[arg-type]


def _text(events: list[Event]) -> str:
    assert not any(e.error for e in events), [e.error for e in events]
    return "".join(e.text for e in events)


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_greedy_constrained_output_is_the_reference_decode_and_leaves_the_others_alone(
    checkpoint: tuple[Path, Any, Any], overlapped: bool,
) -> None:
    directory, model, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("Give me a person as JSON:"))
    grammars = {"json": _grammar("json", PERSON, flexible=False), "regex": _grammar("regex", REGEX),
                "choice": _grammar("choice", CHOICES), "lark": _grammar("grammar", LARK)}
    requests = [GenerationRequest(name, prompt, SamplingParams(max_tokens=128, temperature=0, grammar=g))
                for name, g in grammars.items()]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests.append(GenerationRequest("free", prompt, free))
    seen: list[list[SequenceWork]] = []
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped, seen)
    for name, grammar in grammars.items():
        expected = tokenizer.decode(grammar_reference(model, tokenizer, prompt, grammar, 128))
        assert _text(events[name]) == expected, name
    assert json.loads(_text(events["json"])) is not None
    assert re.fullmatch(REGEX, _text(events["regex"])) and _text(events["choice"]) in CHOICES
    alone = serve_with_scheduler(directory, tokenizer, [GenerationRequest("free", prompt, free)], overlapped)
    assert _text(events["free"]) == _text(alone["free"])
    constrained = {item.seq_id for work in seen for item in work if item.sample is not None
                   and item.sample.allowed is not None}
    assert len(constrained) == len(grammars)
    assert not [item for work in seen for item in work if item.seq_id in constrained and item.fed is not None]
    if overlapped:  # the others still take their tokens from the device
        assert any(item.fed is not None for work in seen for item in work)


def test_a_batch_of_only_constrained_sequences_runs_them_every_step(checkpoint: tuple[Path, Any, Any]) -> None:
    """Overlapped steps: beside free sequences a constrained one sits out the step that samples its token (the
    test above); with nothing but constrained sequences the scheduler reads the step in flight first and runs them
    all, every step (no step without them between their first and last token)."""
    directory, _, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    grammar = _grammar("regex", "[a-c]{12}")
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                                   grammar=grammar)) for i in range(3)]
    seen: list[list[SequenceWork]] = []
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped=True, seen=seen)
    assert all(re.fullmatch("[a-c]{12}", _text(events[f"r{i}"])) for i in range(3))
    for seq in range(3):
        steps = [n for n, work in enumerate(seen) if any(item.seq_id == seq for item in work)]
        assert steps == list(range(steps[0], steps[-1] + 1)), steps


def test_sampled_choices_always_follow_their_schema_regex_and_choices(checkpoint: tuple[Path, Any, Any]) -> None:
    directory, _, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("the quick brown fox"))
    kinds = {"json": ("json", PERSON), "regex": ("regex", REGEX), "choice": ("choice", CHOICES)}
    requests = [GenerationRequest(f"{name}{i}", prompt, SamplingParams(
        max_tokens=64, temperature=1.0, top_p=0.95, seed=i, grammar=_grammar(kind, spec, flexible=False)))
        for name, (kind, spec) in kinds.items() for i in range(6)]
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped=True)
    texts = {name: _text(batch) for name, batch in events.items()}
    for name, batch in events.items():
        assert batch[-1].finish_reason == "stop", (name, texts[name])
    for i in range(6):
        jsonschema.validate(json.loads(texts[f"json{i}"]), PERSON)
        assert re.fullmatch(REGEX, texts[f"regex{i}"]), texts[f"regex{i}"]
        assert texts[f"choice{i}"] in CHOICES
    assert len({texts[f"json{i}"] for i in range(6)}) > 1  # sampled, not one forced answer


def test_a_complete_grammar_ends_the_output_before_min_tokens_and_ignoring_eos(
    checkpoint: tuple[Path, Any, Any],
) -> None:
    """min_tokens holds EOS back and ignore_eos does not stop at it; a grammar with nothing left but EOS
    ends the output all the same (nothing else could be sampled)."""
    directory, _, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("pick"))
    grammar = _grammar("choice", ["yes"])
    requests = [GenerationRequest("min", prompt, SamplingParams(max_tokens=20, temperature=0, min_tokens=10,
                                                                grammar=grammar)),
                GenerationRequest("ignore", prompt, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True,
                                                                   grammar=grammar))]
    events = serve_with_scheduler(directory, tokenizer, requests, overlapped=False)
    for name in ("min", "ignore"):
        assert _text(events[name]) == "yes" and events[name][-1].finish_reason == "stop", name


def test_the_bitmask_unpacks_as_llguidance_lays_it_out() -> None:
    torch.manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    allowed = unpack_allowed(words, 150)
    for row in range(3):
        for token in range(150):
            assert bool(allowed[row, token]) == bool((int(words[row, token // 32]) >> (token % 32)) & 1)
    logits = torch.zeros(3, 150)
    llguidance.torch.apply_token_bitmask_inplace(logits, words)  # the library's own reading of the same words
    assert torch.equal(allowed, logits > float("-inf"))
    one = torch.zeros(5, dtype=torch.int32)
    one[2] = 1 << 3  # token 67
    assert only_among(one, [67, 2]) and not only_among(one, [2]) and only_among(torch.zeros(5, dtype=torch.int32), [])


def test_bias_rows_hold_the_grammar_mask_and_the_logit_bias_and_are_cleared_for_their_next_holder() -> None:
    """:meth:`PenaltyState.rows_for` writes a step's rows in one batch: a constrained row is −inf where its mask
    allows nothing and its logit bias where it allows; a bias alone is the bias; a new mask replaces the last one
    (nothing of it left); a row freed and taken again starts at zero."""
    from vexpert_runtime.serve.penalties import PenaltyState
    from vexpert_runtime.serve.step import SamplingSpec

    vocab, width = 70, 3

    def mask(*tokens: int) -> torch.Tensor:
        words = torch.zeros(width, dtype=torch.int32)
        for token in tokens:
            words[token // 32] |= 1 << (token % 32)
        return words

    def step(seq: int, spec: SamplingSpec) -> SequenceWork:
        return SequenceWork(seq, (5,), 3, (seq,), spec, penalty_prompt_len=3)

    state = PenaltyState(vocab, "cpu")
    state.reserve(3)
    work = [step(0, SamplingSpec(logit_bias=((1, 2.0), (4, -1.0)), allowed=mask(0, 1, 40))),
            step(1, SamplingSpec(allowed=mask(2, 69))), step(2, SamplingSpec(logit_bias=((7, 3.0),)))]
    rows = state.rows_for(work)
    assert rows is not None and state.bias is not None
    first, second, third = (state.bias[row].clone() for row in rows.rows)
    assert first[[0, 1, 40]].tolist() == [0.0, 2.0, 0.0] and torch.isinf(first).sum() == vocab - 3
    assert second[[2, 69]].tolist() == [0.0, 0.0] and torch.isinf(second).sum() == vocab - 2
    assert third[7] == 3.0 and third.abs().sum() == 3.0
    # the next step: seq 1's grammar moved on, seq 0 left and seq 3 took its row with no bias
    state.release(0)
    again = state.rows_for([step(3, SamplingSpec()), step(1, SamplingSpec(allowed=mask(5))),
                            step(2, SamplingSpec(logit_bias=((7, 3.0),)))])
    assert again is not None and again.rows[0] == rows.rows[0] and again.rows[1:] == rows.rows[1:]
    assert torch.equal(state.bias[again.rows[0]], torch.zeros(vocab))
    moved = state.bias[again.rows[1]]
    assert moved[5] == 0.0 and torch.isinf(moved).sum() == vocab - 1
    assert torch.equal(state.bias[again.rows[2]], third)  # unchanged bias: not rewritten


@pytest.mark.parametrize(("kind", "spec", "problem"), [
    ("regex", "[a-c", "regex"),
    ("json", '{"type": "object", "properties": 3}', "json"),
    ("json", "[1, 2]", "a JSON schema is an object"),
    ("choice", [], "non-empty"),
    ("grammar", "start: undefined_rule", "grammar"),
])
def test_a_grammar_llguidance_cannot_compile_names_the_field(kind: str, spec: Any, problem: str) -> None:
    with pytest.raises(VExpertInputError) as raised:
        compile_grammar(GrammarRequest(kind, spec, "structured_outputs." + kind))  # type: ignore[arg-type]
    assert raised.value.field == "structured_outputs." + kind and problem in str(raised.value)
    assert "fix: send" in str(raised.value)  # and what to send instead


# ---- through the OpenAI API ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # one checkpoint: the API's part is the same for every model (and a random model sampling JSON with flexible
    # whitespace may write spaces for a long time: this one closes its objects within the token limits below)
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe-api")
    build_tiny_checkpoint(directory, max_position_embeddings=1024)  # room for the tools the template shows
    model = load_model(directory)
    srv = make_server(directory, model, model=HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=2048),
                      kv_budget_tokens=2048)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_response_format_and_structured_outputs_through_the_api(client: openai.OpenAI) -> None:
    schema = {"name": "person", "schema": PERSON, "strict": True}
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "a person"}], max_tokens=200, temperature=0.8, seed=3,
        n=3, response_format={"type": "json_schema", "json_schema": schema})
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "any object"}], max_tokens=200, temperature=0,
        response_format={"type": "json_object"}, stream=True, extra_body={"chat_template_kwargs": {}})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(streamed), dict)
    completion = client.completions.create(model=MODEL_NAME, prompt="code:", max_tokens=20, temperature=1.0,
                                           extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, completion.choices[0].text)
    choice = client.completions.create(model=MODEL_NAME, prompt="answer:", max_tokens=20, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": CHOICES}})
    assert choice.choices[0].text in CHOICES


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "object", "properties": 3}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_bad_structured_output_is_a_400_naming_the_field(client: openai.OpenAI, body: dict[str, Any],
                                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=body)
    assert raised.value.body["param"] == param, raised.value.body  # type: ignore[index]


# ---- tool_choice "required" and a named function ------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "get_time": CLOCK}


def test_a_named_tool_choice_is_that_functions_arguments_with_no_parser(client: openai.OpenAI) -> None:
    """The server has no --tool-call-parser: the forced call is read from the constrained JSON — streamed, its
    arguments go out as they are written (the call named in the first piece; ``test_tool_calls.py`` shows the pieces),
    joined the same as the whole reply's."""

    body: dict[str, Any] = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 500,
        "temperature": 0, "tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content  # OpenAI's: a named call stops
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time" and call.id.startswith("chatcmpl-tool-")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])  # type: ignore[union-attr,index]
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    ((index, call_id, name, arguments),) = joined_tool_calls(deltas)
    assert (index, name, arguments) == (0, "get_time", call.function.arguments)  # type: ignore[union-attr]
    assert call_id and call_id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_calls_the_request_tools(client: openai.OpenAI, stream: bool) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "call something"}],
                            "max_tokens": 500, "temperature": 0.7, "seed": 4, "tools": [WEATHER, CLOCK],
                            "tool_choice": "required", "parallel_tool_calls": False}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **body))
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # the calls are no content
        deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        calls = [(name, arguments) for _, _, name, arguments in joined_tool_calls(deltas)]  # (streamed as written)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
        reason = choice.finish_reason
    assert reason == "tool_calls" and len(calls) == 1  # parallel_tool_calls false: exactly one
    tool = TOOLS[calls[0][0]]
    jsonschema.validate(json.loads(calls[0][1]), tool["function"]["parameters"])  # type: ignore[index]


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_forced_tool_choice_it_cannot_serve_is_a_400_naming_the_field(client: openai.OpenAI, body: dict[str, Any],
                                                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body=body)
    assert raised.value.body["param"] == param, raised.value.body  # type: ignore[index]


def test_the_required_schema_is_vllms() -> None:
    from vexpert_runtime.serve.tool_calls import ForcedToolChoice

    with_defs = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    schema = ForcedToolChoice(None, parallel=False).schema([WEATHER, with_defs, {"type": "function",
                                                                                 "function": {"name": "bare"}}])
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["$defs"] == {"P": {"type": "integer"}}
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["g"], ["bare"]]
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert "$defs" in with_defs["function"]["parameters"]  # the request's own tools are left as they were
    calls = ForcedToolChoice(None).calls('[{"name": "g", "parameters": {"p": 1}}, {"name": "bare", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in calls or []] == [("g", '{"p": 1}'), ("bare", "{}")]
    assert ForcedToolChoice(None).calls('[{"name": "g"') is None  # cut short: content, not calls
