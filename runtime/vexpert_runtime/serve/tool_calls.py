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

:func:`parse_tool_calls` splits a finished reply into its content (the text before the first call) and its calls;
:class:`ToolCallStream` does it for a streamed reply: content goes out as it comes until the calls start (a tail
that could be the start of the marker is held back), the rest waits for the end, where the calls go out in one
delta. A call that does not parse (arguments that are not JSON, a missing name) leaves the reply as plain
content — nothing the model wrote is dropped.

:class:`ForcedToolChoice` is ``tool_choice`` ``"required"`` or a named function, as vLLM serves them: the reply is
constrained to JSON (:meth:`ForcedToolChoice.schema`, through structured output) — the named function's arguments,
or a list of ``{"name", "parameters"}`` calls of the request's tools — and read back as the calls whatever the model's
own format; it needs no ``--tool-call-parser``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

# ``vexpert serve --tool-call-parser``, ``spec.runtime.toolCallParser``
ToolCallParser = Literal["hermes", "deepseek_v3", "deepseek_v31", "kimi_k2"]
PARSERS: tuple[str, ...] = get_args(ToolCallParser)
KEEPS_SPECIAL_TOKENS = frozenset({"deepseek_v3", "deepseek_v31", "kimi_k2"})  # formats whose markers may be special tokens
_HERMES_START = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_DEEPSEEK_START = "<｜tool▁calls▁begin｜>"
_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n"
                            r"(?P<arguments>.*?)\n```\s*<｜tool▁call▁end｜>", re.DOTALL)
_DEEPSEEK_CALL_START = "<｜tool▁call▁begin｜>"
_DEEPSEEK_V31_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>[^<]*?)<｜tool▁sep｜>(?P<arguments>.*?)<｜tool▁call▁end｜>",
                                re.DOTALL)
_KIMI_START = "<|tool_calls_section_begin|>"
_KIMI_CALL_START = "<|tool_call_begin|>"
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?:\d+)\s*<\|tool_call_argument_begin\|>(?P<arguments>.*?)"
                        r"<\|tool_call_end\|>", re.DOTALL)


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


def _new_id() -> str:
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
                              _new_id()))
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
        calls.append(ToolCall(name, arguments, call_id or _new_id()))
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
            return [ToolCall(self.function, text, _new_id())] if text.strip() else None
        try:
            written = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(written, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                     for c in written):
            return None
        return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False), _new_id())
                for c in written] or None

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: a named function's reply finishes with "stop", a required call with "tool_calls"."""
        return reason if self.function is not None else "tool_calls" if reason == "stop" else reason


ToolFormat = str | ForcedToolChoice  # how a reply's calls are read: a parser of :data:`PARSERS`, or a forced choice


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
    start_marker, read_calls = _FORMATS[parser]
    start = text.find(start_marker)
    if start < 0:
        return text, []
    calls = read_calls(text[start:])
    if not calls:
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """A streamed reply's content, held back from the start of the calls on (see the module docstring)."""

    def __init__(self, parser: ToolFormat) -> None:
        self.parser = parser
        forced = isinstance(parser, ForcedToolChoice)  # the whole reply is its calls
        self.start_marker = "" if isinstance(parser, ForcedToolChoice) else _FORMATS[parser][0]
        self.held = ""  # a possible start of the calls, or (``in_calls``) the calls
        self.in_calls = forced

    def push(self, text: str) -> str:
        """The content of ``text`` safe to send now."""
        if self.in_calls:
            self.held += text
            return ""
        marker = self.start_marker
        buffer = self.held + text
        at = buffer.find(marker)
        if at >= 0:
            self.in_calls = True
            out, self.held = buffer[:at], buffer[at:]
            return out
        keep = next((n for n in range(min(len(marker) - 1, len(buffer)), 0, -1) if marker.startswith(buffer[-n:])), 0)
        out, self.held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: (content still to send, the calls). Held text that is not calls is content."""
        _, calls = parse_tool_calls(self.parser, self.held)
        return ("", calls) if calls else (self.held, [])
