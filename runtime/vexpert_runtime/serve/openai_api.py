"""OpenAI API request bodies (pydantic v2) and response / stream-chunk / error builders.

Requests ignore fields they do not know (OpenAI clients send many optional ones — ``user``,
``metadata``, ``parallel_tool_calls`` …) and accept ``null`` for optional ones, and neutral values of what
they cannot honour (``presence_penalty: 0``, ``logit_bias: {}``, as clients send by default); what this
server cannot honour and would otherwise silently get wrong (``n`` > 1, several prompts, ``echo``,
``logprobs``, ``best_of`` > 1, non-zero penalties, a non-empty ``logit_bias``, non-text message parts)
is a 400 naming the field.
``ignore_eos`` is the vLLM extension (benchmarks use it to force exact lengths).

Types are strict, as OpenAI's own API checks them: a boolean is not an integer (``max_tokens: true``),
a string is not a boolean (``stream: "yes"``), a number is not a string; ``role`` is one of
:data:`ROLES`. Each is a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

Json = dict[str, Any]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
ROLES = ("system", "developer", "user", "assistant", "tool")
Role = Literal["system", "developer", "user", "assistant", "tool"]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False


# the penalties a request may name, at the value that leaves sampling as it is (repetition_penalty: vLLM's)
_NEUTRAL_PENALTIES = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    ignore_eos: StrictBool = False
    # sampled without them: only their neutral values are accepted (any other is a 400 naming the field)
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None  # vLLM's extension
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None

    @field_validator(*_NEUTRAL_PENALTIES)
    @classmethod
    def _no_penalty(cls, penalty: float | None, info: ValidationInfo) -> float | None:
        neutral = _NEUTRAL_PENALTIES[str(info.field_name)]
        if penalty not in (None, neutral):
            raise ValueError(f"penalties are not supported (tokens are sampled without them); send {neutral} or leave "
                             "it out")
        return penalty

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported; leave it out or send {}")
        return bias

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported; send n requests instead")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The client's output limit, if any."""
        return self.max_tokens


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        """Unwrap a batch of one; a batch of several is refused (one request per prompt)."""
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [int(p) for p in prompt]  # type: ignore[arg-type]
        if len(prompt) > 1:
            raise ValueError("a list of several prompts is not supported; send one request per prompt")
        only = prompt[0]
        return only if isinstance(only, str) else list(only)  # type: ignore[arg-type]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs:
            raise ValueError("logprobs are not supported")
        return logprobs

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return best_of


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": …}`` is supported."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """A chat message; ``content`` as a string or a list of text parts."""

    model_config = ConfigDict(extra="ignore")
    role: Role
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(content, list) and any(p.type != "text" for p in content):
            raise ValueError("only text content parts are supported")
        return content

    def text(self) -> str:
        """The plain-text content (text parts joined; none: empty)."""
        content = self.content
        if isinstance(content, list):
            return "".join(p.text or "" for p in content)
        return content or ""

    def as_template_input(self) -> Json:
        """The message as a chat template expects it: role and plain-text content."""
        message: Json = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("logprobs are not supported")
        return logprobs

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current name) wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- errors -------------------------------------------------------------------------------------


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> Json:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a pydantic error: the first problem, naming its field as OpenAI does."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    # union members show up in the location ("str", "list[int]"): keep only the request's own path
    path = [p for p in loc if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool")]
    param = ".".join(path) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


# ---- responses ----------------------------------------------------------------------------------


def new_request_id(prefix: str) -> str:
    """A unique response id (``cmpl-…`` / ``chatcmpl-…``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> Json:
    """A non-streaming ``text_completion``."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_response(
    rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> Json:
    """A non-streaming ``chat.completion``."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None) -> Json:
    """One streamed ``text_completion`` chunk."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(rid: str, created: int, model: str, delta: Json, finish_reason: str | None = None) -> Json:
    """One streamed ``chat.completion.chunk``; ``delta`` is ``{"role": …}`` / ``{"content": …}`` / ``{}``."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(obj: str, rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int) -> Json:
    """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def models_response(model: str, created: int, max_context: int) -> Json:
    """``GET /v1/models``: the one served model."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "vexpert", "max_model_len": max_context}],
    }
