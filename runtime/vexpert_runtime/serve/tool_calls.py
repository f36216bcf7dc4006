"""Tool calls out of a chat reply's text, as vLLM's ``--tool-call-parser hermes`` reads them.

Qwen2.5 / Qwen3(-MoE) and Hermes models call tools by writing ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
blocks (their chat templates say so when a request gives ``tools``); ``<tool_call>`` is an ordinary added token
there, so it stays in the decoded text. :func:`parse_hermes` splits a finished reply into its content (the text
before the first block) and its calls; :class:`ToolCallStream` does it for a streamed reply: content goes out as
it comes until a block starts (a tail that could be the start of ``<tool_call>`` is held back), the rest waits
for the end, where the calls go out in one delta. A block that is not valid JSON with a string ``name`` leaves
the reply as plain content — nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes",)  # ``vexpert serve --tool-call-parser``
_START, _END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply: the text before the first ``<tool_call>`` (None when that is
    only whitespace and there are calls) and every block's call; ``(text, [])`` when there is no block or
    any block is not a call."""
    start = text.find(_START)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[start:]):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                                  ensure_ascii=False),
                              f"chatcmpl-tool-{uuid.uuid4().hex}"))
    content = text[:start]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """A streamed reply's content, held back from the first ``<tool_call>`` on (see the module docstring)."""

    def __init__(self) -> None:
        self.held = ""  # a possible start of a block, or (``in_calls``) the blocks
        self.in_calls = False

    def push(self, text: str) -> str:
        """The content of ``text`` safe to send now."""
        if self.in_calls:
            self.held += text
            return ""
        buffer = self.held + text
        at = buffer.find(_START)
        if at >= 0:
            self.in_calls = True
            out, self.held = buffer[:at], buffer[at:]
            return out
        keep = next((n for n in range(min(len(_START) - 1, len(buffer)), 0, -1) if _START.startswith(buffer[-n:])), 0)
        out, self.held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: (content still to send, the calls). Held text that is not calls is content."""
        _, calls = parse_hermes(self.held)
        return ("", calls) if calls else (self.held, [])
