"""OpenAI's Responses API (``POST /v1/responses``), stateless: a request becomes the chat completion it amounts to
(:func:`chat_body`: ``instructions`` a system message, ``input`` the conversation — its messages, function calls and
their outputs —, function ``tools``, ``text.format`` the response format, ``reasoning.effort`` the template's
``reasoning_effort``, ``max_output_tokens``), runs through the chat path, and its reply comes back as a response
object (:func:`response_object`): a reasoning item (with a reasoning parser), a message, function calls; streamed, as
the ``response.*`` events OpenAI's SDK reads (:class:`ResponseEvents`).

Stored responses (:class:`ResponseStore`) are opt-in, as in vLLM (its ``VLLM_ENABLE_RESPONSES_API_STORE``):
``vexpert serve --responses-store N`` keeps the last N responses of ``store: true`` requests in the API process — a
request naming one as ``previous_response_id`` continues its conversation, and ``GET /v1/responses/{id}`` returns it.
Without it ``previous_response_id`` is a 400 naming the field (send the whole conversation as ``input``);
``conversation`` and ``background`` are refused. Tools other than functions, input images or files and prompt templates
are refused. Log-probabilities as OpenAI's and vLLM's: ``include: ["message.output_text.logprobs"]`` (with
``top_logprobs`` alternatives per token) puts each output token's in the message's ``output_text`` — streamed, the
tokens of each ``response.output_text.delta`` in it (a reasoning-only stretch's are not sent, as vLLM's).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from vexpert_runtime.serve.openai_api import refuse_unsupported
from vexpert_runtime.serve.tool_call_stream import CallDelta

Json = dict[str, Any]
_TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    """A function tool, as the Responses API flattens it (``name`` beside ``type``, not under ``function``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` (``name``, ``schema``, ``strict`` beside ``type``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (the fields served; others that would change the answer are refused by name)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr  # left out or null: the served model's name (ServeApi._parse)
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True  # kept where the server stores responses (--responses-store)
    previous_response_id: StrictStr | None = None  # a stored response this one continues (--responses-store)
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    include: list[StrictStr] | None = None  # "message.output_text.logprobs": the tokens' log-probabilities; others: no-ops
    top_logprobs: StrictInt = Field(default=0, ge=0, le=20)  # alternatives per token (with the include above)
    priority: StrictInt = 0  # vLLM's (with --scheduling-policy priority): passed on to the chat request

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body: Any) -> Any:
        return refuse_unsupported(body, _REFUSED)


_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {  # the values that ask for nothing, what to send instead
    "conversation": ((), "conversations are not stored here: send the whole conversation as input (or "
                     "previous_response_id, with a server started with --responses-store N)"),
    "background": ((False,), "send false (a response is answered while its request is open)"),
    "prompt": ((), "prompt templates are not stored here: send instructions and input"),
    "max_tool_calls": ((), "leave it out"),
    "thinking_token_budget": ((None, -1), "a chat request's field (vLLM's Responses API has none): send it to "
                              "/v1/chat/completions, or leave it out"),
    "truncation": (("disabled",), 'send "disabled": a conversation over the context is refused, not cut'),
}


# a chat request's fields as the Responses API names them (in the errors of the chat request a response amounts to)
FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}


OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry that asks for them


def wants_logprobs(req: ResponsesRequest) -> bool:
    return OUTPUT_LOGPROBS in (req.include or ())


def chat_body(req: ResponsesRequest) -> Json:
    """The chat completion request ``req`` amounts to (validated as one by the caller)."""
    messages: list[Json] = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += _messages(req.input)
    body: Json = {"model": req.model, "messages": messages, "stream": req.stream,
                  "parallel_tool_calls": req.parallel_tool_calls}
    if wants_logprobs(req):
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("priority", req.priority or None)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in req.tools]
        choice = req.tool_choice
        body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} \
            if isinstance(choice, dict) else choice
    elif req.tool_choice not in ("auto", "none"):
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else "required"  # (refused: no tools)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return body


def _messages(given: str | list[Json]) -> list[Json]:
    """``input`` as chat messages: a text is the user's message; items — messages (their text parts joined), function
    calls (``tool_calls`` of the assistant turn before them: a reply's message and calls are one turn) and their
    outputs (``tool`` turns);
    reasoning items are left out (as chat templates drop earlier reasoning). Raises ``ValueError`` naming the item."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[Json] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            if isinstance(content, list):
                if any(not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS for p in content):
                    raise ValueError(f"input.{i}.content: only text parts are served (input_text, output_text)")
                content = "".join(str(p.get("text") or "") for p in content)
            if role not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
                raise ValueError(f"input.{i}: a message needs a role (system, developer, user, assistant) and text")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "")}}
            if messages and messages[-1]["role"] == "assistant":  # the turn of the message (or calls) before it
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":
            raise ValueError(f"input.{i}: items of type {kind!r} are not served (messages, function_call, "
                             "function_call_output, reasoning)")
    return messages


def input_items(given: str | list[Json]) -> list[Json]:
    """``input`` as items (a text is the user's message)."""
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given)


class ResponseStore:
    """The last ``capacity`` stored responses of this API process, oldest dropped first: each response object and
    the conversation it ends — its predecessors' items, its input's, its output's — which a request naming it as
    ``previous_response_id`` continues (the new ``instructions`` replace the old, as OpenAI's do)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._stored: OrderedDict[str, tuple[Json, list[Json]]] = OrderedDict()

    def put(self, response: Json, req: ResponsesRequest) -> None:
        """Keep ``response``, answered to ``req`` (its input the whole conversation so far)."""
        self._stored[response["id"]] = (response, [*input_items(req.input), *response["output"]])
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def response(self, response_id: str) -> Json | None:
        entry = self._stored.get(response_id)
        return None if entry is None else entry[0]

    def continued(self, req: ResponsesRequest) -> ResponsesRequest:
        """``req`` with its ``previous_response_id``'s conversation before its input (``KeyError`` if not stored)."""
        if req.previous_response_id is None:
            return req
        _, conversation = self._stored[req.previous_response_id]
        return req.model_copy(update={"input": [*conversation, *input_items(req.input)]})


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(reasoning: str | None, content: str | None, calls: Sequence[Json], logprobs: list[Json] | None = None
                 ) -> list[Json]:
    """A finished reply's output items: its reasoning (a reasoning parser's), its message (where it has text, or no
    call; ``logprobs``: its ``output_text``'s, the chat reply's ``logprobs.content``), its function calls (``calls``:
    chat ``tool_calls`` objects)."""
    items: list[Json] = []
    if reasoning is not None:
        items.append(reasoning_item(_item_id("rs"), reasoning))
    if content or not calls:
        items.append(message_item(_item_id("msg"), content or "", logprobs=logprobs))
    items += [function_call_item(call) for call in calls]
    return items


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> Json:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str = "completed", logprobs: list[Json] | None = None) -> Json:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [output_text(text, logprobs)]}


def output_text(text: str, logprobs: list[Json] | None = None) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(call: Json) -> Json:
    """A chat ``tool_calls`` entry as a Responses ``function_call`` item (its call id the chat call's id)."""
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def usage_object(chat_usage: Json) -> Json:
    """A chat ``usage`` as the Responses API counts: input and output tokens, cached and reasoning ones (0: none)."""
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)}}


def response_object(response_id: str, created: int, req: ResponsesRequest, output: list[Json], finish_reason: str | None,
                    usage: Json | None, status: str | None = None, store: bool = False) -> Json:
    """The response object: ``status`` completed, or incomplete (``max_output_tokens``) where the reply hit its limit;
    ``in_progress`` while streaming (``status`` given); ``store``: whether the server keeps it."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None, "error": None,
        "model": req.model, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools],
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text is not None and req.text.format is not None else {"type": "text"})},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
        "store": store, "truncation": "disabled", "user": req.user, "usage": usage,
    }


class ResponseEvents:
    """A streamed response's events (``response.*``, numbered): created, the reasoning item's and the message's
    deltas as they come, each function call as it is written (:mod:`.tool_call_stream`), completed. Each method
    returns the events' SSE bytes."""

    def __init__(self, response_id: str, created: int, req: ResponsesRequest, store: bool = False) -> None:
        self.response_id, self.created, self.req, self.store = response_id, created, req, store
        self._sequence = 0
        self._output: list[Json] = []  # the items done
        self._open: tuple[str, str] | None = None  # (kind, id) of the item streaming now
        self._text = ""
        self._logprobs: list[Json] = []  # the message streaming now's, as sent
        self._call: tuple[str, str] = ("", "")  # (call id, name) of the function call streaming now
        self.final: Json | None = None  # the response, once finished

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"

    def start(self) -> bytes:
        response = response_object(self.response_id, self.created, self.req, [], None, None, "in_progress")
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                 response=response)

    def reasoning(self, delta: str) -> bytes:
        return self._delta("reasoning", delta)

    def content(self, delta: str, logprobs: list[Json] | None = None) -> bytes:
        """The message's text ``delta`` (``logprobs``: its tokens', where the request asks)."""
        return self._delta("message", delta, logprobs or [])

    def _delta(self, kind: str, delta: str, logprobs: list[Json] | None = None) -> bytes:
        if not delta:
            return b""
        out = self._opened(kind)
        self._text += delta
        assert self._open is not None
        item_id, index = self._open[1], len(self._output)
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: Json = {} if logprobs is None else {"logprobs": logprobs}
        self._logprobs += logprobs or []
        return out + self._event(kind_event, item_id=item_id, output_index=index, content_index=0, delta=delta, **extra)

    def calls(self, deltas: Sequence[CallDelta]) -> bytes:
        """Function calls as they are written: a call's first piece adds its item, every piece is an arguments
        delta; the call before it is done."""
        out = b""
        for delta in deltas:
            if delta.name is not None:
                out += self._close()
                item_id = _item_id("fc")
                self._open, self._text, self._call = ("function_call", item_id), "", (str(delta.id), delta.name)
                out += self._event("response.output_item.added", output_index=len(self._output),
                                   item=self._call_item(item_id, "", "in_progress"))
            if delta.arguments and self._open is not None:
                self._text += delta.arguments
                out += self._event("response.function_call_arguments.delta", item_id=self._open[1],
                                   output_index=len(self._output), delta=delta.arguments)
        return out

    def _call_item(self, item_id: str, arguments: str, status: str) -> Json:
        return {"type": "function_call", "id": item_id, "call_id": self._call[0], "name": self._call[1],
                "arguments": arguments, "status": status}

    def _opened(self, kind: str) -> bytes:
        """Make ``kind`` (reasoning, message) the item streaming now: the one before it done, this one added."""
        if self._open is not None and self._open[0] == kind:
            return b""
        out = self._close()
        item_id = _item_id("rs" if kind == "reasoning" else "msg")
        self._open, self._text, self._logprobs = (kind, item_id), "", []
        index = len(self._output)
        if kind == "reasoning":
            return out + self._event("response.output_item.added", output_index=index,
                                     item=reasoning_item(item_id, None, "in_progress"))
        out += self._event("response.output_item.added", output_index=index,
                           item=message_item(item_id, None, "in_progress"))
        return out + self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                                 part=output_text(""))

    def _close(self) -> bytes:
        """End the item streaming now (its done events)."""
        if self._open is None:
            return b""
        (kind, item_id), index, text = self._open, len(self._output), self._text
        self._open = None
        if kind == "function_call":
            item = self._call_item(item_id, text, "completed")
            out = self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                              arguments=text)
        elif kind == "reasoning":
            item = reasoning_item(item_id, text)
            out = self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text)
        else:
            item = message_item(item_id, text, logprobs=self._logprobs)
            out = self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text, logprobs=self._logprobs)
            out += self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                               part=output_text(text, self._logprobs))
        self._output.append(item)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def finish(self, finish_reason: str | None, usage: Json) -> bytes:
        """The item streaming now done (every function call came through :meth:`calls`: a stream's
        :class:`~.tool_call_stream.ToolCallStream` sends each call, whole or in pieces), then ``response.completed``
        (or ``.incomplete``)."""
        out = self._close()
        if not self._output:  # an empty reply is still a message
            out += self._opened("message") + self._close()
        response = response_object(self.response_id, self.created, self.req, self._output, finish_reason, usage,
                                   store=self.store)
        self.final = response
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)

    def failed(self, message: str) -> bytes:
        response = response_object(self.response_id, self.created, self.req, self._output, None, None, "failed")
        response["error"] = {"code": "server_error", "message": message}
        return self._event("response.failed", response=response)
