"""The OpenAI API fields vLLM honours, asked of ``vexpert serve`` and of vLLM's CPU build on one checkpoint.

Not a speed benchmark: the same requests go to both servers, one after the other, on the tiny random Qwen3-MoE
of ``cpu_serve_compare.py`` (float32), and their answers are compared field by field — greedy text, with
``repetition_penalty`` and with ``presence_penalty`` + ``frequency_penalty``; a special token (``<|im_start|>``, id 1)
favoured by a logit bias, left out of the text and kept (``skip_special_tokens: false``); stop strings, left out
and kept (``include_stop_str_in_output``); completions' ``logprobs`` (tokens,
token log-probabilities, the top-k sets), also with ``echo`` (the prompt's); chat's ``logprobs`` + ``top_logprobs``;
``n`` > 1; a batch of prompts; structured output (``structured_outputs``: a JSON schema, a regex, choices, a Lark
grammar; ``response_format``: ``json_schema``, ``json_object``) and ``tool_choice`` ``"required"`` / a named function
(vLLM with ``--enable-auto-tool-choice --tool-call-parser hermes`` and its default backend, xgrammar; see
``--vllm-args`` for its llguidance backend); ``return_token_ids`` unstreamed and streamed (the chunks' ids joined);
``bad_words`` — the first two words of the checkpoint's greedy completion (transformers ``generate``), banned;
``allowed_token_ids`` (with a logit bias on a token outside them); ``return_tokens_as_token_ids`` (completions with
``echo``, chat — its entries' ``bytes`` too); structural tags (a special-token trigger favoured by a logit bias, in
``structured_outputs`` and chat's ``response_format``; a text trigger the model never writes).
Sampled answers are compared only in form (choices, their order, usage): the two servers draw from their own
random streams — the ``n`` cases sample (vLLM refuses ``n`` > 1 with greedy sampling; vexpert returns n equal choices).

    .venv/bin/python benchmarks/api_parity.py --work /tmp/cpu-compare --out benchmarks/results/api_parity

It writes ``<out>/answers.json`` (every answer of both servers), ``<out>/summary.json`` and ``<out>/table.md``
(also printed): per case, whether the answers agree, and for log-probabilities the largest difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_serve_compare import (
    MODEL_NAME,
    build_checkpoint,
    free_port,
    make_prompts,
    server_command,
    stop_server,
    wait_healthy,
)

NEW_TOKENS = 24


def cases(prompts: list[str], bad_words: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """name → (endpoint, body): every body greedy, ``ignore_eos``, ``NEW_TOKENS`` tokens; ``bad_words``: words the
    greedy completion writes (:func:`written_words`)."""
    base = BASE
    completion = {**base, "prompt": prompts[0]}
    chat = {**base, "messages": [{"role": "user", "content": prompts[1]}]}
    return {
        "greedy": ("completions", completion),
        "repetition_penalty 1.3": ("completions", {**completion, "repetition_penalty": 1.3}),
        "presence 1.0 + frequency 0.5": ("completions", {**completion, "presence_penalty": 1.0,
                                                         "frequency_penalty": 0.5}),
        "logit_bias": ("completions", {**completion, "logit_bias": {"5": -100, "6": -100, "40": 4}}),
        "min_tokens 5, EOS favoured": ("completions", {**completion, "ignore_eos": False, "min_tokens": 5,
                                                      "logit_bias": {"2": 100}}),
        "special token favoured (skipped)": ("completions", {**completion, "logit_bias": {"1": 3}}),
        "special token favoured, skip_special_tokens false": ("completions", {**completion, "logit_bias": {"1": 3},
                                                                              "skip_special_tokens": False}),
        "stop 'ber'": ("completions", {**completion, "stop": ["ber", "[[["]}),
        "stop 'ber', include_stop_str_in_output": ("completions", {**completion, "stop": ["ber", "[[["],
                                                                   "include_stop_str_in_output": True}),
        "logprobs 5": ("completions", {**completion, "logprobs": 5}),
        "echo + logprobs 2": ("completions", {**completion, "echo": True, "logprobs": 2}),
        "chat logprobs, top_logprobs 3": ("chat/completions", {**chat, "logprobs": True, "top_logprobs": 3}),
        "prompt_logprobs 3": ("completions", {**completion, "prompt_logprobs": 3}),
        "return_token_ids": ("completions", {**completion, "return_token_ids": True}),
        "chat return_token_ids": ("chat/completions", {**chat, "return_token_ids": True}),
        "return_token_ids, stream": ("completions", {**completion, "return_token_ids": True, **STREAM}),
        "chat return_token_ids, stream": ("chat/completions", {**chat, "return_token_ids": True, **STREAM}),
        "bad_words (written by the greedy completion)": ("completions", {**completion, "bad_words": bad_words}),
        "bad_words, return_token_ids": ("completions", {**completion, "bad_words": bad_words,
                                                        "return_token_ids": True}),
        "chat prompt_logprobs 2": ("chat/completions", {**chat, "prompt_logprobs": 2}),
        "allowed_token_ids, return_token_ids": ("completions", {**completion, "allowed_token_ids": ALLOWED,
                                                                "return_token_ids": True}),
        "chat allowed_token_ids + logit_bias outside them, return_token_ids": ("chat/completions", {
            **chat, "allowed_token_ids": ALLOWED, "logit_bias": {"40": 5, "300": 100}, "return_token_ids": True}),
        "echo + logprobs 3, return_tokens_as_token_ids": ("completions", {
            **completion, "echo": True, "logprobs": 3, "return_tokens_as_token_ids": True}),
        "chat logprobs, top_logprobs 3, return_tokens_as_token_ids": ("chat/completions", {
            **chat, "logprobs": True, "top_logprobs": 3, "return_tokens_as_token_ids": True}),
        **structured_cases(completion, chat),
        "n 3 (sampled)": ("completions", {**completion, "n": 3, "temperature": 1.0, "seed": 7}),
        "2 prompts, n 2 (sampled)": ("completions", {**completion, "prompt": prompts[:2], "n": 2, "temperature": 1.0,
                                                     "seed": 7}),
    }


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
             "required": ["zone"], "additionalProperties": False}}}]


def structured_cases(completion: dict[str, Any], chat: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Structured output, greedy, ending at the grammar's EOS (64 tokens at most): vLLM's ``structured_outputs``
    (a JSON schema without whitespace, a regex, choices, a Lark grammar) and OpenAI's ``response_format``
    (``json_schema`` and ``json_object``, whitespace as the model likes)."""
    ends = {"ignore_eos": False, "max_tokens": 64}
    return {
        "structured json schema": ("completions", {**completion, **ends, "structured_outputs": {"json": SCHEMA}}),
        "structured json schema, no whitespace": ("completions", {**completion, **ends, "structured_outputs": {
            "json": SCHEMA, "disable_any_whitespace": True}}),
        "structured regex": ("completions", {**completion, **ends, "structured_outputs": {
            "regex": "[a-c]{3}-[0-9]{2,4}"}}),
        "structured choice": ("completions", {**completion, **ends, "structured_outputs": {
            "choice": ["yes", "no", "maybe so"]}}),
        "structured grammar (Lark)": ("completions", {**completion, **ends, "structured_outputs": {
            "grammar": 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'}}),
        "chat response_format json_schema": ("chat/completions", {**chat, **ends, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}),
        "chat response_format json_object": ("chat/completions", {**chat, **ends, "response_format": {
            "type": "json_object"}}),
        "structural_tag, special-token trigger favoured": ("completions", {
            **completion, **ends, "logit_bias": {"1": 100}, "skip_special_tokens": False, "structured_outputs": {
                "structural_tag": json.dumps(TAGS), "disable_any_whitespace": True}}),
        "chat response_format structural_tag, special-token trigger favoured": ("chat/completions", {
            **chat, **ends, "logit_bias": {"1": 100}, "skip_special_tokens": False,
            "response_format": {"type": "structural_tag", **TAGS}}),
        "structural_tag, text trigger never written": ("completions", {**completion, **ends, "structured_outputs": {
            "structural_tag": json.dumps({"structures": [{"begin": "<f=x>", "schema": SCHEMA, "end": "</f>"}],
                                          "triggers": ["<f="]})}}),
        "chat tool_choice named": ("chat/completions", {**chat, **ends, "max_tokens": 400, "tools": TOOLS,
                                                        "tool_choice": {"type": "function",
                                                                        "function": {"name": "get_time"}}}),
        "chat tool_choice required, parallel_tool_calls false": ("chat/completions", {
            **chat, **ends, "max_tokens": 400, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}),
    }


STREAM = {"stream": True, "stream_options": {"include_usage": True}}
BASE = {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
THINK_END_BIAS = 1.7  # on </think>: the random model ends its reasoning 11 tokens in, then writes 2 stray ones


def responses_cases(prompts: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """OpenAI's Responses API on both servers, greedy: a text input with instructions, a conversation of items,
    streamed (the events' deltas joined), and a JSON-schema ``text.format`` (64 tokens at most)."""
    base = {"model": MODEL_NAME, "max_output_tokens": NEW_TOKENS, "temperature": 0}
    items = [{"role": "user", "content": [{"type": "input_text", "text": prompts[0]}]},
             {"role": "assistant", "content": "yes"},
             {"role": "user", "content": prompts[1]}]
    return {
        "responses: text input, instructions": ("responses", {**base, "input": prompts[1], "instructions": "be brief"}),
        "responses: items": ("responses", {**base, "input": items}),
        "responses: text input, stream": ("responses", {**base, "input": prompts[1], "stream": True}),
        "responses: text.format json_schema": ("responses", {**base, "max_output_tokens": 64, "input": prompts[1],
                                                             "text": {"format": {"type": "json_schema", "name": "p",
                                                                                 "schema": SCHEMA, "strict": True}}}),
    }


def messages_cases(prompts: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Anthropic's Messages API on both servers, greedy (``temperature`` 0, which both read; neither ignores EOS here:
    vLLM's Messages request has no ``ignore_eos``): a system prompt, a conversation whose assistant turn called a tool
    and whose user turn returns its result, streamed (the events' deltas joined), stop sequences, and the prompt's
    tokens counted (``/v1/messages/count_tokens``)."""
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0}
    user = [{"role": "user", "content": prompts[1]}]
    functions: list[dict[str, Any]] = [t["function"] for t in TOOLS]  # type: ignore[misc]
    tools = [{"name": f["name"], "input_schema": f["parameters"]} for f in functions]
    called = [{"role": "user", "content": prompts[0]},
              {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
                  "type": "tool_use", "id": "toolu_1", "name": tools[0]["name"], "input": {}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}]}]
    return {
        "messages: system, user": ("messages", {**base, "system": "be brief", "messages": user}),
        "messages: tool_use and tool_result turns": ("messages", {**base, "tools": tools, "messages": called,
                                                                  "tool_choice": {"type": "none"}}),
        "messages: stream": ("messages", {**base, "messages": user, "stream": True}),
        "messages: stop_sequences": ("messages", {**base, "messages": user, "stop_sequences": ["e", "[[["]}),
        "messages: count_tokens": ("messages/count_tokens", {"model": MODEL_NAME, "system": "be brief",
                                                             "tools": tools, "messages": called}),
    }


def fold_message_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed message as an unstreamed one: the text deltas joined into one text block, the stop reason and
    sequence of ``message_delta``, the usage of ``message_start`` and ``message_delta``."""
    start = next((e["message"] for e in events if e.get("type") == "message_start"), {})
    delta = next((e for e in events if e.get("type") == "message_delta"), {})
    text = "".join((e.get("delta") or {}).get("text") or "" for e in events if e.get("type") == "content_block_delta")
    return {**start, "content": [{"type": "text", "text": text}], **(delta.get("delta") or {}),
            "usage": {**(start.get("usage") or {}), **(delta.get("usage") or {})}}


def compare_message(case: str, ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Whether two messages agree: their blocks' types and text, the stop reason and sequence, the usage's input and
    output tokens (count_tokens: the input tokens)."""
    if isinstance(ours.get("error"), int) or isinstance(theirs.get("error"), int):  # an HTTP error (ask's)
        return {"agree": False, "vexpert": ours.get("error"), "vllm": theirs.get("error")}
    if "count_tokens" in case:
        equal = ours.get("input_tokens") == theirs.get("input_tokens") is not None
        return {"agree": equal, "texts_equal": "–", "usage_equal": equal, "choices": [1, 1], "indices_equal": True,
                "input_tokens": [ours.get("input_tokens"), theirs.get("input_tokens")]}
    usage = [((a.get("usage") or {}).get("input_tokens"), (a.get("usage") or {}).get("output_tokens"))
             for a in (ours, theirs)]
    blocks = [[(b.get("type"), b.get("text")) for b in a.get("content") or []] for a in (ours, theirs)]
    stops = [(a.get("stop_reason"), a.get("stop_sequence")) for a in (ours, theirs)]
    row: dict[str, Any] = {"texts_equal": blocks[0] == blocks[1], "stop": stops, "usage_equal": usage[0] == usage[1],
                           "choices": [1, 1], "indices_equal": True}
    row["agree"] = row["texts_equal"] and stops[0] == stops[1] and row["usage_equal"]
    return row


def fold_response_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed response as the final response its last event carries, with the deltas' text beside it."""
    final = dict(events[-1].get("response") or {})
    final["streamed_text"] = "".join(e.get("delta") or "" for e in events if e.get("type") == "response.output_text.delta")
    return final


def _response_text(answer: dict[str, Any]) -> str:
    return "".join(part.get("text") or "" for item in answer.get("output") or [] if item.get("type") == "message"
                   for part in item.get("content") or [])


def compare_response(case: str, ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Whether two response objects agree: the message's text (and the streamed deltas'), the status, the output
    items' types, the usage's input and output tokens."""
    if isinstance(ours.get("error"), int) or isinstance(theirs.get("error"), int):  # an HTTP error (ask's)
        return {"agree": False, "vexpert": ours.get("error"), "vllm": theirs.get("error")}
    mine, peer = ((a.get("usage") or {}) for a in (ours, theirs))
    row: dict[str, Any] = {
        "texts_equal": _response_text(ours) == _response_text(theirs),
        "status": [ours.get("status"), theirs.get("status")],
        "items": [[i.get("type") for i in a.get("output") or []] for a in (ours, theirs)],
        "usage_equal": (mine.get("input_tokens"), mine.get("output_tokens"))
        == (peer.get("input_tokens"), peer.get("output_tokens")),
    }
    if "stream" in case:
        row["streamed_equal"] = ours.get("streamed_text") == theirs.get("streamed_text") == _response_text(ours)
    row["agree"] = row["texts_equal"] and row["status"][0] == row["status"][1] and row["items"][0] == row["items"][1] \
        and row["usage_equal"] and row.get("streamed_equal", True)
    row["choices"], row["indices_equal"] = [1, 1], True
    return row


def reasoning_cases(model: Path, prompts: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Chat replies through both servers' ``--reasoning-parser qwen3``, greedy, with ``</think>`` favoured by a logit
    bias (the random model writes it a few tokens in): thinking (Qwen3's default), streamed, ``enable_thinking`` false
    (the template closes an empty think block), ``include_reasoning`` false, and a regex the content must follow (the
    grammar waiting for the reasoning's end)."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("</think>")
    chat = {**BASE, "messages": [{"role": "user", "content": prompts[1]}], "logit_bias": {str(end): THINK_END_BIAS}}
    return {
        "reasoning: chat, thinking": ("chat/completions", chat),
        "reasoning: chat, thinking, stream": ("chat/completions", {**chat, **STREAM}),
        "reasoning: chat, enable_thinking false": ("chat/completions", {
            **chat, "chat_template_kwargs": {"enable_thinking": False}}),
        "reasoning: chat, include_reasoning false": ("chat/completions", {**chat, "include_reasoning": False}),
        "reasoning: chat, a regex after the reasoning": ("chat/completions", {
            **chat, "ignore_eos": False, "max_tokens": 64, "structured_outputs": {"regex": "[a-c]{5}"}}),
    }
ALLOWED = [5, 6, 7, 40, 41, 42, 100, 101, 102, 200]  # the only tokens the allowed_token_ids cases may draw
TAGS = {"structures": [{"begin": "<|im_start|>", "schema": {  # <|im_start|> (id 1) is one of the tokenizer's specials
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
    "additionalProperties": False}, "end": "</t>"}], "triggers": ["<|im_start|>"]}


def written_words(model: Path, prompt: str, count: int = 2) -> list[str]:
    """The first ``count`` words of the checkpoint's greedy completion of ``prompt`` (transformers ``generate``,
    ``NEW_TOKENS`` tokens): words a ``bad_words`` case then bans."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    text: str = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return text.split()[:count]


def fold_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed answer as an unstreamed one: each choice's text (or message content), output ids and prompt ids
    joined over its chunks, the prompt ids a chat stream sends beside its choices, the usage chunk's usage."""
    choices: dict[int, dict[str, Any]] = {}
    answer: dict[str, Any] = {}
    for chunk in chunks:
        if "prompt_token_ids" in chunk:
            answer["prompt_token_ids"] = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            answer["usage"] = chunk["usage"]
        for part in chunk.get("choices") or []:
            choice = choices.setdefault(part["index"], {"index": part["index"], "text": "", "token_ids": [],
                                                        "reasoning": ""})
            choice["text"] += part.get("text") or (part.get("delta") or {}).get("content") or ""
            choice["reasoning"] += (part.get("delta") or {}).get("reasoning") or ""
            choice["token_ids"] += part.get("token_ids") or []
            if part.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = part["prompt_token_ids"]
            choice["finish_reason"] = part.get("finish_reason") or choice.get("finish_reason")
            if part.get("finish_reason"):  # (vLLM's stop_reason: on the finish chunk)
                choice["stop_reason"] = part.get("stop_reason")
    answer["choices"] = [choices[i] for i in sorted(choices)]
    return answer


def post(url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/v1/{endpoint}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        if not body.get("stream"):
            return dict(json.loads(response.read()))
        lines = [line.decode().strip() for line in response]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    if endpoint == "messages":
        return fold_message_stream(data)
    return fold_response_stream(data) if endpoint == "responses" else fold_stream(data)


def ask(name: str, model: Path, requests: dict[str, tuple[str, dict[str, Any]]], args: argparse.Namespace
        ) -> dict[str, Any]:
    """Start server ``name``, send every case once, stop it: case → the answer (or the error text)."""
    port = free_port()
    command, env = server_command(name, model, port, args)
    log = args.out / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    answers: dict[str, Any] = {}
    try:
        wait_healthy(proc, url, log, args.startup_timeout)
        for case, (endpoint, body) in requests.items():
            try:
                answers[case] = post(url, endpoint, body)
            except urllib.error.HTTPError as exc:
                answers[case] = {"error": exc.code, "body": exc.read().decode(errors="replace")[:500]}
    finally:
        stop_server(proc, 30.0)
    return answers


def _texts(answer: dict[str, Any]) -> list[str]:
    return [c.get("text", (c.get("message") or {}).get("content")) for c in answer.get("choices", [])]


def _ids_in(answer: dict[str, Any]) -> tuple[Any, list[Any]]:
    """(the prompt's ids — a choice's, or a chat response's —, each choice's output ids) of ``return_token_ids``."""
    return (answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids"),
            [c.get("token_ids") for c in answer["choices"]])


def _reasonings(answer: dict[str, Any]) -> list[str]:
    """Each choice's reasoning (a reasoning parser's), "" where it has none."""
    return [(c.get("message") or c).get("reasoning") or "" for c in answer.get("choices", [])]


def _calls(answer: dict[str, Any]) -> list[Any]:
    """Each choice's tool calls (name, arguments) and finish reason."""
    return [([(c["function"]["name"], c["function"]["arguments"]) for c in (ch.get("message") or {}).get("tool_calls")
              or []], ch.get("finish_reason")) for ch in answer.get("choices", [])]


def _prompt_logprobs(answer: dict[str, Any]) -> list[Any]:
    """The answer's vLLM ``prompt_logprobs`` (a completion choice's, or a chat response's)."""
    return answer.get("prompt_logprobs") or (answer.get("choices") or [{}])[0].get("prompt_logprobs") or []


def _usage(answer: dict[str, Any]) -> tuple[Any, ...]:
    usage = answer.get("usage") or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")


def _fragment(token: str) -> str:
    """A token that is part of a UTF-8 character: vexpert writes U+FFFD, vLLM an empty string."""
    return "" if token == "\ufffd" else token


def compare(case: str, ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Whether two answers agree: the choices' texts (greedy cases) or only their number and order
    (sampled), the usage, and for log-probabilities the tokens, the largest |difference| of their
    log-probabilities and the share of positions whose top-k token sets are the same (exactly, and once
    a token that is part of a character is written alike)."""
    if "error" in ours or "error" in theirs:
        return {"agree": False, "vexpert": ours.get("error"), "vllm": theirs.get("error")}
    sampled = "sampled" in case
    row: dict[str, Any] = {"texts_equal": "sampled" if sampled else _texts(ours) == _texts(theirs),
                           "choices": [len(ours["choices"]), len(theirs["choices"])],
                           "indices_equal": [c["index"] for c in ours["choices"]] == [c["index"] for c in theirs["choices"]],
                           "usage_equal": _usage(ours) == _usage(theirs),
                           # vLLM's stop_reason: the stop string or stop token that ended each choice (else null)
                           "stop_reasons_equal": [c.get("stop_reason") for c in ours["choices"]]
                           == [c.get("stop_reason") for c in theirs["choices"]]}
    if "tool_choice" in case:
        row["calls_equal"] = _calls(ours) == _calls(theirs)
    if case.startswith("reasoning"):  # each choice's reasoning (None and "" alike: a stream folds to "")
        row["reasoning_equal"] = _reasonings(ours) == _reasonings(theirs)
    if "return_token_ids" in case:  # the prompt's ids (a choice's, or a chat response's) and each choice's output ids
        ids = [_ids_in(answer) for answer in (ours, theirs)]
        row["tokens_equal"] = ids[0] == ids[1] and ids[0][0] is not None
    if "prompt_logprobs" in case:  # vLLM's list: per prompt token {id: {logprob, rank, decoded_token}}
        mine, peer = _prompt_logprobs(ours), _prompt_logprobs(theirs)
        row["tokens_equal"] = [None if e is None else sorted(e) for e in mine] == [
            None if e is None else sorted(e) for e in peer]
        pairs = [(e[k], f[k]) for e, f in zip(mine, peer, strict=False) if e and f for k in e if k in f]
        row["max_logprob_diff"] = max((abs(a["logprob"] - b["logprob"]) for a, b in pairs), default=None)
        row["ranks_equal"] = all(a["rank"] == b["rank"] for a, b in pairs)
        row["decoded_equal"] = all(a["decoded_token"] == b["decoded_token"] for a, b in pairs)
    mine, peer = ours["choices"][0].get("logprobs"), theirs["choices"][0].get("logprobs")
    if mine is not None and peer is not None:
        if "content" in mine:  # chat
            a, b = mine["content"], peer["content"]
            row["tokens_equal"] = [x["token"] for x in a] == [x["token"] for x in b]
            row["max_logprob_diff"] = max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a, b, strict=False))
            sets = [({t["token"] for t in x["top_logprobs"]}, {t["token"] for t in y["top_logprobs"]})
                    for x, y in zip(a, b, strict=False)]
            row["top_sets_equal"] = sum(p == q for p, q in sets) / max(len(a), 1)
            row["top_sets_equal_fragments_alike"] = sum({_fragment(t) for t in p} == {_fragment(t) for t in q}
                                                        for p, q in sets) / max(len(a), 1)
            if "as_token_ids" in case:  # each entry's bytes (the text's) and its top entries' (the names')
                row["bytes_equal"] = [x["bytes"] for x in a] == [y["bytes"] for y in b] and [
                    [t["bytes"] for t in x["top_logprobs"]] for x in a] == [[t["bytes"] for t in y["top_logprobs"]]
                                                                              for y in b]
        else:
            row["tokens_equal"] = mine["tokens"] == peer["tokens"]
            row["max_logprob_diff"] = max(abs(x - y) for x, y in zip(mine["token_logprobs"], peer["token_logprobs"],
                                                                      strict=False) if x is not None and y is not None)
            row["nulls_equal"] = [x is None for x in mine["token_logprobs"]] == [y is None for y in peer["token_logprobs"]]
            pairs = [(x or {}, y or {}) for x, y in zip(mine["top_logprobs"], peer["top_logprobs"], strict=False)]
            row["top_sets_equal"] = sum(set(x) == set(y) for x, y in pairs) / max(len(mine["tokens"]), 1)
            row["top_sets_equal_fragments_alike"] = sum({_fragment(t) for t in x} == {_fragment(t) for t in y}
                                                        for x, y in pairs) / max(len(mine["tokens"]), 1)
            row["text_offset_equal"] = mine["text_offset"] == peer["text_offset"]
    row["agree"] = bool(row["texts_equal"]) and row["indices_equal"] and row["usage_equal"] and row[
        "stop_reasons_equal"] and row.get(
        "tokens_equal", True) and row.get("calls_equal", True) and row.get("ranks_equal", True) and row.get(
        "bytes_equal", True) and row.get("reasoning_equal", True)
    return row


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| case | texts equal | choices (vexpert, vLLM), same order | usage equal | logprob tokens equal | "
             "max logprob diff | top-k sets equal (fragments alike) |", "|---|---|---|---|---|---|---|"]
    for case, row in rows.items():
        diff = row.get("max_logprob_diff")
        sets = "–" if "top_sets_equal" not in row else (
            f"{row['top_sets_equal']:.2f} ({row['top_sets_equal_fragments_alike']:.2f})")
        texts = f"{row.get('texts_equal')}" + (f", calls {row['calls_equal']}" if "calls_equal" in row else "") + (
            f", reasoning {row['reasoning_equal']}" if "reasoning_equal" in row else "")
        lines.append(f"| {case} | {texts} | {row.get('choices')}, {row.get('indices_equal')} | "
                     f"{row.get('usage_equal')} | {row.get('tokens_equal', '–')} | "
                     f"{'–' if diff is None else f'{diff:.2e}'} | {sets} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where the checkpoint is built (once)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=1, help="vexpert serve --cpu-workers")
    parser.add_argument("--vllm-python", type=Path, default=Path("/work/vllm-venv/bin/python"))
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    # vLLM with its hermes tool parser (without one it leaves a forced tool call's JSON as content) and its default
    # structured-output backend, xgrammar; --structured-outputs-config '{"backend": "guidance"}' gives it llguidance,
    # vexpert's library (then, with the hermes parser, 0.32 refuses tool_choice: "Invalid grammar specification:
    # 'triggers'" — the parser's structural tag)
    parser.add_argument("--vllm-args", default="--enable-auto-tool-choice --tool-call-parser hermes",
                        help="extra vLLM server arguments (one shell string)")
    parser.add_argument("--vexpert", type=Path, default=Path(sys.executable).parent / "vexpert")
    parser.add_argument("--vexpert-args", default="", help="extra vexpert serve arguments (one shell string)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--responses", action="store_true", help="the Responses API cases only (responses_cases)")
    parser.add_argument("--messages", action="store_true", help="Anthropic's Messages API cases only (messages_cases)")
    parser.add_argument("--reasoning", action="store_true",
                        help="the reasoning cases only (reasoning_cases), on the checkpoint with <think> and </think> "
                             "tokens, both servers with --reasoning-parser qwen3")
    args = parser.parse_args(argv)
    args.vexpert_src = args.max_running = args.max_batch_tokens = None  # server_command's other knobs: unused
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reasoning:
        model = build_checkpoint(args.work / "model-think", ("<think>", "</think>"))
        prompts = make_prompts(model, 2, 32)
        requests = reasoning_cases(model, prompts)
        args.vexpert_args += " --reasoning-parser qwen3"
        args.vllm_args += " --reasoning-parser qwen3"
    elif args.responses:
        model = build_checkpoint(args.work / "model")
        requests = responses_cases(make_prompts(model, 2, 32))
    elif args.messages:
        model = build_checkpoint(args.work / "model")
        requests = messages_cases(make_prompts(model, 2, 32))
    else:
        model = build_checkpoint(args.work / "model")
        prompts = make_prompts(model, 2, 32)
        requests = cases(prompts, written_words(model, prompts[0]))
    started = time.perf_counter()
    ours = ask(f"vexpert-{args.workers}", model, requests, args)
    theirs = ask("vllm", model, requests, args)
    comparers = {"responses": compare_response, "messages": compare_message, "messages/count_tokens": compare_message}
    rows = {case: comparers.get(requests[case][0], compare)(case, ours[case], theirs[case]) for case in requests}
    (args.out / "answers.json").write_text(json.dumps({"requests": requests, "vexpert": ours, "vllm": theirs},
                                                      indent=2) + "\n")
    summary = {"argv": sys.argv, "seconds": round(time.perf_counter() - started, 1), "cases": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = table(rows)
    (args.out / "table.md").write_text(markdown + "\n")
    print(markdown)
    return 0 if all(row["agree"] for row in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
