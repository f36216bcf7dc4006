"""Anthropic's Messages API (``POST /v1/messages``, and ``/v1/messages/count_tokens``), as vLLM serves it: a request
becomes the chat completion it amounts to (:func:`chat_body`: ``system`` a system message, each message's text,
``tool_use`` blocks the assistant turn's tool calls, ``tool_result`` blocks ``tool`` turns, ``tools`` function tools,
``tool_choice`` auto / any / tool / none, ``stop_sequences``, ``thinking`` the reasoning budget or its absence,
``output_config`` a JSON schema for the reply and the reasoning effort; ``temperature``, ``top_p`` and ``top_k``, which
Anthropic's SDK no longer sends, are read where a client sends them, as vLLM reads them), runs
through the chat path, and its reply comes back as a message (:func:`message_object`: ``thinking``, ``text`` and
``tool_use`` content blocks, the stop reason) — streamed, as the events Anthropic's SDK reads (:class:`MessageEvents`:
``message_start``, a ``content_block_start`` / ``_delta`` / ``_stop`` per block, ``message_delta``,
``message_stop``). Errors take Anthropic's shape (:func:`error_body`). Images, documents and server tools are refused
naming the block.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from vexpert_runtime.serve.tool_call_stream import CallDelta

Json = dict[str, Any]
ROUTE = "/v1/messages"  # and /v1/messages/count_tokens

# a chat request's fields as the Messages API names them (in the errors of the chat request a message amounts to)
FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "tool_choice": "tool_choice",
               "thinking_token_budget": "thinking.budget_tokens", "reasoning_effort": "thinking",
               "response_format": "output_config.format"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn
# Anthropic's error type of each HTTP status (else invalid_request_error)
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class Tool(BaseModel):
    """A client tool: ``name``, ``description``, ``input_schema`` (a server tool, with a ``type``, is refused)."""

    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: StrictStr | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(default=None, ge=1)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: the reply's JSON schema (structured output) and the reasoning effort (a template variable)."""

    model_config = ConfigDict(extra="ignore")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (the fields served; ``metadata`` and ``service_tier`` are accepted and change nothing)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr  # left out or null: the served model's name (ServeApi._parse)
    messages: list[dict[str, Any]]
    max_tokens: StrictInt = Field(ge=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the chat template's variables


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: a request's prompt, without its sampling fields."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    messages: list[dict[str, Any]]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def chat_body(req: MessagesRequest | CountTokensRequest) -> Json:
    """The chat completion request ``req`` amounts to (validated as one by the caller). Raises ``ValueError`` naming
    a block or tool that is not served."""
    messages: list[Json] = [] if req.system is None else [{"role": "system", "content": _text(req.system, "system")}]
    for i, message in enumerate(req.messages):
        messages += _turn(message, f"messages.{i}")
    body: Json = {"model": req.model, "messages": messages}
    if req.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if isinstance(req, MessagesRequest):
        body.update(max_completion_tokens=req.max_tokens, stream=req.stream)
        for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p),
                            ("top_k", req.top_k)):
            if value is not None:
                body[name] = value
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise ValueError(f"tools.{i}.type: server tools ({tool.type}) are not served: send client tools "
                             "(name, description, input_schema)")
    choice = req.tool_choice
    if req.tools:  # (tool_choice none: the template still shows them, the reply is text)
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type", "input_schema"},
                                                                          exclude_none=True)
                          | {"parameters": tool.input_schema}} for tool in req.tools]
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    output = req.output_config or OutputConfig()
    if output.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output.format.schema_}}
    if output.effort is not None:
        body["reasoning_effort"] = output.effort
    if req.thinking is not None and req.thinking.type == "disabled":
        body["reasoning_effort"] = "none"  # (templates that read it think not, or least)
    elif req.thinking is not None and req.thinking.budget_tokens is not None:
        body["thinking_token_budget"] = req.thinking.budget_tokens
    return body


def _text(content: str | list[Json], where: str) -> str:
    """A system prompt's or tool result's text: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ValueError(f"{where}.{j}: only text blocks are served here")
    return "".join(str(block.get("text") or "") for block in content)


def _turn(message: Json, where: str) -> list[Json]:
    """One Messages API message as chat messages: a user's text, then a ``tool`` turn per ``tool_result``; an
    assistant's text with its ``tool_use`` blocks as tool calls (``thinking`` blocks are left out, as chat templates
    drop earlier reasoning)."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant") or not isinstance(content, (str, list)):
        raise ValueError(f"{where}: a message needs a role (user, assistant) and content (text or blocks)")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text") or ""))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": str(block.get("name") or ""),
                                       "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            output = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                            "content": _text(output, f"{where}.content.{j}.content") if output is not None else ""})
        elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
            raise ValueError(f"{where}.content.{j}: {kind!r} blocks are not served in a {role}'s message (text, "
                             "tool_use from the assistant, tool_result from the user, thinking)")
    turn: list[Json] = results  # a tool's results answer the calls before them, ahead of the user's text
    if role == "assistant":
        turn = [{"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}]
    elif text:
        turn = [*results, {"role": "user", "content": "".join(text)}]
    return turn


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, calls: bool, matched: str | int | None = None) -> str | None:
    """Anthropic's ``stop_reason`` of a chat choice's ``finish_reason`` (``calls``: the reply made tool calls;
    ``matched``: vLLM's ``stop_reason``, the stop string that ended it — a stop sequence — or a stop token)."""
    if finish_reason is None:
        return None
    if calls and finish_reason != "length":
        return "tool_use"
    return "stop_sequence" if isinstance(matched, str) else _STOP_REASONS.get(finish_reason, "end_turn")


def usage_object(chat_usage: Json) -> Json:
    return {"input_tokens": chat_usage.get("prompt_tokens", 0), "output_tokens": chat_usage.get("completion_tokens", 0)}


def tool_use_block(call: Json) -> Json:
    """A chat tool call as a ``tool_use`` block (arguments that are not a JSON object: under ``"arguments"``)."""
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = None
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": parsed if isinstance(parsed, dict) else {"arguments": arguments}}


def message_object(message_id: str, model: str, reasoning: str | None, text: str | None, calls: Sequence[Json],
                   finish_reason: str | None, usage: Json, matched: str | int | None = None) -> Json:
    """A finished reply as a message: its thinking, text and tool_use blocks, stop reason and usage."""
    content: list[Json] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        content.append({"type": "text", "text": text or ""})
    content += [tool_use_block(call) for call in calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(finish_reason, bool(calls), matched),
            "stop_sequence": matched if isinstance(matched, str) and not calls else None, "usage": usage}


def error_body(openai_error: Json, status: int) -> Json:
    """An OpenAI-shaped error body (``{"error": {"message", "type", …}}``) of HTTP ``status`` in Anthropic's shape."""
    error = openai_error.get("error", {})
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "invalid_request_error"),
                                       "message": error.get("message", "")}}


class MessageEvents:
    """A streamed message's events: ``message_start``; per content block (thinking, text, each tool call) a
    ``content_block_start``, its deltas and ``content_block_stop``; ``message_delta`` (stop reason, usage) and
    ``message_stop``. Each method returns the events' SSE bytes."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self._open: str | None = None  # the kind of the block streaming now (thinking, text, tool_use)
        self._index = -1  # its index
        self._calls = False  # a tool_use block was sent

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return b"event: " + kind.encode() + b"\ndata: " + data.encode() + b"\n\n"

    def start(self) -> bytes:
        message = message_object(self.message_id, self.model, None, None, [], None,
                                 {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        message["content"] = []
        return self._event("message_start", message=message)

    def thinking(self, delta: str) -> bytes:
        if not delta:
            return b""
        return self._opened("thinking", {"type": "thinking", "thinking": ""}) + self._event(
            "content_block_delta", index=self._index, delta={"type": "thinking_delta", "thinking": delta})

    def text(self, delta: str) -> bytes:
        if not delta:
            return b""
        return self._opened("text", {"type": "text", "text": ""}) + self._event(
            "content_block_delta", index=self._index, delta={"type": "text_delta", "text": delta})

    def calls(self, deltas: Sequence[CallDelta]) -> bytes:
        """Tool calls as they are written: a call's first piece opens its ``tool_use`` block, every piece of its
        arguments is an ``input_json_delta``."""
        out = b""
        for delta in deltas:
            if delta.name is not None:
                out += self._close()
                self._open, self._index, self._calls = "tool_use", self._index + 1, True
                out += self._event("content_block_start", index=self._index, content_block={
                    "type": "tool_use", "id": str(delta.id), "name": delta.name, "input": {}})
            if delta.arguments and self._open == "tool_use":
                out += self._event("content_block_delta", index=self._index,
                                   delta={"type": "input_json_delta", "partial_json": delta.arguments})
        return out

    def _opened(self, kind: str, block: Json) -> bytes:
        if self._open == kind:
            return b""
        out = self._close()
        self._open, self._index = kind, self._index + 1
        return out + self._event("content_block_start", index=self._index, content_block=block)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":  # (Anthropic's SDK expects a signature before the block ends)
            out = self._event("content_block_delta", index=self._index, delta={"type": "signature_delta",
                                                                                "signature": ""})
        self._open = None
        return out + self._event("content_block_stop", index=self._index)

    def finish(self, finish_reason: str | None, output_tokens: int, matched: str | int | None = None) -> bytes:
        """The block streaming now done (an empty reply still has a text block), the stop reason, the end."""
        out = self._close() if self._index >= 0 else self._opened("text", {"type": "text", "text": ""}) + self._close()
        stop = stop_reason(finish_reason, self._calls, matched)
        return out + self._event("message_delta", delta={"stop_reason": stop, "stop_sequence": matched
                                                         if stop == "stop_sequence" else None},
                                 usage={"output_tokens": output_tokens}) + self._event("message_stop")

    def failed(self, message: str) -> bytes:
        return self._event("error", error={"type": "api_error", "message": message})
