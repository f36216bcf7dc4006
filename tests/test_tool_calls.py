"""Tool calls read out of chat replies (``serve/tool_calls.py``, vLLM's ``hermes``, ``deepseek_v3``, ``deepseek_v31``,
``kimi_k2`` and ``qwen3_coder`` parsers' formats): the parsers on their own, streamed in pieces of every size, and the
operator's field naming the same parsers."""

from __future__ import annotations

import json
import typing
from collections import defaultdict

import pytest

from vexpert_runtime.serve.tool_call_stream import ToolCallStream
from vexpert_runtime.serve.tool_calls import (
    PARSERS,
    ForcedToolChoice,
    TypedToolFormat,
    parse_tool_calls,
    schema_types,
)

TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "format": "24h"}}\n</tool_call>')
# written as a model may write them — not as json.dumps would: the stream re-encodes them as the whole reply does
HERMES_UNCANONICAL = ('<tool_call>\n{"name":"plot", "arguments":{"xs":[1.50,2E1 ,-0.0],"label":"\\u00e9t\\u00e9 \\ud83d\\ude00 '
                      '\\"q\\"","opts":{},"on":true,"none":null}}\n</tool_call>'
                      '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                      '<tool_call>{"arguments": {"b": 2}, "name": "g"}</tool_call>')


def test_calls_are_read_with_the_content_before_them() -> None:
    content, calls = parse_tool_calls("hermes", TWO_CALLS)
    assert content == "Let me check both.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "format": "24h"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert calls[0].as_json(0) == {"index": 0, "id": calls[0].id, "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    only = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert only[0] is None and only[1][0].arguments == '{"x": 1}'  # arguments given as a string stay as sent
    unclosed = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {}}')  # the reply ran out before </tool_call>
    assert [c.name for c in unclosed[1]] == ["f"]


@pytest.mark.parametrize("text", ["plain text, no call", "see <tool_call> this is not JSON </tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>"])
def test_a_reply_without_a_valid_call_is_all_content(text: str) -> None:
    assert parse_tool_calls("hermes", text) == (text, [])


BEGIN, END, CALL, CALL_END, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                   "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
DEEPSEEK_TWO_CALLS = (f"Let me check both.{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```"
                      f"{CALL_END}\n{CALL}function{SEP}get_time\n```json\n{{\"zone\": \"CET\",\n \"format\": \"24h\"}}\n```"
                      f"{CALL_END}{END}")


def test_deepseek_v3_calls_are_read_with_the_content_before_them() -> None:
    """DeepSeek-V3's format (vLLM's ``deepseek_v3`` parser): the arguments string passed on as written."""
    content, calls = parse_tool_calls("deepseek_v3", DEEPSEEK_TWO_CALLS)
    assert content == "Let me check both."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET",\n "format": "24h"}')]
    only = parse_tool_calls("deepseek_v3", f"{BEGIN}{CALL}function{SEP}f\n```json\n{{}}\n```{CALL_END}{END}")
    assert only[0] is None and [(c.name, c.arguments) for c in only[1]] == [("f", "{}")]


@pytest.mark.parametrize("text", [
    "plain text, no call",
    f"{BEGIN}{CALL}function{SEP}f\n```json\nnot JSON\n```{CALL_END}{END}",  # arguments that are not JSON
    f"{BEGIN}{CALL}function{SEP}\n```json\n{{}}\n```{CALL_END}{END}",  # no name
    f"{BEGIN}{CALL}function{SEP}f\n```json\n{{}}\n```{CALL_END}{CALL}function{SEP}g\n```json",  # ran out mid-call
    f"{BEGIN} nothing {END}",
])
def test_a_deepseek_v3_reply_without_valid_calls_is_all_content(text: str) -> None:
    assert parse_tool_calls("deepseek_v3", text) == (text, [])


DEEPSEEK_V31_TWO_CALLS = (f"Let me check both.{BEGIN}{CALL}get_weather{SEP}{{\"city\": \"Paris\"}}{CALL_END}"
                          f"{CALL}get_time{SEP}{{\"zone\": \"CET\",\n \"format\": \"24h\"}}{CALL_END}{END}")
KIMI_BEGIN, KIMI_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
    "<|tool_call_end|>")
KIMI_TWO_CALLS = (f"Let me check both.{KIMI_BEGIN}{KIMI_CALL}functions.get_weather:0{KIMI_ARGS}{{\"city\": \"Paris\"}}"
                  f"{KIMI_CALL_END}{KIMI_CALL} functions.get_time:1\n{KIMI_ARGS}{{\"zone\": \"CET\",\n \"format\": \"24h\"}}"
                  f"{KIMI_CALL_END}{KIMI_END}")


@pytest.mark.parametrize(("parser", "text", "ids"), [
    ("deepseek_v31", DEEPSEEK_V31_TWO_CALLS, None),
    ("kimi_k2", KIMI_TWO_CALLS, ["functions.get_weather:0", "functions.get_time:1"]),  # Kimi's own ids, as vLLM's
])
def test_deepseek_v31_and_kimi_k2_calls_are_read_with_the_content_before_them(parser: str, text: str,
                                                                              ids: list[str] | None) -> None:
    content, calls = parse_tool_calls(parser, text)
    assert content == "Let me check both."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET",\n "format": "24h"}')]
    assert [c.id for c in calls] == ids if ids else all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize(("parser", "text"), [
    ("deepseek_v31", DEEPSEEK_TWO_CALLS),  # V3's format is not V3.1's (its name would be "function"): content
    ("deepseek_v3", DEEPSEEK_V31_TWO_CALLS),
    ("deepseek_v31", f"{BEGIN}{CALL}f{SEP}not JSON{CALL_END}{END}"),
    ("deepseek_v31", f"{BEGIN}{CALL}{SEP}{{}}{CALL_END}{END}"),  # no name
    ("deepseek_v31", f"{BEGIN}{CALL}f{SEP}{{}}{CALL_END}{CALL}g{SEP}{{"),  # ran out mid-call
    ("kimi_k2", f"{KIMI_BEGIN}{KIMI_CALL}functions.f:0{KIMI_ARGS}not JSON{KIMI_CALL_END}{KIMI_END}"),
    ("kimi_k2", f"{KIMI_BEGIN}{KIMI_CALL}functions.f{KIMI_ARGS}{{}}{KIMI_CALL_END}{KIMI_END}"),  # no index
    ("kimi_k2", f"{KIMI_BEGIN}{KIMI_CALL}functions.f:0{KIMI_ARGS}{{}}{KIMI_CALL_END}{KIMI_CALL}functions.g:1"),
])
def test_a_reply_in_another_format_or_without_valid_calls_is_all_content(parser: str, text: str) -> None:
    assert parse_tool_calls(parser, text) == (text, [])


# Qwen3-Coder's XML calls, typed by the request's tools (vLLM's qwen3_coder parser's conversions)
QWEN3_CODER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "limit": {"type": ["number", "null"]}, "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}, "offset": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "ping"}},
]
QWEN3_CODER = TypedToolFormat.of("qwen3_coder", QWEN3_CODER_TOOLS)
QWEN3_CODER_GROWING = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nFran</cisco>\n\n</parameter>\n"
                       "<parameter=note>\n<b>bold</b> \\ \"q\"\n</parameter>\n<parameter=days>\n12\n</parameter>\n"
                       "</function>\n</tool_call>")  # string values streamed as they grow, markup-like text inside
QWEN3_CODER_TWO_CALLS = (
    "Let me check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 12]\n"
    "</parameter>\n<parameter=limit>\n2.5\n</parameter>\n<parameter=zip>\n02134\n</parameter>\n"
    "<parameter=note>\n  two\nlines \n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nnull\n</parameter>\n<parameter=offset>\n2.0\n</parameter>\n"
    "</function>\n</tool_call>")


def test_qwen3_coder_calls_are_typed_by_the_requests_tools() -> None:
    """Each parameter's text becomes what its tool's schema says, as vLLM 0.32's parser converts it (a string stays
    text however it looks — "02134", "null" —; an integer, a boolean, an array, a number — integral ones as
    integers —, null where the types allow null); a parameter the tool does not declare stays text, one newline
    trimmed at each end and nothing else (``benchmarks/tool_parser_parity.py`` runs such replies through vLLM's own
    parser)."""
    content, calls = parse_tool_calls(QWEN3_CODER, QWEN3_CODER_TWO_CALLS)
    assert content == "Let me check both."  # the newline Qwen's template writes before a call is not content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [9, 12], "limit": 2.5,
                         "zip": "02134", "note": "  two\nlines "}),
        ("get_time", {"zone": "null", "offset": 2})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    # a value that is not what its type says stays text; an unknown tool's parameters are text; unclosed tags
    # (the reply ran out) still end at the next parameter or the end
    _, (odd,) = parse_tool_calls(QWEN3_CODER, "<tool_call><function=get_weather><parameter=days>three"
                                              "<parameter=limit>inf</function></tool_call>")
    assert json.loads(odd.arguments) == {"days": "three", "limit": "inf"}
    _, (nulls,) = parse_tool_calls(QWEN3_CODER, "<tool_call><function=get_weather><parameter=limit>null</parameter>"
                                                "<parameter=metric>0</parameter></function></tool_call>")
    assert json.loads(nulls.arguments) == {"limit": None, "metric": False}
    _, (unknown,) = parse_tool_calls(QWEN3_CODER, "<tool_call><function=other><parameter=n>1</parameter></function>")
    assert (unknown.name, json.loads(unknown.arguments)) == ("other", {"n": "1"})
    _, (bare,) = parse_tool_calls(QWEN3_CODER, "<tool_call>\n<function=ping>\n</function>\n</tool_call>")
    assert (bare.name, bare.arguments) == ("ping", "{}")
    assert schema_types({"enum": [1, "a", None, True]}) == {"integer", "string", "null", "boolean"}
    assert schema_types({"type": "Float"}) == {"number"} and schema_types({}) == schema_types(None) == {"string"}
    assert schema_types({"oneOf": [{"type": "int"}, {"type": "array"}]}) == {"integer", "array"}
    # a model that leaves <tool_call> out: bare functions are calls too (as vLLM reads them)
    content, bare = parse_tool_calls(QWEN3_CODER, "Sure.\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
                                                  "</function>\n<function=ping>\n</function>")
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in bare] == [
        ("get_weather", {"days": 2}), ("ping", {})]
    # the same text without the request's tools: every value is text
    untyped = TypedToolFormat.of("qwen3_coder", [])
    assert json.loads(parse_tool_calls(untyped, QWEN3_CODER_TWO_CALLS)[1][0].arguments)["days"] == "3"


@pytest.mark.parametrize("text", [
    "plain text, no call",
    "<tool_call>not a function</tool_call>",  # no <function=…>
    "<tool_call><function=>\n</function></tool_call>",  # no name
    "<tool_call><function=f></function><function=g></function></tool_call>",  # two in one block
    "<tool_call><function=f><parameter=>1</parameter></function></tool_call>",  # a parameter without a name
    "<function=>\n</function>",  # a bare function without a name
])
def test_a_qwen3_coder_reply_without_valid_calls_is_all_content(text: str) -> None:
    assert parse_tool_calls(QWEN3_CODER, text) == (text, [])


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 11, 1000])
@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", TWO_CALLS), ("hermes", "no call here, though it ends in <tool_c"),
    ("hermes", "a <tool_call> that is not one"), ("hermes", HERMES_UNCANONICAL), ("deepseek_v3", DEEPSEEK_TWO_CALLS),
    ("deepseek_v3", f"no call here, though it ends in {BEGIN[:4]}"), ("deepseek_v3", f"a {BEGIN} that is not one"),
    ("deepseek_v3", f"{BEGIN}{CALL}function{SEP}f\n```json\n{{\"a\": \"``\"}}\n``` \n {CALL_END}{END}"),
    ("deepseek_v31", DEEPSEEK_V31_TWO_CALLS), ("kimi_k2", KIMI_TWO_CALLS),
    ("kimi_k2", f"no call here, though it ends in {KIMI_BEGIN[:6]}"), (QWEN3_CODER, QWEN3_CODER_TWO_CALLS),
    (QWEN3_CODER, "no call here, though it ends in <tool_ca"), (QWEN3_CODER, "no call, spaces \n\n and all \n"),
    (QWEN3_CODER, "  \n" + QWEN3_CODER_TWO_CALLS[19:]), (QWEN3_CODER, QWEN3_CODER_GROWING),
    (QWEN3_CODER, "Sure.\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                  "<function=ping>\n</function>"), (QWEN3_CODER, "a <functio"),
    (ForcedToolChoice(None), '[{"name": "get_weather", "parameters": {"city":"Paris","days":2}},\n {"name":"ping",'
                             '"parameters":{}}]')])
def test_a_streamed_reply_gives_the_content_then_the_calls_as_they_are_written(
        parser: str | TypedToolFormat, text: str, piece: int) -> None:
    """Streamed in pieces of any size: the content goes out before the first call (a possible start of one held
    back, then released when it is not one), then each call — its id and name once, its arguments in pieces whose
    concatenation is what the whole reply reads (the ids the same) —, and no piece of a call goes out before the
    model has written it."""
    stream = ToolCallStream(parser)
    sent, pieces, early = "", defaultdict(list), 0
    for at in range(0, len(text), piece):
        content, deltas = stream.push(text[at:at + piece])
        sent += content
        for delta in deltas:
            pieces[delta.index].append(delta)
            if parser in ("deepseek_v3", "deepseek_v31", "kimi_k2"):  # their arguments go out as written
                assert delta.arguments in text
        early += len(deltas)
    assert not any(marker in sent for marker in stream.start_markers) or not parse_tool_calls(parser, text)[1]
    tail, last, calls = stream.finish()
    for delta in last:
        pieces[delta.index].append(delta)
    content, expected = parse_tool_calls(parser, text)
    assert sent + tail == (content or "") if expected else sent + tail == text
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
    assert sorted(pieces) == list(range(len(calls)))
    for index, call in enumerate(calls):
        first, *rest = pieces[index]
        assert (first.id, first.name) == (call.id, call.name) and all(d.name is None for d in rest)
        assert first.arguments + "".join(d.arguments for d in rest) == call.arguments
    if expected and piece < 10:  # the calls go out before the reply ends
        assert early > len(calls)


def test_a_long_argument_goes_out_as_it_is_written() -> None:
    """A DeepSeek-V3 or hermes call whose arguments hold a long text, and a Qwen3-Coder string parameter: most of the arguments
    have gone out before the call ends (a tail that may be the end marker is held), never more than was written."""
    body = "z" * 400
    deepseek = f"{BEGIN}{CALL}function{SEP}write\n```json\n{{\"text\": \"{body}\"}}\n```{CALL_END}{END}"
    xml = f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{body}\n</parameter>\n</function>\n</tool_call>"
    hermes = f'<tool_call>\n{{"name": "write", "arguments": {{"text": "{body}"}}}}\n</tool_call>'
    for parser, text in (("deepseek_v3", deepseek), (QWEN3_CODER, xml), ("hermes", hermes)):
        stream = ToolCallStream(parser)
        cut = text.index(body) + 300
        got = "".join(d.arguments for d in stream.push(text[:cut])[1])
        assert got.count("z") == 300 and got.endswith("z" * 300)  # all of it that was written, nothing after
        got += "".join(d.arguments for d in stream.push(text[cut:])[1])
        _, last, calls = stream.finish()
        assert got + "".join(d.arguments for d in last) == calls[0].arguments


def test_calls_that_went_out_stay_calls_though_the_reply_then_breaks_them() -> None:
    """A stream cannot take back what it sent: a DeepSeek-V3 call whose arguments turn out not to be JSON, after
    their start went out, ends as the call that was sent (the whole reply reads as content, as vLLM's would differ)."""
    text = f"ok{BEGIN}{CALL}function{SEP}f\n```json\n{{\"a\": 1,,}}\n```{CALL_END}{END}"
    stream = ToolCallStream("deepseek_v3")
    content, deltas = stream.push(text)
    assert content == "ok" and deltas and deltas[0].name == "f"
    tail, _, calls = stream.finish()
    assert tail == "" and [(c.name, c.arguments, c.id) for c in calls] == [("f", '{"a": 1,,}', deltas[0].id)]
    assert parse_tool_calls("deepseek_v3", text) == (text, [])


def test_a_named_forced_function_streams_its_arguments_as_written_and_required_calls_as_they_are_written() -> None:
    """``tool_choice`` naming a function: the whole reply is its arguments, sent as they come (not before a
    non-blank character); "required": a JSON list of calls, each sent once its name is written, its parameters
    re-encoded as they are written (the whole reply re-encodes them): the pieces add up to the whole reply's calls."""
    named = ToolCallStream(ForcedToolChoice("f"))
    pieces = [named.push(text)[1] for text in ("  ", '{"a"', ": 1}")]
    assert pieces[0] == [] and [d.arguments for d in pieces[1] + pieces[2]] == ['  {"a"', ": 1}"]
    assert pieces[1][0].name == "f" and named.finish()[2][0].arguments == '  {"a": 1}'
    reply = '[{"name":"f","parameters":{"a":1.50,"s":"\\u00e9"}}, {"name": "g", "parameters": {}}]'
    for piece in (1, 3, len(reply)):
        required = ToolCallStream(ForcedToolChoice(None))
        deltas = [d for at in range(0, len(reply), piece) for d in required.push(reply[at:at + piece])[1]]
        early = len(deltas)
        _, last, calls = required.finish()
        assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1.5, "s": "é"}'), ("g", "{}")]
        joined: dict[int, list[str]] = {}
        for delta in deltas + last:
            joined.setdefault(delta.index, [delta.name or "", ""])[1] += delta.arguments
        assert [tuple(joined[i]) for i in sorted(joined)] == [(c.name, c.arguments) for c in calls]
        assert [d.id for d in deltas + last if d.name is not None] == [c.id for c in calls]
        assert early > 2 if piece == 1 else early >= 1  # the calls went out as they were written
    one = ToolCallStream(ForcedToolChoice(None, parallel=False), one_call=True)
    assert [d.name for d in one.push('[{"name": "f", "parameters": {}}')[1]] == ["f"]


def test_parallel_tool_calls_false_streams_the_first_call_only() -> None:
    stream = ToolCallStream("kimi_k2", one_call=True)
    _, deltas = stream.push(KIMI_TWO_CALLS)
    _, last, calls = stream.finish()
    assert {d.index for d in deltas + last} == {0} and [c.name for c in calls] == ["get_weather"]


def test_the_operator_offers_the_runtimes_parsers() -> None:
    pytest.importorskip("kopf")
    from vexpert_operator.api import RuntimeSpec

    field = RuntimeSpec.model_fields["tool_call_parser"].annotation
    literals = [arg for arg in typing.get_args(field) if arg is not type(None)]
    assert {value for literal in literals for value in typing.get_args(literal)} == set(PARSERS) == {
        "hermes", "deepseek_v3", "deepseek_v31", "kimi_k2", "qwen3_coder"}
