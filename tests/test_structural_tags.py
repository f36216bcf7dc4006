"""vLLM's structural tags (``response_format: {"type": "structural_tag", "structures", "triggers"}``, or
``structured_outputs.structural_tag``): free text in which a trigger starts a structure — the rest of its ``begin``,
JSON following its ``schema``, its ``end`` — compiled by llguidance (:func:`~vexpert_runtime.serve.structured_output.
structural_tag_grammar`); a ``<…>`` trigger that is a special token is matched as that token, any other as text."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

pytest.importorskip("transformers")

from serve_support import (
    MODEL_NAME,
    build_tiny_checkpoint,
    grammar_reference,
    load_model,
    load_tokenizer,
    make_server,
    serve_with_scheduler,
)
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.prompts import special_tokens
from vexpert_runtime.serve.sampling import eos_token_ids
from vexpert_runtime.serve.structured_output import GrammarRequest, GrammarTokens, compile_grammar

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
          "additionalProperties": False}
SPECIAL = {"structures": [{"begin": "<tool_call>", "schema": SCHEMA, "end": "</tool_call>"}],
           "triggers": ["<tool_call>"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe-tags")
    build_tiny_checkpoint(directory, special_tokens=["<tool_call>"])
    return directory, load_model(directory), load_tokenizer(directory)


def _grammar(spec: Any, tokenizer: Any, flexible: bool = True) -> str:
    return compile_grammar(GrammarRequest("structural_tag", spec, "response_format", whitespace_flexible=flexible,
                                          special_tokens=special_tokens(tokenizer)))


def _accepts(grammar: str, tokenizer: Any, text: str) -> bool:
    vocab = len(tokenizer)
    matcher = GrammarTokens(tokenizer, vocab, eos_token_ids(tokenizer)).matcher(grammar)
    return all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(("trigger", "begin", "end"), [
    ("<tool_call>", "<tool_call>", "</tool_call>"),  # a special token of the tokenizer: matched as that token
    ("<f=", "<f=count>", "</f>"),  # text
    ("<f>", "<f>", "</f>"),  # written <…> but no special token: text (vLLM's grammar would fail on it)
])
def test_free_text_around_tags_whose_json_follows_the_schema(checkpoint: tuple[Path, Any, Any], trigger: str,
                                                              begin: str, end: str) -> None:
    _, _, tokenizer = checkpoint
    assert "<tool_call>" in special_tokens(tokenizer) and "<f>" not in special_tokens(tokenizer)
    grammar = _grammar({"structures": [{"begin": begin, "schema": SCHEMA, "end": end}], "triggers": [trigger]},
                       tokenizer)
    assert _accepts(grammar, tokenizer, f'a text {begin}{{"n": 42}}{end} and more, {begin}{{"n":7}}{end}!')
    assert _accepts(grammar, tokenizer, "text that never starts a tag: < f = <tool")
    assert not _accepts(grammar, tokenizer, f'x {begin}{{"m": 1}}')  # a key the schema does not have
    assert not _accepts(grammar, tokenizer, f'x {begin}{{"n": 420}}')  # above its maximum
    assert not _accepts(grammar, tokenizer, f'x {begin}{{"n": 4}} and no end')
    if begin != trigger:  # the rest of begin is forced after the trigger
        assert not _accepts(grammar, tokenizer, f'x {trigger}other>{{"n": 4}}{end}')


@pytest.mark.parametrize(("spec", "problem"), [
    ({"structures": [{"begin": "<g>", "schema": SCHEMA, "end": "</g>"}], "triggers": ["<f"]}, "none of the triggers"),
    ({"structures": [], "triggers": ["<f"]}, "structures"),
    ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": []}, "triggers"),
    ({"structures": [{"begin": "<f>", "schema": [1], "end": "</f>"}], "triggers": ["<f"]}, "schema"),
    ({"structures": [{"begin": "<f>", "schema": SCHEMA}], "triggers": ["<f"]}, "begin and end"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "format"),
    ({"structures": [{"begin": "<tool_call>", "end": "</tool_call>"}, {"begin": "<f>", "end": "</f>"}],
      "triggers": ["<tool_call>", "<f>"]}, "special tokens"),
    ("{not json", "structural tag"),
])
def test_a_bad_structural_tag_names_the_field(checkpoint: tuple[Path, Any, Any], spec: Any, problem: str) -> None:
    _, _, tokenizer = checkpoint
    with pytest.raises(VExpertInputError) as raised:
        _grammar(spec, tokenizer)
    assert raised.value.field == "response_format" and problem in str(raised.value), str(raised.value)
    assert "fix: send" in str(raised.value)


def _tags(text: str) -> list[Any]:
    return [json.loads(body) for body in re.findall(r"<tool_call>(.*?)</tool_call>", text)]


@pytest.mark.parametrize("overlapped", [False, True], ids=["sequential", "overlapped"])
def test_greedy_tagged_output_is_the_reference_decode(checkpoint: tuple[Path, Any, Any], overlapped: bool) -> None:
    """The trigger's token pushed up by a logit bias: the model opens tags, the grammar makes their JSON follow the
    schema and closes them — token for token what the reference decode writes."""
    directory, model, tokenizer = checkpoint
    prompt = tuple(tokenizer.encode("call the tool"))
    trigger = tokenizer.convert_tokens_to_ids("<tool_call>")
    grammar = _grammar(SPECIAL, tokenizer, flexible=False)
    params = SamplingParams(max_tokens=48, temperature=0, grammar=grammar, logit_bias=((trigger, 100.0),),
                            skip_special_tokens=False, return_token_ids=True)
    events = serve_with_scheduler(directory, tokenizer, [GenerationRequest("tags", prompt, params)], overlapped)
    ids = [t for e in events["tags"] for t in getattr(e, "token_ids", ())]
    assert ids == grammar_reference(model, tokenizer, prompt, grammar, 48, {trigger: 100.0})
    tags = _tags("".join(e.text for e in events["tags"]))
    assert tags and all(jsonschema.validate(tag, SCHEMA) is None for tag in tags)


@pytest.fixture(scope="module")
def client(checkpoint: tuple[Path, Any, Any]) -> Any:
    directory, model, _ = checkpoint
    server = make_server(directory, model, model=HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=1024),
                         kv_budget_tokens=1024)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    server.close()


def test_structural_tags_through_the_api(client: openai.OpenAI, checkpoint: tuple[Path, Any, Any]) -> None:
    _, _, tokenizer = checkpoint
    bias = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 100}
    extra = {"skip_special_tokens": False, "structured_outputs": {"structural_tag": json.dumps(SPECIAL),
                                                                   "disable_any_whitespace": True}}
    completion = client.completions.create(model=MODEL_NAME, prompt="call", max_tokens=40, temperature=0.8, seed=2,
                                           logit_bias=bias, extra_body=extra)
    assert all(jsonschema.validate(tag, SCHEMA) is None for tag in _tags(completion.choices[0].text))
    assert _tags(completion.choices[0].text), completion.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "call"}], max_tokens=40, temperature=0, logit_bias=bias,
        response_format={"type": "structural_tag", **SPECIAL},  # type: ignore[typeddict-item]
        extra_body={"skip_special_tokens": False})
    content = chat.choices[0].message.content or ""  # (JSON with flexible whitespace: a random model writes much of it)
    assert content.startswith("<tool_call>{") and _accepts(_grammar(SPECIAL, tokenizer), tokenizer, content), content
    for body, param in (({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},
                         "response_format"),
                        ({"structured_outputs": {"structural_tag": {"structures": [], "triggers": ["<"]}}},
                         "structured_outputs.structural_tag")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=body)
        assert raised.value.body["param"] == param, raised.value.body  # type: ignore[index]
