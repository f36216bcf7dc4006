"""Tool calls out of a chat reply's text, as vLLM's ``--tool-call-parser hermes`` / ``deepseek_v3`` read them.

* ``hermes`` — Qwen2.5 / Qwen3(-MoE) and Hermes models call tools by writing
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks (their chat templates say so when a request gives
  ``tools``); ``<tool_call>`` is an ordinary added token there, so it stays in the decoded text.
* ``deepseek_v3`` — DeepSeek-V3 (and R1-0528) write ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``, a newline, the arguments in a fenced ``json`` block and
  ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``. Those markers may be special tokens, which the text leaves out by default, so a request
  whose tools may be called is detokenized with its special tokens (:data:`KEEPS_SPECIAL_TOKENS`, as vLLM's
  parser asks for ``skip_special_tokens=False``).
* ``deepseek_v31`` — DeepSeek-V3.1 (and V3.2's chat format) drop the type and the fenced block:
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`` inside the same calls markers.
* ``kimi_k2`` — Kimi K2 writes ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>functions.NAME:INDEX``
  ``<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>``, then ``<|tool_calls_section_end|>``; the header is the
  call's id (as vLLM returns it). Both keep their special tokens in the text, as ``deepseek_v3``.
* ``qwen3_coder`` — Qwen3-Coder (its MoE models: 30B-A3B, 480B-A35B) writes each call as XML,
  ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function></tool_call>`` (or, leaving the wrapper out,
  a bare ``<function=…>``, which vLLM reads too), every value as plain text.
  What a value is comes from the request's tools (:class:`TypedToolFormat`: that parameter's JSON-schema types), as
  vLLM 0.32's parser reads it (:func:`_typed_value`): a string parameter's text stays text, an integer's is parsed,
  and so on; a parameter the tool does not declare stays text.

:func:`parse_tool_calls` splits a finished reply into its content (the text before the first call) and its calls;
:func:`partial_calls` reads the calls a reply has begun as far as they are written, which
:class:`~.tool_call_stream.ToolCallStream` sends as they come. A call that does not parse (arguments that are not JSON,
a missing name) leaves the reply as plain content — nothing the model wrote is dropped.

:class:`ForcedToolChoice` is ``tool_choice`` ``"required"`` or a named function, as vLLM serves them: the reply is
constrained to JSON (:meth:`ForcedToolChoice.schema`, through structured output) — the named function's arguments,
or a list of ``{"name", "parameters"}`` calls of the request's tools — and read back as the calls whatever the model's
own format; it needs no ``--tool-call-parser``.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from vexpert_runtime.serve.json_prefix import json_prefix

# ``vexpert serve --tool-call-parser``, ``spec.runtime.toolCallParser``
ToolCallParser = Literal["hermes", "deepseek_v3", "deepseek_v31", "kimi_k2", "qwen3_coder"]
PARSERS: tuple[str, ...] = get_args(ToolCallParser)
KEEPS_SPECIAL_TOKENS = frozenset({"deepseek_v3", "deepseek_v31", "kimi_k2"})  # formats whose markers may be special tokens
_HERMES_START = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_DEEPSEEK_START = "<｜tool▁calls▁begin｜>"
# each call's header (its name, and id, known; its arguments begun) — a stream's start of a call — and the whole call
_DEEPSEEK_HEADER = r"<｜tool▁call▁begin｜>(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n"
_DEEPSEEK_CALL = re.compile(_DEEPSEEK_HEADER + r"(?P<arguments>.*?)\n```\s*<｜tool▁call▁end｜>", re.DOTALL)
_DEEPSEEK_CALL_START = "<｜tool▁call▁begin｜>"
_DEEPSEEK_V31_HEADER = r"<｜tool▁call▁begin｜>(?P<name>[^<]*?)<｜tool▁sep｜>"
_DEEPSEEK_V31_CALL = re.compile(_DEEPSEEK_V31_HEADER + r"(?P<arguments>.*?)<｜tool▁call▁end｜>", re.DOTALL)
_KIMI_START = "<|tool_calls_section_begin|>"
_KIMI_CALL_START = "<|tool_call_begin|>"
_KIMI_HEADER = r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?:\d+)\s*<\|tool_call_argument_begin\|>"
_KIMI_CALL = re.compile(_KIMI_HEADER + r"(?P<arguments>.*?)<\|tool_call_end\|>", re.DOTALL)
TYPED_PARSERS = frozenset({"qwen3_coder"})  # formats whose arguments are read with the request's tools' types


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON string (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str
    id: str

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        entry: dict[str, Any] = {"id": self.id, "type": "function",
                                 "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _hermes_calls(text: str) -> list[ToolCall] | None:
    """The calls of the blocks in ``text`` (which starts at the first block); None if any is not a call."""
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                                  ensure_ascii=False),
                              new_call_id()))
    return calls


def _marked_calls(text: str, pattern: re.Pattern[str], call_start: str,
                  read: Callable[[re.Match[str]], tuple[str, str, str | None]]) -> list[ToolCall] | None:
    """The calls ``pattern`` matches in ``text``, one for each ``call_start`` marker; ``read(match)`` gives a call's
    name, arguments (passed on as written, as vLLM's parsers do) and id (None: a new one). None if a call does not
    parse, has no name or its arguments are not JSON."""
    found = list(pattern.finditer(text))
    if len(found) != text.count(call_start) or not found:
        return None
    calls = []
    for match in found:
        name, arguments, call_id = read(match)
        if not name or not _is_json(arguments):
            return None
        calls.append(ToolCall(name, arguments, call_id or new_call_id()))
    return calls


def _deepseek_calls(text: str) -> list[ToolCall] | None:
    """DeepSeek-V3's calls (from ``<｜tool▁calls▁begin｜>`` on): ``function<｜tool▁sep｜>NAME`` and the arguments in a
    fenced json block."""
    return _marked_calls(text, _DEEPSEEK_CALL, _DEEPSEEK_CALL_START,
                         lambda match: (match["name"].strip(), match["arguments"], None))


def _deepseek_v31_calls(text: str) -> list[ToolCall] | None:
    """DeepSeek-V3.1's calls: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`` (no type, no
    fenced block)."""
    return _marked_calls(text, _DEEPSEEK_V31_CALL, _DEEPSEEK_CALL_START,
                         lambda match: (match["name"].strip(), match["arguments"], None))


def _kimi_calls(text: str) -> list[ToolCall] | None:
    """Kimi K2's calls: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS
    <|tool_call_end|>``; the header is the call's id (Kimi's own, as vLLM returns it), NAME its function."""

    def read(match: re.Match[str]) -> tuple[str, str, str | None]:
        call_id = match["id"].strip()
        return call_id.split(":")[0].removeprefix("functions."), match["arguments"], call_id

    return _marked_calls(text, _KIMI_CALL, _KIMI_CALL_START, read)


# JSON-schema type names as tools write them → the types :func:`_typed_value` tries (vLLM's aliases)
_TYPE_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
                 "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
                 "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer", "float": "number",
                 "float32": "number", "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
                 "arr": "array", "list": "array", "sequence": "array"}
_ENUM_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's ``schema`` allows: its ``type`` (one or a list), its ``enum`` values' types,
    those of its ``anyOf`` / ``oneOf`` / ``allOf`` choices; ``{"string"}`` when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    kinds = schema.get("type")
    types = set()
    if isinstance(kinds, str):
        types.add(kinds)
    elif isinstance(kinds, list):
        types |= {kind for kind in kinds if isinstance(kind, str)}
    for value in schema.get("enum") or ():  # (bool before int: True is an int too)
        types.add(next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)), "string"))
    for field in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(field) or ():
            types |= schema_types(choice)
    return {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types} or {"string"}


def _finite_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def _typed_value(text: str, types: set[str]) -> Any:
    """A ``qwen3_coder`` parameter's text as the first of its ``types`` it reads as, in the order null, integer,
    number (an integral one as an integer), boolean (``true`` / ``1``, ``false`` / ``0``), object, array, string;
    when none fits, its JSON value if it is JSON, else the text — vLLM 0.32's ``coerce_to_schema_type``."""
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in types:
            continue
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        if kind == "boolean" and text.lower().strip() in ("true", "1", "false", "0"):
            return text.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if _finite_json(parsed):
                return parsed
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if _finite_json(parsed) else text


def _qwen3_coder_calls(text: str, parameters: Mapping[str, Mapping[str, Any]]) -> list[ToolCall] | None:
    """Qwen3-Coder's calls (from the first ``<tool_call>`` on): one ``<function=NAME>`` per block, its parameters'
    texts typed by ``parameters`` (function name → its parameters' schemas). None if a block holds no function or
    more than one, or a function or parameter has no name."""
    calls = []
    for block in _xml_blocks(text):
        function = _xml_function(block)
        if function is None or block.count("<function=") != 1:
            return None
        name, body, _ = function
        if any(not key for key, _, _ in _xml_parameters(body)):
            return None
        calls.append(ToolCall(name, _xml_arguments(body, parameters.get(name, {}), True), new_call_id()))
    return calls or None


_XML_FUNCTION_START = "<function="


def _xml_blocks(text: str) -> list[str]:
    """``qwen3_coder``'s call blocks of ``text`` (from its calls' start on): each ``<tool_call>`` block, or — where the
    calls start with a bare ``<function=`` — each function from its start to the next."""
    if not text.startswith(_XML_FUNCTION_START):
        return _HERMES_BLOCK.findall(text)
    return [_XML_FUNCTION_START + piece for piece in text.split(_XML_FUNCTION_START)[1:]]


def _xml_function(block: str) -> tuple[str, str, bool] | None:
    """(name, body, closed) of the first ``<function=NAME>`` in ``block``: its body the text up to ``</function>``
    (closed) or to the block's end; None before its name is written, or where it has none."""
    at = block.find("<function=")
    close = block.find(">", at) if at >= 0 else -1
    if close < 0 or "\n" in block[at:close] or not block[at + 10:close].strip():
        return None
    end = block.find("</function>", close)
    return block[at + 10:close].strip(), block[close + 1:] if end < 0 else block[close + 1:end], end >= 0


def _xml_parameters(body: str) -> list[tuple[str, str, bool]]:
    """(key, raw value, ended) of each ``<parameter=KEY>`` in a function's ``body``, in order: a value ends at
    ``</parameter>``, at the next ``<parameter=`` or at ``</function>``, whichever comes first (the last one may still
    be growing: not ended). With ``str.find``, not a regex: a stream reads a growing call at every token."""
    found: list[tuple[str, str, bool]] = []
    at = body.find("<parameter=")
    while at >= 0:
        close = body.find(">", at)
        if close < 0 or "\n" in body[at:close]:
            break
        key, start = body[at + 11:close].strip(), close + 1
        ends = [(end, marker) for marker in ("</parameter>", "<parameter=", "</function>")
                if (end := body.find(marker, start)) >= 0]
        if not ends:
            found.append((key, body[start:], False))
            break
        end, marker = min(ends)
        found.append((key, body[start:end], True))
        at = body.find("<parameter=", end + len(marker) if marker == "</parameter>" else end)
    return found


def _terminator_hold(text: str, terminator: re.Pattern[str]) -> str:
    """``text`` less the shortest tail that may be the start of what ends it (``terminator`` full-matches every
    prefix of that end; each such end starts with a newline or ``<``, so only those positions are tried)."""
    for at in range(max(0, len(text) - 64), len(text)):
        if text[at] in "\n<" and terminator.fullmatch(text, at):
            return text[:at]
    return text


def _prefixes(marker: str) -> str:
    """A regex alternation of ``marker``'s non-empty prefixes, longest first."""
    return "|".join(re.escape(marker[:n]) for n in range(len(marker), 0, -1))


# what may end a parameter's value where a block is still being written (each full-matches its prefixes)
_XML_VALUE_END = re.compile("|".join(_prefixes(marker) for marker in (
    "\n</parameter>", "\n<parameter=", "\n</function>", "\n</tool_call>", "</parameter>", "<parameter=",
    "</function>", "</tool_call>")))


def _xml_arguments(body: str, declared: Mapping[str, Any], closed: bool) -> str:
    """A ``qwen3_coder`` function's arguments JSON from its ``body`` (the text after ``<function=NAME>``) — whole
    where ``closed``, else as far as it is written, and only ever extended by what follows: ``{"key": value, …``
    for its finished parameters (each typed by its ``declared`` schema; an undeclared one is text), a string
    parameter's text as it grows (JSON-escaped, a possible end of it held back; a typed one waits for its end),
    ``}`` once the function closes. One definition for the whole reply and its stream."""
    written: list[str] = []
    for key, value, ended in _xml_parameters(body):
        if ended or closed:
            value = value.removeprefix("\n").removesuffix("\n")
            typed = _typed_value(value, schema_types(declared[key])) if key in declared else value
            written.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}")
            continue
        if (key in declared and schema_types(declared[key]) != {"string"}) or not value:
            break  # a typed value waits for its end (its JSON depends on all of it); an empty one for its first newline
        growing = _terminator_hold(value.removeprefix("\n"), _XML_VALUE_END)
        written.append(f"{json.dumps(key, ensure_ascii=False)}: " + json.dumps(growing, ensure_ascii=False)[:-1])
    return "{" + ", ".join(written) + ("}" if closed else "")


@dataclass(frozen=True, eq=False)
class TypedToolFormat:
    """A parser whose calls write every argument as text (:data:`TYPED_PARSERS`), with what the request's tools say
    each parameter is: ``parameters`` maps a function's name to its parameters' JSON schemas (``properties``)."""

    parser: str
    parameters: Mapping[str, Mapping[str, Any]]

    @classmethod
    def of(cls, parser: str, tools: list[dict[str, Any]]) -> TypedToolFormat:
        """From the request's ``tools`` (OpenAI's ``{"type": "function", "function": {"name", "parameters"}}``)."""
        parameters = {}
        for tool in tools:
            schema = tool.get("function", {}).get("parameters") or {}
            parameters[tool["function"]["name"]] = schema.get("properties", {}) if isinstance(schema, dict) else {}
        return cls(parser, parameters)

    def calls(self, text: str) -> list[ToolCall] | None:
        return _qwen3_coder_calls(text, self.parameters)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


_FORMATS: dict[str, tuple[str, Callable[[str], list[ToolCall] | None]]] = {
    "hermes": (_HERMES_START, _hermes_calls),
    "deepseek_v3": (_DEEPSEEK_START, _deepseek_calls),
    "deepseek_v31": (_DEEPSEEK_START, _deepseek_v31_calls),
    "kimi_k2": (_KIMI_START, _kimi_calls),
}


@dataclass(frozen=True)
class ForcedToolChoice:
    """``tool_choice`` that forces a call: ``function`` named, or None for ``"required"`` (one call or more of any
    of the tools; ``parallel`` False: exactly one)."""

    function: str | None
    parallel: bool = True

    def schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON schema the reply follows, from the request's ``tools`` (OpenAI's ``{"type": "function",
        "function": {"name", "parameters"}}``), as vLLM builds it: the named function's parameters, or an array of
        ``{"name": that tool's name, "parameters": its parameters}`` objects, and no other key (``$defs`` of the tools
        merged)."""
        functions = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object", "properties": {}}
                     for tool in tools}
        if self.function is not None:
            return functions[self.function]
        defs: dict[str, Any] = {}
        calls = []
        for name, parameters in functions.items():
            if "$defs" in parameters:
                parameters = dict(parameters)
                defs.update(parameters.pop("$defs"))
            # (closed: vLLM's leaves the call object open, and a model may then write keys of its own after the two)
            calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls a reply wrote (None: it is not what the schema asks, e.g. cut short by max_tokens)."""
        if self.function is not None:
            return [ToolCall(self.function, text, new_call_id())] if text.strip() else None
        try:
            written = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(written, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                     for c in written):
            return None
        return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False), new_call_id())
                for c in written] or None

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: a named function's reply finishes with "stop", a required call with "tool_calls"."""
        return reason if self.function is not None else "tool_calls" if reason == "stop" else reason


# how a reply's calls are read: a parser of :data:`PARSERS` (one of :data:`TYPED_PARSERS` with the request's tools), or
# a forced choice
ToolFormat = str | TypedToolFormat | ForcedToolChoice


def calls_finish_reason(tools: ToolFormat, reason: str) -> str:
    """The finish reason of a reply that called tools (finished for ``reason``)."""
    if isinstance(tools, ForcedToolChoice):
        return tools.finish_reason(reason)
    return "tool_calls" if reason == "stop" else reason


def parse_tool_calls(parser: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply in ``parser``'s format (:data:`PARSERS`, or a forced choice: the whole
    reply is its calls): the text before the calls start (None when that is only whitespace and there are calls)
    and the calls; ``(text, [])`` when the reply calls nothing or any call does not parse."""
    if isinstance(parser, ForcedToolChoice):
        forced = parser.calls(text)
        return (None, forced) if forced else (text, [])
    read_calls = parser.calls if isinstance(parser, TypedToolFormat) else _FORMATS[parser][1]
    start = first_marker(text, start_markers(parser))
    if start < 0:
        return text, []
    calls = read_calls(text[start:])
    if not calls:
        return text, []
    content = text[:start].rstrip() if trims_content(parser) else text[:start]
    return (content if content.strip() else None), calls


def trims_content(parser: ToolFormat) -> bool:
    """Whether the content before a reply's calls loses its trailing whitespace (the newline Qwen's template writes
    before ``<tool_call>``): ``qwen3_coder``'s, as vLLM 0.32's parser gives it."""
    return isinstance(parser, TypedToolFormat)


def start_markers(parser: ToolFormat) -> tuple[str, ...]:
    """The texts a reply's calls may start with in ``parser``'s format (none for a forced choice: the whole reply is
    its calls); ``qwen3_coder``: ``<tool_call>``, or a bare ``<function=`` (as vLLM reads a model that leaves the
    wrapper out)."""
    if isinstance(parser, ForcedToolChoice):
        return ()
    return (_HERMES_START, _XML_FUNCTION_START) if isinstance(parser, TypedToolFormat) else (_FORMATS[parser][0],)


def first_marker(text: str, markers: tuple[str, ...]) -> int:
    """Where the first of ``markers`` starts in ``text`` (−1: none does)."""
    found = [at for at in (text.find(marker) for marker in markers) if at >= 0]
    return min(found, default=-1)




@dataclass(frozen=True)
class PartialCall:
    """A call as far as a reply has written it: its name (and the id the format gives it, or None), the part of its
    arguments that later text only extends (``arguments``), and where its text ends in the text read (``end``; None
    while it is not complete)."""

    name: str
    id: str | None
    arguments: str
    end: int | None


# (call start, a started call's header, the end of a call, what ends the arguments — full-matching each of its
# prefixes —, the complete call, a header match read as (name, id))
_MARKED_PARTIAL: dict[str, tuple[str, re.Pattern[str], str, re.Pattern[str], re.Pattern[str],
                                 Callable[[re.Match[str]], tuple[str, str | None]]]] = {
    "deepseek_v3": (_DEEPSEEK_CALL_START,
                    re.compile(_DEEPSEEK_HEADER),
                    "<｜tool▁call▁end｜>",
                    re.compile(r"\n(?:`{0,3}|```\s*(?:" + _prefixes("<｜tool▁call▁end｜>") + ")?)", re.DOTALL),
                    _DEEPSEEK_CALL, lambda match: (match["name"].strip(), None)),
    "deepseek_v31": (_DEEPSEEK_CALL_START, re.compile(_DEEPSEEK_V31_HEADER),
                     "<｜tool▁call▁end｜>", re.compile(_prefixes("<｜tool▁call▁end｜>")), _DEEPSEEK_V31_CALL,
                     lambda match: (match["name"].strip(), None)),
    "kimi_k2": (_KIMI_CALL_START,
                re.compile(_KIMI_HEADER),
                "<|tool_call_end|>", re.compile(_prefixes("<|tool_call_end|>")), _KIMI_CALL,
                lambda match: (match["id"].strip().split(":")[0].removeprefix("functions."), match["id"].strip())),
}


def partial_calls(parser: ToolFormat, text: str) -> list[PartialCall]:
    """The calls ``text`` (a reply from its calls' start marker, or from a call's start, on) has begun, in order, each
    as far as it is written — what a stream sends of them before the reply ends. Formats whose arguments are written
    as they are sent (deepseek_v3, deepseek_v31, kimi_k2) give them as they grow; ``qwen3_coder`` its JSON as its
    parameters come (a string parameter's text as it grows); ``hermes`` and ``tool_choice`` "required" (a JSON list
    of calls) their arguments re-encoded as they are written (the whole reply re-encodes them: :mod:`.json_prefix`); a
    named forced function its arguments (the whole reply) as written. A stream reads only from
    the first call not yet complete (``end``): what it reads at every token grows with one call, not with the reply."""
    if isinstance(parser, ForcedToolChoice):
        if parser.function is None:
            return _required_calls(text)
        return [PartialCall(parser.function, None, text, None)] if text.strip() else []
    if isinstance(parser, TypedToolFormat) or parser == "hermes":
        return _block_calls(parser, text)
    call_start, header, call_end, terminator, whole, read = _MARKED_PARTIAL[parser]
    found = []
    at = text.find(call_start)
    while at >= 0:
        following = text.find(call_start, at + len(call_start))
        segment = text[at:] if following < 0 else text[at:following]
        begun = header.match(segment)
        if begun is None:
            break
        name, call_id = read(begun)
        complete = whole.match(segment) if call_end in segment else None
        if complete is None:  # (a call followed by another that did not complete: the stream stops at it)
            found.append(PartialCall(name, call_id, _terminator_hold(segment[begun.end():], terminator), None))
            break
        found.append(PartialCall(name, call_id, complete["arguments"], at + complete.end()))
        at = following
    return found


def _block_calls(parser: str | TypedToolFormat, text: str) -> list[PartialCall]:
    """:func:`partial_calls` of the ``<tool_call>`` block formats: ``hermes`` (its arguments re-encoded as they are
    written, :func:`_hermes_partial`) and ``qwen3_coder`` (its arguments as they are written)."""
    if isinstance(parser, TypedToolFormat) and first_marker(text, start_markers(parser)) == text.find(
            _XML_FUNCTION_START) >= 0:
        return _bare_function_calls(parser, text)
    found = []
    at = text.find(_HERMES_START)
    while at >= 0:
        close = text.find("</tool_call>", at)
        following = text.find(_HERMES_START, at + len(_HERMES_START))
        if isinstance(parser, TypedToolFormat):
            limit = len(text) if following < 0 else following
            block_closed = 0 <= close < limit
            function = _xml_function(text[at + len(_HERMES_START):close if block_closed else limit])
            if function is None:
                break
            name, body, closed = function
            closed = closed or block_closed
            end = (close + len("</tool_call>") if block_closed else limit) if closed else None
            found.append(PartialCall(name, None, _xml_arguments(body, parser.parameters.get(name, {}), closed), end))
            if not closed:
                break
        else:
            if close < 0:
                call = _hermes_partial(text[at + len(_HERMES_START):])
                if call is not None:
                    found.append(call)
                break
            calls = _hermes_calls(text[at:close + len("</tool_call>")])
            if not calls:
                break
            found.append(PartialCall(calls[0].name, None, calls[0].arguments, close + len("</tool_call>")))
        at = following
    return found


_REQUIRED_NEXT = re.compile(r'\s*[\[,]?\s*\{\s*"name"\s*:\s*(?=")')  # a call of the list: its start, to its name
_REQUIRED_PARAMETERS = re.compile(r'\s*,\s*"parameters"\s*:\s*(?=[\[{])')
_REQUIRED_CLOSE = re.compile(r"\s*\}")
_HERMES_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*(?=")')
_HERMES_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(?=[\[{])')


def _json_call(text: str, at: int, head: re.Pattern[str], arguments: re.Pattern[str]
               ) -> tuple[str, str, int | None] | None:
    """A call object written as JSON from ``at``, as far as it is: (its name, its arguments re-encoded as they are
    written — :func:`~.json_prefix.json_prefix` —, where they end or None while they do not); None before its name
    is complete. ``head`` matches up to the name's quote, ``arguments`` the next key up to its object or list (other
    arguments — a string, after other keys — give "" here: the whole call has them)."""
    start = head.match(text, at)
    name = json_prefix(text, start.end()) if start is not None else None
    if name is None or name[1] is None:
        return None
    key = arguments.match(text, name[1])
    written = json_prefix(text, key.end()) if key is not None else None
    return json.loads(name[0]), written[0] if written is not None else "", written[1] if written is not None else None


def _required_calls(text: str) -> list[PartialCall]:
    """:func:`partial_calls` of ``tool_choice`` "required": the reply is a JSON list of ``{"name", "parameters"}``
    objects (the grammar writes the name first); each call as far as it is written (:func:`_json_call`), complete
    once its object closes. ``text`` starts at the list or after a complete call (at the comma before the next)."""
    found = []
    at = 0
    while (call := _json_call(text, at, _REQUIRED_NEXT, _REQUIRED_PARAMETERS)) is not None:
        name, written, written_end = call
        closed = _REQUIRED_CLOSE.match(text, written_end) if written_end is not None else None
        found.append(PartialCall(name, None, written, closed.end() if closed is not None else None))
        if closed is None:
            break
        at = closed.end()
    return found


def _hermes_partial(text: str) -> PartialCall | None:
    """The call of an open ``hermes`` block (``text``: after ``<tool_call>``) as far as it can be sent
    (:func:`_json_call`): nothing before its name is written (the call's first key); its arguments — the next key,
    an object — re-encoded as they are written (the whole call's re-encoded arguments extend them)."""
    call = _json_call(text, 0, _HERMES_NAME, _HERMES_ARGUMENTS)
    return None if call is None else PartialCall(call[0], None, call[1], None)


def _bare_function_calls(parser: TypedToolFormat, text: str) -> list[PartialCall]:
    """:func:`partial_calls` of ``qwen3_coder`` calls written as bare functions (no ``<tool_call>``): each from its
    ``<function=`` to the next, complete once ``</function>`` closes it."""
    found = []
    at = text.find(_XML_FUNCTION_START)
    while at >= 0:
        following = text.find(_XML_FUNCTION_START, at + len(_XML_FUNCTION_START))
        limit = len(text) if following < 0 else following
        function = _xml_function(text[at:limit])
        if function is None:
            break
        name, body, closed = function
        end = text.find("</function>", at) + len("</function>") if closed else None
        found.append(PartialCall(name, None, _xml_arguments(body, parser.parameters.get(name, {}), closed), end))
        if not closed:
            break
        at = following
    return found
