"""A streamed chat reply's tool calls, sent as the model writes them (vLLM streams them so).

:class:`ToolCallStream` takes a reply's text as it comes: content goes out until the calls start (a tail that could
be the start of the format's marker is held back), then each call as it grows — its id and name once they are
written, then its arguments in pieces whose concatenation is the call's arguments string
(:func:`~.tool_calls.partial_calls` says how far each format's calls can be sent: as written for DeepSeek-V3 /
V3.1 and Kimi K2, a parameter and a growing string at a time for ``qwen3_coder``, re-encoded as written for ``hermes``
and a ``"required"`` choice, as written for a named function). Why: a coding agent's call can carry a whole file; sent at the reply's end, the client
waits for all of it in silence.

At the reply's end :meth:`ToolCallStream.finish` sends what is left and gives the calls as the whole reply reads
(:func:`~.tool_calls.parse_tool_calls`), with the ids already sent. A reply whose calls do not parse stays content
— unless a call had started to go out: then the calls are what was sent (as vLLM's, a stream cannot take back what
it sent; only a streamed reply differs from the whole one there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from vexpert_runtime.serve.tool_calls import (
    ToolCall,
    ToolFormat,
    first_marker,
    new_call_id,
    parse_tool_calls,
    partial_calls,
    start_markers,
    trims_content,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CallDelta:
    """More of call ``index``: its ``id`` and ``name`` the first time (None after), and more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_json(self) -> dict[str, Any]:
        """OpenAI's streamed ``tool_calls`` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """A streamed reply's content, then its calls as they are written (see the module docstring); ``one_call``
    (``parallel_tool_calls`` false): the first call only."""

    def __init__(self, parser: ToolFormat, one_call: bool = False) -> None:
        self.parser = parser
        self.one_call = one_call
        self.start_markers = start_markers(parser)
        self.trims = trims_content(parser)
        self.held = ""  # a possible start of the calls, or (``in_calls``) the calls
        self.in_calls = not self.start_markers  # a forced choice: the whole reply is its calls
        self.sent: list[tuple[str, str, str]] = []  # per call begun: (id, name, arguments sent)
        self.scan_from = 0  # where in ``held`` the first call not yet complete begins (read at every push)
        self.scanned_calls = 0  # the calls complete before it

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        """(the content of ``text`` safe to send now, the calls' pieces written so far)."""
        if self.in_calls:
            self.held += text
            return "", self._deltas()
        buffer = self.held + text
        at = first_marker(buffer, self.start_markers)
        if at >= 0:
            self.in_calls = True
            out, self.held = buffer[:at], buffer[at:]
            return (out.rstrip() if self.trims else out), self._deltas()
        keep = max(next((n for n in range(min(len(marker) - 1, len(buffer)), 0, -1) if marker.startswith(buffer[-n:])),
                        0) for marker in self.start_markers)
        end = len(buffer) - keep
        if self.trims:  # whitespace that may end the content before a call waits for what follows it
            end = len(buffer[:end].rstrip())
        out, self.held = buffer[:end], buffer[end:]
        return out, []

    def finish(self) -> tuple[str, list[CallDelta], list[ToolCall]]:
        """At the reply's end: (content still to send, the calls' last pieces, the calls)."""
        _, calls = parse_tool_calls(self.parser, self.held)
        calls = calls[:1] if self.one_call else calls
        if not self.sent:
            if not calls:
                return self.held, [], []
            deltas = [CallDelta(i, call.arguments, call.id, call.name) for i, call in enumerate(calls)]
            return "", deltas, calls
        if not calls:  # calls went out that do not parse: they are what was sent
            return "", [], [ToolCall(name, arguments, call_id) for call_id, name, arguments in self.sent]
        deltas = []
        for index, call in enumerate(calls):
            if index >= len(self.sent):
                deltas.append(CallDelta(index, call.arguments, call.id, call.name))
                continue
            call_id, name, arguments = self.sent[index]
            if call.name != name or not call.arguments.startswith(arguments):
                log.warning("tool call %d streamed as %r %r, read whole as %r %r", index, name, arguments, call.name,
                            call.arguments)
            elif len(call.arguments) > len(arguments):
                deltas.append(CallDelta(index, call.arguments[len(arguments):]))
            calls[index] = replace(call, id=call_id)
        return "", deltas, calls

    def _deltas(self) -> list[CallDelta]:
        """The pieces of the calls written since the last push."""
        deltas = []
        start = self.scan_from
        for index, call in enumerate(partial_calls(self.parser, self.held[start:]), start=self.scanned_calls):
            if self.one_call and index > 0:
                break
            if call.end is not None and index == self.scanned_calls:  # complete: later pushes read after it
                self.scanned_calls += 1
                self.scan_from = start + call.end
            if index == len(self.sent):
                call_id = call.id or new_call_id()
                self.sent.append((call_id, call.name, call.arguments))
                deltas.append(CallDelta(index, call.arguments, call_id, call.name))
                continue
            call_id, name, sent = self.sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.sent[index] = (call_id, name, call.arguments)
                deltas.append(CallDelta(index, call.arguments[len(sent):]))
        return deltas
