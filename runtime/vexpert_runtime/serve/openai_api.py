"""OpenAI API request bodies (pydantic v2) and response / stream-chunk / error builders.

Requests ignore fields they do not know and that change nothing in the tokens (OpenAI clients send many
optional ones — ``user``, ``metadata`` …) and accept ``null`` for optional ones, and
neutral values of what they cannot honour (``response_format: {"type": "text"}``, as clients send by default);
what this server cannot honour and would otherwise silently get wrong (``best_of`` > 1,
non-text message parts, tool
calls without a parser, and the vLLM extensions of :data:`_REFUSED_COMPLETION` / :data:`_REFUSED_CHAT`) is a 400 naming the field
and what to send instead.

Honoured as vLLM does: a batch of prompts and ``echo`` (completions); ``n`` (that many choices, each its own sequence of the
same prompt; with a ``seed``, choice i samples with seed + i); ``presence_penalty``, ``frequency_penalty`` and
``repetition_penalty``, ``logit_bias`` and ``allowed_token_ids`` (:mod:`.penalties`); ``logprobs`` (completions: k; chat: ``logprobs`` + ``top_logprobs``:
the output tokens' log-probabilities under the model's distribution, before temperature, penalties and
truncation, and the k most likely tokens'; at most :data:`~.events.MAX_LOGPROBS`); ``top_k`` and ``min_p``
(sampling), ``stop_token_ids``, ``ignore_eos`` (benchmarks use it to force exact lengths), ``prompt_logprobs`` (each
prompt token's log-probability and rank, and the k most likely; not streamed), ``truncate_prompt_tokens`` and
``truncation_side``, ``add_special_tokens``, ``cache_salt`` (prefix caching within one salt), ``priority`` (with
``--scheduling-policy priority``; any other value than 0 without it is a 400 naming it, as in vLLM); for chat,
``reasoning_effort`` (a template variable),
``chat_template_kwargs`` (e.g. Qwen3's ``{"enable_thinking": false}``), ``add_generation_prompt``,
``continue_final_message``, ``documents``, and ``tools``: the model's template shows them; with ``tool_choice``
"auto" (OpenAI's default) the reply's calls are parsed when the server has a ``--tool-call-parser``
(:mod:`.tool_calls`), else only "none" is accepted; "required" and a named function constrain the reply to the calls'
JSON (:class:`~.tool_calls.ForcedToolChoice`, no parser needed), ``parallel_tool_calls: false`` keeps one call; structured output — ``response_format`` (``json_object``,
``json_schema``, vLLM's ``structural_tag``) and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``, ``structural_tag``) —
is compiled here (:mod:`.structured_output`: a schema or pattern it cannot compile is a 400 naming the field).

Types are strict, as OpenAI's own API checks them: a boolean is not an integer (``max_tokens: true``),
a string is not a boolean (``stream: "yes"``), a number is not a string; ``role`` is one of
:data:`ROLES`. Each is a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.events import MAX_LOGPROBS, TokenLogprobs
from vexpert_runtime.serve.structured_output import GrammarKind, GrammarRequest, compile_grammar
from vexpert_runtime.serve.tool_calls import ForcedToolChoice

Json = dict[str, Any]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_CHOICES = 128  # the most choices (``n``) one request may ask for: OpenAI's limit
MAX_LOGIT_BIAS = 300  # the most tokens one request's logit_bias may name: OpenAI's limit
MAX_BAD_WORDS = 300  # the most bad words one request may send (each is a check per draw): as many as logit_bias ids
MAX_BAD_WORD_CHARS = 200  # a bad word is a word or a phrase, not a text
ROLES = ("system", "developer", "user", "assistant", "tool")
Role = Literal["system", "developer", "user", "assistant", "tool"]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices;
    ``continuous_usage_stats`` (vLLM's) a usage to every chunk — the prompt's tokens and its choice's so far."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


# Fields this server cannot honour, by endpoint: the values that ask for nothing (accepted; of that type
# exactly: a boolean is not 0, 1.0 is not best_of=1), and what to do instead. Any other value is a 400 naming the
# field: ignoring it would silently give the client something else than it asked for (JSON it never checks,
# a token it banned, a tool call it waits for).
_GUIDED = ("vLLM's guided_* fields are gone (vLLM ignores them since 0.12); send structured_outputs "
           '{"json" | "regex" | "choice" | "grammar": …} or response_format instead')
_REFUSED_BOTH: dict[str, tuple[tuple[Any, ...], str]] = {
    "guided_json": ((), _GUIDED), "guided_regex": ((), _GUIDED), "guided_choice": ((), _GUIDED),
    "guided_grammar": ((), _GUIDED), "guided_decoding_backend": ((), _GUIDED),
    "guided_whitespace_pattern": ((), _GUIDED),
    "use_beam_search": ((False,), "beam search is not supported; send false"),
    "length_penalty": ((1.0, 1), "a beam-search option (beam search is not supported); send 1.0"),
    "logits_processors": ((), "not supported; leave it out"),
    "logprob_token_ids": ((), "not supported: send logprobs / top_logprobs (the most likely tokens'), or leave it out"),
    "repetition_detection": ((), "not supported: use repetition_penalty / frequency_penalty, or leave it out"),
    "watermarking": ((False,), "not supported; send false"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them: send true"),
    "return_token_offsets": ((False,), "not supported; send false"),
    "prompt_embeds": ((), "prompts are text or token ids: send prompt, leave prompt_embeds out"),
    "kv_transfer_params": ((), "disaggregated prefill is not supported; leave it out"),
    "ec_transfer_params": ((), "not supported; leave it out"),
    "vllm_xargs": ((), "not supported; leave it out"),
    "routed_experts_prompt_start": ((), "not supported; leave it out"),
    "mm_payload": ((), "text models only: leave it out"),
    "mm_processor_kwargs": ((), "text models only: leave it out"),
    "media_io_kwargs": ((), "text models only: leave it out"),
    "return_mm_kwargs": ((False,), "text models only: send false"),
}
_REFUSED_COMPLETION = {
    **_REFUSED_BOTH,
    "best_of": ((1,), "only best_of=1 is supported"),
    "suffix": (("",), "not supported (no fill-in-the-middle); leave it out"),
    "thinking_token_budget": ((None, -1), "a chat request's field (it limits the reasoning a --reasoning-parser tells "
                              "from the content): send it to /v1/chat/completions, or leave it out"),
}
_REFUSED_CHAT = {
    **_REFUSED_BOTH,
    "echo": ((False,), "a chat reply does not repeat the last message: send false"),
    "return_prompt_text": ((False,), "not supported: POST /tokenize with the messages gives the prompt's tokens"),
    "chat_template": ((), "a request's own chat template is not supported: the model's is used; leave it out"),
}


def refuse_unsupported(body: Any, refused: dict[str, tuple[tuple[Any, ...], str]]) -> Any:
    """Raise for the first field of ``refused`` in ``body`` whose value asks for something (null and the
    listed neutral values ask for nothing)."""
    if isinstance(body, dict):
        for name, (neutral, why) in refused.items():
            value = body.get(name)
            if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
                raise FieldRefused(name, why)
    return body


class FieldRefused(ValueError):
    """A field this server cannot honour (:func:`refuse_unsupported`); ``field`` names it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI's): the schema is under ``schema``; ``strict`` changes nothing
    (the output always follows the schema)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``response_format`` (OpenAI's): ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (an object following ``json_schema.schema``); vLLM's ``structural_tag`` (free text in which each
    trigger starts a structure: its ``begin``, JSON following its ``schema``, its ``end``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None  # structural_tag: [{"begin", "schema", "end"}, …]
    triggers: list[StrictStr] | None = None  # structural_tag: what starts a structure (each begin starts with one)
    format: Any = None  # xgrammar's structural tag form: refused (named in the 400)


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema, as an object or its text),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark / EBNF), ``json_object: true``; and
    vLLM's two options of JSON."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | StrictStr | None = None  # vLLM's: {"structures", "triggers"} (or its JSON text)
    disable_any_whitespace: StrictBool = False  # no whitespace between JSON tokens
    disable_additional_properties: StrictBool = False  # objects with properties take no others

    def constraints(self) -> dict[GrammarKind, Any]:
        """The constraints it gives (by field name)."""
        given: dict[GrammarKind, Any] = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return {name: value for name, value in given.items() if value is not None}


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr  # left out or null: the served model's name, filled in by the API (vLLM's)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM's: −1 / 0 / null keep every token
    min_p: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=1)  # vLLM's
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: ids that end the sequence like EOS (not in the text)
    presence_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: StrictFloat | StrictInt | None = Field(default=None, gt=0)  # vLLM's (transformers')
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None  # token id (as a string) → bias in [-100, 100]
    min_tokens: StrictInt | None = Field(default=None, ge=0)  # vLLM's: no EOS / stop before that many tokens
    skip_special_tokens: StrictBool = True  # vLLM's: false keeps special tokens (other than EOS / stop ids) in the text
    include_stop_str_in_output: StrictBool = False  # vLLM's: the stop string that ended the text is part of it
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's (not streamed)
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    bad_words: list[StrictStr] | None = Field(default=None, max_length=MAX_BAD_WORDS)  # vLLM's: words never written
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: the only tokens the output may take
    cache_salt: StrictStr | None = Field(default=None, min_length=1)  # vLLM's: cached KV shared within one salt only
    priority: StrictInt | None = Field(default=None, ge=-(1 << 63), le=(1 << 63) - 1)  # vLLM's: lower first (null: 0)
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM's: logprobs name tokens "token_id:{id}" (null: the server's)
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)  # vLLM's: keep that many prompt tokens
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "left" (its default) keeps the last ones
    response_format: ResponseFormat | None = None  # OpenAI's structured output (:mod:`.structured_output`)
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    _grammar: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _compile_grammar(self, info: ValidationInfo) -> Any:
        """The grammar compiled (the validation context's ``special_tokens``: the tokenizer's, for structural tags)."""
        if self.prompt_logprobs and self.stream:
            raise FieldRefused("prompt_logprobs", "not available when streaming (as vLLM): send stream false, or leave "
                                "prompt_logprobs out")
        request = self.grammar_request()
        if request is not None and request.kind == "structural_tag" and isinstance(info.context, dict):
            request = replace(request, special_tokens=frozenset(info.context.get("special_tokens", ())))
        if request is not None:
            try:
                self._grammar = compile_grammar(request)
            except VExpertInputError as exc:
                raise FieldRefused(exc.field, f"{exc.problem} ({exc.fix})") from None
        return self

    def truncated(self, prompt_ids: list[int], context: int) -> list[int]:
        """The prompt's tokens as vLLM truncates them: ``truncate_prompt_tokens`` k keeps the last k (the first k with
        ``truncation_side: "right"``); −1 keeps what the context holds less one token to generate; k above the context
        is refused (a 400 naming the field)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep > context:
            raise FieldRefused("truncate_prompt_tokens", f"{keep} is more than the context ({context} tokens): send "
                                f"at most {context}, or -1 for the context less one token")
        keep = context - 1 if keep < 0 else keep
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[:keep] if self.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep:]

    def grammar_request(self) -> GrammarRequest | None:
        """What the output must follow (``response_format`` or ``structured_outputs``), None: free text."""
        fmt, outputs = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text":
            if outputs is not None:
                raise FieldRefused("response_format", "send either response_format or structured_outputs, not both")
            if fmt.type == "json_object":
                return GrammarRequest("json_object", None, "response_format")
            if fmt.type == "structural_tag":
                tag = {"structures": fmt.structures, "triggers": fmt.triggers}
                return GrammarRequest("structural_tag", tag if fmt.format is None else {**tag, "format": fmt.format},
                                      "response_format")
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise FieldRefused("response_format.json_schema.schema", 'type "json_schema" needs the schema: '
                                    '{"type": "json_schema", "json_schema": {"name": …, "schema": {…}}}')
            return GrammarRequest("json", fmt.json_schema.schema_, "response_format.json_schema.schema")
        if outputs is None:
            return None
        given = outputs.constraints()
        if len(given) != 1:
            raise FieldRefused("structured_outputs", "give exactly one of json, regex, choice, grammar, json_object, "
                                "structural_tag: "
                                f"got {', '.join(given) or 'none'}")
        (kind, spec), = given.items()
        return GrammarRequest(kind, spec, f"structured_outputs.{kind}", not outputs.disable_any_whitespace,
                              outputs.disable_additional_properties)

    @property
    def grammar(self) -> str | None:
        """The compiled grammar the output follows (llguidance's), None: free text."""
        return self._grammar

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and any(i < 0 for i in ids):
            raise ValueError("token ids must be ≥ 0")
        return ids

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, words: list[str] | None) -> list[str] | None:
        for word in words or ():
            if not word.strip():
                raise ValueError("each bad word needs a character that is not whitespace")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"each bad word at most {MAX_BAD_WORD_CHARS} characters")
        return words

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and not ids:
            raise ValueError("an empty list allows no token: leave the field out to allow every token")
        if ids and min(ids) < 0:
            raise ValueError("token ids must be ≥ 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens")
        for token, value in (bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys must be token ids (as strings), got {token[:20]!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {token}")
        return bias

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, by id."""
        return tuple(sorted((int(token), float(value)) for token, value in (self.logit_bias or {}).items()))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    @property
    def choices(self) -> int:
        """How many choices to generate (``n``, default 1)."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        """The client's output limit, if any."""
        return self.max_tokens


DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt or a batch of them, as text or token ids (each prompt's ``n``
    choices in order: choice index = prompt index · n + i, as OpenAI's). ``logprobs`` k: each output
    token's log-probability and the k most likely tokens' (the sampled one too: up to k + 1, as OpenAI).
    ``echo``: the text starts with the prompt — and with ``logprobs``, so do the log-probabilities (the
    prompt's first token has none), as evaluation harnesses score a continuation."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    # 16 when left out, as OpenAI's legacy completions and vLLM's (a chat's: what the context leaves); null: what the
    # context leaves (or the checkpoint's generation_config.json), as vLLM's
    max_tokens: StrictInt | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = False
    add_special_tokens: StrictBool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (e.g. BOS)

    def requested_logprobs(self) -> int | None:
        """How many most likely tokens to report with each output token's log-probability (None: no log-probabilities)."""
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens: ``prompt_logprobs`` (vLLM's), else with ``echo`` and ``logprobs``."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body: Any) -> Any:
        return refuse_unsupported(body, _REFUSED_COMPLETION)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must not be empty")
        return prompt

    @model_validator(mode="after")
    def _sequences(self) -> CompletionRequest:
        if len(self.prompts()) * self.choices > MAX_CHOICES:
            raise FieldRefused("prompt", f"a request runs at most {MAX_CHOICES} sequences (prompts × n): got "
                                f"{len(self.prompts())} × {self.choices}; send the batch in several requests")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, or a batch), each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": …}`` is supported."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """A chat message; ``content`` as a string or a list of text parts. An assistant turn's earlier
    ``tool_calls`` and a tool turn's ``tool_call_id`` go to the chat template as sent."""

    model_config = ConfigDict(extra="ignore")
    role: Role
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

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
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    """A tool's function, as the chat template sees it."""

    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


# apply_chat_template's own arguments: chat_template_kwargs may not set them (each has its own field or
# is the server's to choose)
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatTemplateInputs(BaseModel):
    """What the model's chat template renders a conversation from: the messages, the tools and documents it shows,
    its extra variables and vLLM's two prompt flags (a chat completion's, and vLLM's ``/tokenize`` of a chat)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: for templates that cite documents
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # vLLM's: extra variables of the template
    add_generation_prompt: StrictBool = True  # vLLM's
    continue_final_message: StrictBool = False  # vLLM's
    add_special_tokens: StrictBool = False  # vLLM's: the tokenizer's own (e.g. BOS) too, beside the template's
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # a template variable

    def template_arguments(self) -> Json:
        """apply_chat_template's keyword arguments for this request (besides the conversation)."""
        arguments: Json = dict(self.chat_template_kwargs or {})
        arguments["add_generation_prompt"] = self.add_generation_prompt
        if self.continue_final_message:
            arguments["continue_final_message"] = True
        if self.tools:
            arguments["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if self.documents:
            arguments["documents"] = self.documents
        if self.reasoning_effort is not None:  # (vLLM's: the template reads it, as gpt-oss's does)
            arguments["reasoning_effort"] = self.reasoning_effort
        return arguments

    @model_validator(mode="after")
    def _template_flags(self) -> Any:
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldRefused("continue_final_message", "continuing the final message leaves no room for a new "
                                "turn: send add_generation_prompt false with it")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldRefused("continue_final_message", "the last message must be the assistant's to continue it")
        reserved = sorted(_TEMPLATE_ARGUMENTS.intersection(self.chat_template_kwargs or ()))
        if reserved:
            raise FieldRefused("chat_template_kwargs", f"{', '.join(reserved)} cannot be set here"
                                " (tools, documents and the prompt flags have fields of their own)")
        return self


class ChatCompletionRequest(_GenerationRequest, ChatTemplateInputs):
    """``POST /v1/chat/completions``."""

    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include_reasoning: StrictBool = True  # vLLM's: false leaves the reasoning out of the answer (a reasoning parser's)
    thinking_token_budget: StrictInt | None = Field(default=None, ge=-1)  # vLLM's: reasoning tokens, then it ends (−1: no limit)
    parallel_tool_calls: StrictBool | None = None  # False: tool_choice "required" makes exactly one call

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body: Any) -> Any:
        return refuse_unsupported(body, _REFUSED_CHAT)

    @property
    def forced_tool_choice(self) -> ForcedToolChoice | None:
        """``tool_choice`` "required" or a named function (checked against ``tools``); None: the reply may call
        tools ("auto", by the server's parser) or not."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if not self.tools:
            raise FieldRefused("tool_choice", "a forced tool call needs tools: send tools, or leave tool_choice out")
        if choice == "required":
            return ForcedToolChoice(None, self.parallel_tool_calls is not False)
        assert isinstance(choice, dict)
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise FieldRefused("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": …}}')
        if name not in {tool.function.name for tool in self.tools}:
            raise FieldRefused("tool_choice.function.name", f"{name!r} is not one of the request's tools")
        return ForcedToolChoice(name)

    def grammar_request(self) -> GrammarRequest | None:
        """A forced tool call's JSON (:class:`~.tool_calls.ForcedToolChoice`), else the base class's."""
        forced = self.forced_tool_choice
        if forced is None:
            return super().grammar_request()
        if (self.response_format is not None and self.response_format.type != "text") or self.structured_outputs:
            raise FieldRefused("tool_choice", "a forced tool call constrains the reply itself: leave response_format "
                                "and structured_outputs out, or send tool_choice \"auto\"")
        assert self.tools is not None
        return GrammarRequest("json", forced.schema([tool.model_dump(exclude_none=True) for tool in self.tools]),
                              "tools")

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldRefused("top_logprobs", "needs logprobs: true (send both, or leave top_logprobs out)")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may call the request's tools (``tool_choice`` "auto", OpenAI's default with tools)."""
        return bool(self.tools) and self.tool_choice != "none"

    def requested_logprobs(self) -> int | None:
        """``top_logprobs`` when ``logprobs`` is true (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs`` (vLLM's; a chat request has no ``echo``)."""
        return self.prompt_logprobs

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current name) wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- vLLM's /tokenize and /detokenize ----------------------------------------------------------


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` of a text (vLLM's): its token ids as a completion prompt gets them."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr  # left out or null: the served model's name (ServeApi._parse)
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # vLLM's default for a text: the tokenizer's own (e.g. BOS) too
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(ChatTemplateInputs):
    """``POST /tokenize`` of a conversation (vLLM's): its token ids as a chat completion gets them."""

    model: StrictStr  # left out or null: the served model's name (ServeApi._parse)
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr  # left out or null: the served model's name (ServeApi._parse)
    tokens: list[StrictInt]


def tokenize_response(tokens: list[int], max_context: int, token_strs: list[str] | None) -> Json:
    """vLLM's ``/tokenize`` answer: the ids, their count, the context they must fit, and (asked) each id's string."""
    return {"count": len(tokens), "max_model_len": max_context, "tokens": tokens, "token_strs": token_strs}


# ---- defaults -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets: the model's generation config where it
    names one (``vexpert serve --generation-config auto``, vLLM's default), else the OpenAI API's
    (temperature 1, no truncation). ``max_tokens`` None: whatever the context leaves."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def from_generation_config(cls, config: Json) -> tuple[SamplingDefaults, list[str]]:
        """The defaults a ``generation_config.json`` (as a dict) sets — its ``temperature``, ``top_p``,
        ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``, as vLLM reads them — and the
        note to log: what it sets."""
        defaults, notes = cls(), []
        fields: Json = {}
        for key, name, kind in (("temperature", "temperature", float), ("top_p", "top_p", float),
                                ("top_k", "top_k", int), ("min_p", "min_p", float),
                                ("repetition_penalty", "repetition_penalty", float),
                                ("max_new_tokens", "max_tokens", int)):
            value = config.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                fields[name] = kind(value)
        for name in ("top_k", "max_tokens"):  # top_k −1 / 0: off, as in a request; max_new_tokens 0: no limit
            if fields.get(name, 1) < 1:
                del fields[name]
        if fields.get("repetition_penalty", 1.0) <= 0:  # not a penalty a request could ask for
            del fields["repetition_penalty"]
        if fields:
            defaults = cls(**fields)
            notes.append("sampling defaults from the model's generation config: "
                         + ", ".join(f"{k}={v}" for k, v in fields.items()))
        return defaults, notes


# ---- errors -------------------------------------------------------------------------------------


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> Json:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a pydantic error: the first problem, naming its field as OpenAI does."""
    first = exc.errors()[0]
    refused = (first.get("ctx") or {}).get("error")
    if isinstance(refused, FieldRefused):  # a model validator's: its location is the body, not the field
        return str(refused), refused.field
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> Json:
    """A response's ``usage``; ``cached_tokens`` (prompt tokens served from the prefix cache) and ``reasoning_tokens``
    (output tokens of the reasoning) add OpenAI's ``prompt_tokens_details`` / ``completion_tokens_details`` where
    known (None: not)."""
    counts: Json = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


@dataclass(frozen=True)
class DecodedLogprob:
    """An output token's log-probability, with the most likely tokens', as text (see
    :class:`~.events.TokenLogprobs`); ``text``: the token's own text where ``token`` names it by id
    (:func:`token_id_name`) — a chat entry's ``bytes`` are the text's, as vLLM's."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    text: str | None = None


def token_id_name(token: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it (a token that is no text of its own — a byte
    of a longer character — is still told apart)."""
    return f"token_id:{token}"


_LEAST_LOGPROB = -9999.0  # what OpenAI sends for −inf (JSON has no infinity)


def _finite(logprob: float) -> float:
    return max(logprob, _LEAST_LOGPROB)


def completion_logprobs(tokens: list[DecodedLogprob], text_offset: int = 0, first: str | None = None) -> Json:
    """``choices[i].logprobs`` of a text completion: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (the k most likely and the sampled token, up to k + 1 entries, as OpenAI's) and ``text_offset``
    (each token's position in the text, counting from ``text_offset``). ``first``: an echoed prompt's first
    token, which leads with no log-probability (``null``, as OpenAI's)."""
    offsets = []
    for text in ([] if first is None else [first]) + [item.token for item in tokens]:
        offsets.append(text_offset)
        text_offset += len(text)
    lead: list[Any] = [] if first is None else [None]
    return {
        "tokens": ([] if first is None else [first]) + [item.token for item in tokens],
        "token_logprobs": lead + [_finite(item.logprob) for item in tokens],
        "top_logprobs": lead + [{text: _finite(lp) for text, lp in (*item.top, (item.token, item.logprob))}
                                for item in tokens],
        "text_offset": offsets,
    }


def _token_entry(token: str, logprob: float) -> Json:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(tokens: list[DecodedLogprob]) -> Json:
    """``choices[i].logprobs`` of a chat completion: per output token its text, log-probability, UTF-8
    bytes and ``top_logprobs`` (the k most likely tokens, each likewise)."""
    return {"content": [{**_token_entry(item.token, item.logprob),
                         **({} if item.text is None else {"bytes": list(item.text.encode("utf-8", errors="replace"))}),
                         "top_logprobs": [_token_entry(text, lp) for text, lp in item.top]} for item in tokens]}


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streaming response (``logprobs``: its log-probabilities object, or None;
    ``tool_calls``: a chat reply's calls — its ``text`` then None when it has no other content)."""

    index: int
    text: str | None
    finish_reason: str
    logprobs: Json | None = None
    tool_calls: list[Json] | None = None
    prompt_logprobs: list[Json | None] | None = None  # vLLM's (:func:`vllm_prompt_logprobs`), when asked
    token_ids: list[int] | None = None  # vLLM's ``return_token_ids``: the choice's output ids
    prompt_token_ids: list[int] | None = None  # and its prompt's
    reasoning: str | None = None  # a chat reply's reasoning (vLLM's, with a reasoning parser)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (EOS, length: None)


def completion_response(rid: str, created: int, model: str, choices: list[Choice], counts: Json) -> Json:
    """A non-streaming ``text_completion``; ``counts``: its :func:`usage` (the completion tokens of all choices, the
    prompt once)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason,
                     **({"prompt_logprobs": c.prompt_logprobs} if c.prompt_logprobs is not None else {}),
                     **({"prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids}
                        if c.token_ids is not None else {})}
                    for c in choices],
        "usage": counts,
    }


def chat_response(rid: str, created: int, model: str, choices: list[Choice], counts: Json) -> Json:
    """A non-streaming ``chat.completion``; usage as :func:`completion_response`'s."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text,
                            **({"reasoning": c.reasoning} if c.reasoning is not None else {}),
                            **({"tool_calls": c.tool_calls} if c.tool_calls else {})},
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if c.token_ids is not None else {}),
            }
            for c in choices
        ],
        "usage": counts,
        # vLLM's: the prompt's, once (every choice has the same prompt)
        **({"prompt_logprobs": choices[0].prompt_logprobs} if choices and choices[0].prompt_logprobs is not None
           else {}),
        **({"prompt_token_ids": choices[0].prompt_token_ids} if choices and choices[0].token_ids is not None else {}),
    }


def vllm_prompt_logprobs(tokens: Sequence[TokenLogprobs], texts: dict[int, str]) -> list[Json | None]:
    """vLLM's ``prompt_logprobs``: None for the prompt's first token, then per prompt token (``tokens``, after the
    first) a dict by token id (as text) of ``{"logprob", "rank", "decoded_token"}`` — the prompt token first (its
    rank in the model's distribution), then the k most likely (ranks 1…k); ``texts``: each id's text."""
    out: list[Json | None] = [None]
    for token in tokens:
        entry: Json = {str(token.token): {"logprob": _finite(token.logprob), "rank": token.rank,
                                          "decoded_token": texts[token.token]}}
        for rank, (top, logprob) in enumerate(token.top, 1):
            entry.setdefault(str(top), {"logprob": _finite(logprob), "rank": rank, "decoded_token": texts[top]})
        out.append(entry)
    return out


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     index: int = 0, logprobs: Json | None = None) -> Json:
    """One streamed ``text_completion`` chunk of choice ``index`` (``logprobs``: its tokens')."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_chunk(rid: str, created: int, model: str, delta: Json, finish_reason: str | None = None,
               index: int = 0, logprobs: Json | None = None) -> Json:
    """One streamed ``chat.completion.chunk`` of choice ``index``; ``delta`` is ``{"role": …}`` /
    ``{"content": …}`` / ``{}``; ``logprobs``: its tokens'."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(obj: str, rid: str, created: int, model: str, counts: Json) -> Json:
    """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": counts,
    }


def model_object(model: str, created: int, max_context: int) -> Json:
    """``GET /v1/models/{model}``: the served model (OpenAI's model object, with vLLM's ``max_model_len``)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "vexpert", "max_model_len": max_context}


def models_response(names: Sequence[str], created: int, max_context: int) -> Json:
    """``GET /v1/models``: the served model, under each of its names (vLLM lists them so)."""
    return {"object": "list", "data": [model_object(name, created, max_context) for name in names]}
