"""``vexpert serve`` end to end on CPU: the official OpenAI client against a tiny random Qwen3-MoE.

The model is real (transformers, float32), so greedy answers are compared with ``model.generate``;
the StepModel is the full-recompute test double of ``serve_support``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

import vexpert_runtime
from serve_support import (
    MAX_CONTEXT,
    MODEL_NAME,
    BackgroundServer,
    RecomputeStepModel,
    load_model,
    load_tokenizer,
    make_server,
)
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.events import (
    Event,
    EventLogprobs,
    GenerationRequest,
    SamplingParams,
    ServeRefusal,
    TokenLogprobs,
)
from vexpert_runtime.serve.openai_api import SamplingDefaults
from vexpert_runtime.serve.sampling import (
    IncrementalDetokenizer,
    StopChecker,
    sample_tokens,
    sampling_tensors,
)
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.step import SamplingSpec, SynchronousSteps

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serve_support import build_tiny_checkpoint

    directory = tmp_path_factory.mktemp("tiny-qwen3-moe")
    build_tiny_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint: Path, hf_model: Any) -> Any:
    srv = make_server(checkpoint, hf_model)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def generate_greedy(hf_model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """What ``model.generate(do_sample=False)`` produces after the prompt (EOS included if reached)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids) :].tolist()


def expected_text(tokenizer: Any, generated: list[int]) -> tuple[str, str]:
    """(text, finish_reason) the server must give for HF ``generate``'s tokens."""
    finish = "stop" if generated and generated[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(generated, skip_special_tokens=True), finish


# ---- the OpenAI client against the server ---------------------------------------------------


def test_models_and_health(server: BackgroundServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    model = client.models.retrieve(MODEL_NAME)  # GET /v1/models/{model}
    assert (model.id, model.object, model.model_extra) == (MODEL_NAME, "model", {"max_model_len": MAX_CONTEXT})
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
    assert httpx.get(f"{server.url}/health").status_code == 200
    # --served-model-name a b (vLLM's): every name served and listed, the first first
    from vexpert_runtime.cli import build_parser

    assert build_parser().parse_args(["serve", "--served-model-name", "a", "org/b", "--port", "1"]).served_model_name \
        == ["a", "org/b"]
    server.api.config = dataclasses.replace(server.api.config, aliases=("org/alias",))
    try:
        assert [m.id for m in client.models.list().data] == [MODEL_NAME, "org/alias"]
        assert client.models.retrieve("org/alias").id == "org/alias"
        assert client.completions.create(model="org/alias", prompt=PROMPT, max_tokens=1).usage is not None
    finally:
        server.api.config = dataclasses.replace(server.api.config, aliases=())


@pytest.mark.parametrize("as_ids", [False, True])
def test_greedy_completion_equals_generate(
    client: openai.OpenAI, hf_model: Any, tokenizer: Any, as_ids: bool
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    generated = generate_greedy(hf_model, prompt_ids, 16)
    text, finish = expected_text(tokenizer, generated)
    prompt: Any = prompt_ids if as_ids else PROMPT
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert result.choices[0].text == text
    assert result.choices[0].finish_reason == finish
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), len(generated))


def test_greedy_chat_equals_generate(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    generated = generate_greedy(hf_model, prompt_ids, 12)
    text, finish = expected_text(tokenizer, generated)
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=12, temperature=0  # type: ignore[arg-type]
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == text
    assert result.choices[0].finish_reason == finish
    assert result.usage is not None and result.usage.prompt_tokens == len(prompt_ids)


def test_streaming_completion_and_chat(client: openai.OpenAI, server: BackgroundServer) -> None:
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(prompt=PROMPT, **kwargs)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    messages: Any = [{"role": "user", "content": "hello"}]
    chat_whole = client.chat.completions.create(messages=messages, **kwargs)
    chat_chunks = list(
        client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert streamed == chat_whole.choices[0].message.content
    assert chat_chunks[-1].usage == chat_whole.usage

    # vLLM's continuous_usage_stats: every chunk carries the usage so far — the prompt's tokens and its choice's (the
    # role chunk: none yet) —, each choice's last chunk all of its 10
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, body in ((client.completions.create, {"prompt": PROMPT}),
                         (client.chat.completions.create, {"messages": messages, "n": 2, "temperature": 0.9, "seed": 1})):
        counted = list(create(**kwargs | body, stream=True, stream_options=options,  # type: ignore[operator]
                              extra_body={"ignore_eos": True}))
        assert all(c.usage is not None for c in counted)
        for index in range(body.get("n", 1)):  # type: ignore[arg-type]
            mine = [c.usage.completion_tokens for c in counted if c.choices and c.choices[0].index == index]
            assert mine == sorted(mine) and mine[-1] == 10, mine
        assert {c.usage.prompt_tokens for c in counted} == {counted[-1].usage.prompt_tokens}
        assert counted[-1].usage.completion_tokens == 10 * body.get("n", 1)  # type: ignore[operator]

    # the raw SSE: data lines, the last one [DONE]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    raw = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_a_finished_request_leaves_no_event_stream_for_the_loop_to_close(client: openai.OpenAI,
                                                                         server: BackgroundServer) -> None:
    """The API reads each request's events to their end: an async generator left suspended after the
    last event is closed by the event loop's finalizer, one task per request (at 256 streams that cost
    the API process ~10 % more CPU per request, benchmarks/README.md §10)."""
    closed: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if type(coro).__name__ == "async_generator_athrow":  # the finalizer's create_task(agen.aclose())
            closed.append(repr(coro))
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def set_factory(f: Any) -> None:
        asyncio.get_running_loop().set_task_factory(f)

    server.run(set_factory(factory))
    try:
        kwargs: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
        for stream in (False, True):  # one choice and two, completions and chat
            replies: list[Any] = [client.completions.create(prompt=PROMPT, stream=stream, **kwargs),
                                  client.completions.create(prompt=PROMPT, n=2, stream=stream, **kwargs),
                                  client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                                                 stream=stream, **kwargs)]
            if stream:
                assert all(list(reply) for reply in replies)
        gc.collect()
        server.run(asyncio.sleep(0.1))  # a finalizer's task would be scheduled by now
    finally:
        server.run(set_factory(None))
    assert closed == []


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=seed,
            extra_body={"ignore_eos": True},
        )
        return result.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_stop_strings_are_trimmed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    full = client.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    assert len(full) >= 8, full
    stop = full[4:7]
    expected = full[: full.index(stop)]
    result = client.completions.create(stop=[stop, "never appears"], extra_body={"ignore_eos": True}, **kwargs)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected, "stop")
    assert result.choices[0].model_extra["stop_reason"] == stop  # vLLM's: the stop string that ended it
    chunks = list(client.completions.create(stop=stop, stream=True, extra_body={"ignore_eos": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices and c.choices[0].finish_reason] == [stop]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=3, temperature=0, stop=["never appears"])
    assert chat.choices[0].model_extra["stop_reason"] is None  # ended by its length
    # vLLM's include_stop_str_in_output: the stop string ends the text
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    included = client.completions.create(stop=[stop, "never appears"], extra_body=body, **kwargs).choices[0]
    assert (included.text, included.finish_reason) == (expected + stop, "stop")
    chunks = client.completions.create(stop=stop, stream=True, extra_body=body, **kwargs)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected + stop


def test_top_k_min_p_and_stop_token_ids_are_honoured(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """vLLM's sampling extensions: top_k 1 or min_p 1 draw only the most likely token (the greedy text
    at any temperature); a stop token id ends the output where it first appears, left out of the text,
    also with ignore_eos."""
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10}
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_k": 1, "min_p": 0.5}):
        sampled = client.completions.create(temperature=1.5, seed=3, extra_body={"ignore_eos": True, **extra}, **kwargs)
        assert sampled.choices[0].text == greedy, extra
    # top_k −1 / 0 mean "off", as in vLLM: the same draws as without it
    plain = client.completions.create(temperature=1.0, seed=9, extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    for off in (-1, 0):
        again = client.completions.create(temperature=1.0, seed=9, extra_body={"ignore_eos": True, "top_k": off}, **kwargs)
        assert again.choices[0].text == plain
    generated = generate_greedy(hf_model, list(tokenizer.encode(PROMPT)), 10)
    at = next(i for i in range(2, len(generated)) if generated[i] not in generated[:i])
    result = client.completions.create(temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [generated[at]]},
                                       **kwargs)
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].model_extra["stop_reason"] == generated[at]  # vLLM's: the stop token
    assert result.usage is not None and result.usage.completion_tokens == at + 1
    assert result.choices[0].text == tokenizer.decode(generated[:at], skip_special_tokens=True)


def test_chat_template_arguments_reach_the_template(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """chat_template_kwargs (Qwen3's enable_thinking), tools with tool_choice "none", and
    continue_final_message render the prompt the model's template makes of them: the reply is
    generate's greedy continuation of exactly that prompt."""
    messages: list[Any] = [{"role": "user", "content": "hello world"}]
    tool = {"type": "function", "function": {"name": "f"}}  # the tiny model's context is 96 tokens
    cases: list[tuple[dict[str, Any], list[Any], dict[str, Any]]] = [
        ({"chat_template_kwargs": {"enable_thinking": False}}, messages,
         {"add_generation_prompt": True, "enable_thinking": False}),
        ({"tools": [tool], "tool_choice": "none"}, messages, {"add_generation_prompt": True, "tools": [tool]}),
        ({"continue_final_message": True, "add_generation_prompt": False},
         [*messages, {"role": "assistant", "content": "the quick"}], {"continue_final_message": True}),
    ]
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for body, conversation, template in cases:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **template)
        assert text != plain
        prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
        reply = client.chat.completions.create(model=MODEL_NAME, messages=conversation, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, **body})
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids), body
        want = tokenizer.decode(generate_greedy(hf_model, prompt_ids, 6), skip_special_tokens=True)
        assert reply.choices[0].message.content == want, body


def test_a_requests_missing_sampling_fields_take_the_generation_configs_defaults(
        server: BackgroundServer, client: openai.OpenAI) -> None:
    """With the model's generation config as defaults (``--generation-config auto``), a request that
    leaves temperature / top_k / max_tokens out samples with the config's; a field it sends wins."""
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "extra_body": {"ignore_eos": True}}
    greedy = client.completions.create(temperature=0, max_tokens=3, **kwargs).choices[0].text
    hot = client.completions.create(temperature=1.5, seed=9, max_tokens=4, **kwargs).choices[0].text
    before = server.api.config
    try:
        server.api.config = dataclasses.replace(before, sampling_defaults=SamplingDefaults(1.5, 1.0, 1, 0.0, 3))
        # top_k 1 by default: the greedy tokens, 3 of them (max_tokens null: the config's — left out, a completion
        # takes OpenAI's and vLLM's 16)
        result = client.completions.create(seed=9, max_tokens=None, **kwargs)
        assert (result.choices[0].text, result.choices[0].finish_reason) == (greedy, "length")
        assert client.completions.create(seed=9, max_tokens=4, **{**kwargs, "extra_body": {
            "ignore_eos": True, "top_k": -1}}).choices[0].text == hot  # sent fields win
    finally:
        server.api.config = before


def test_penalties_reach_the_sampler_and_the_generation_configs_repetition_penalty_is_the_default(
        server: BackgroundServer, client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """repetition_penalty as transformers' ``generate`` applies it (greedy: the same tokens); presence and
    frequency penalties change what is decoded; a request that leaves repetition_penalty out takes the
    generation config's (vLLM's ``--generation-config auto``), one that sends 1 turns it off."""
    prompt_ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=12, repetition_penalty=1.5)
    want = tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    assert client.completions.create(**kwargs, extra_body={"repetition_penalty": 1.5}).choices[0].text == want
    plain = client.completions.create(**kwargs).choices[0].text
    assert want != plain
    assert client.completions.create(**kwargs, presence_penalty=1.5, frequency_penalty=1.0).choices[0].text != plain
    before = server.api.config
    try:
        server.api.config = dataclasses.replace(before, sampling_defaults=SamplingDefaults(repetition_penalty=1.5))
        assert client.completions.create(**kwargs).choices[0].text == want
        assert client.completions.create(**kwargs, extra_body={"repetition_penalty": 1}).choices[0].text == plain
    finally:
        server.api.config = before


def test_logit_bias_is_added_to_the_logits(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """logit_bias as OpenAI defines it (token id strings → [-100, 100]), as transformers' ``sequence_bias`` of
    single tokens adds it: banning the greedy tokens and favouring others changes the reply to generate's."""
    prompt_ids = tokenizer.encode(PROMPT)
    greedy = generate_greedy(hf_model, prompt_ids, 8)
    bias = {greedy[0]: -100.0, greedy[1]: -100.0, 40: 3.0}
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=8,
                                sequence_bias={(token,): value for token, value in bias.items()})
    want = tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias={str(token): value for token, value in bias.items()})
    assert result.choices[0].text == want != tokenizer.decode(greedy, skip_special_tokens=True)


def test_min_tokens_holds_back_eos_and_stop_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    """min_tokens (vLLM's): with EOS favoured by a logit bias the reply ends at once; with min_tokens 5 neither
    EOS nor a stop token id is sampled before 5 tokens, then EOS ends it; a stop string is not looked for before."""
    eos = tokenizer.eos_token_id
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                              "logit_bias": {str(eos): 100}}
    at_once = client.completions.create(**kwargs)
    assert (at_once.choices[0].finish_reason, at_once.usage.completion_tokens) == ("stop", 1)  # type: ignore[union-attr]
    held = client.completions.create(**kwargs, extra_body={"min_tokens": 5, "stop_token_ids": [7]})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 6)  # type: ignore[union-attr]
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    stop = plain[:2]  # a stop string the greedy reply starts with: found at once, unless min_tokens waits
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                      stop=[stop]).choices[0].text == ""
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                      extra_body={"min_tokens": 6, "ignore_eos": True}).choices[0].text == plain


def test_generation_config_defaults_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    from vexpert_runtime.commands.serve import sampling_defaults

    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
             "eos_token_id": [151645, 151643]}
    defaults, notes = SamplingDefaults.from_generation_config(qwen3)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, max_tokens=None,
                                        repetition_penalty=1.05)
    assert any("repetition_penalty=1.05" in note for note in notes)
    assert SamplingDefaults.from_generation_config({"top_k": -1, "temperature": True, "max_new_tokens": 0,
                                                    "repetition_penalty": 0}) == (
        SamplingDefaults(), [])  # −1: off; a boolean is not a temperature; 0 tokens: no limit given; 0: no penalty
    (tmp_path / "generation_config.json").write_text(json.dumps(qwen3))
    assert sampling_defaults(tmp_path, "auto")[0].top_k == 20
    assert sampling_defaults(tmp_path, "vexpert") == (SamplingDefaults(), [])
    assert sampling_defaults(tmp_path / "missing", "auto") == (SamplingDefaults(), [])
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(VExpertInputError) as error:
        sampling_defaults(tmp_path, "auto")
    assert error.value.field == "--generation-config" and "vexpert" in str(error.value)


def test_vllms_names_of_the_shared_flags_are_accepted() -> None:
    """A vLLM command line's flags for the knobs vexpert shares: the same settings under vLLM's names."""
    from vexpert_runtime.cli import build_parser

    parser = build_parser()
    ours = parser.parse_args(["serve", "--max-running", "32", "--max-batch-tokens", "512", "--prefix-caching",
                              "--api-servers", "2", "--tool-call-parser", "hermes"])
    vllms = parser.parse_args(["serve", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                               "--enable-prefix-caching", "--api-server-count", "2", "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes"])
    assert (vllms.max_running, vllms.max_batch_tokens, vllms.prefix_caching, vllms.api_servers) == (32, 512, True, 2)
    assert {**vars(vllms), "enable_auto_tool_choice": False} == vars(ours)


def test_chat_template_is_a_file_or_the_template_and_is_checked_at_start(checkpoint: Path, tmp_path: Path) -> None:
    """``--chat-template`` (vLLM's): a file's template, or the template given; a name that is no file and holds no
    template, or a template that does not render, is an input error naming the flag (before any process starts)."""
    from vexpert_runtime.commands.serve import load_chat_template

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (tmp_path / "chat.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "chat.jinja"), checkpoint) == template
    assert load_chat_template(template, checkpoint) == template
    for bad, problem in ((str(tmp_path / "missing.jinja"), "no file"),
                         ("{% for m in messages %}", "does not render"),
                         ("{{ raise_exception('no') }}", "does not render")):
        with pytest.raises(VExpertInputError) as error:
            load_chat_template(bad, checkpoint)
        assert error.value.field == "--chat-template" and problem in str(error.value), str(error.value)


def test_the_servers_chat_template_renders_every_chat(server: BackgroundServer, client: openai.OpenAI,
                                                      tokenizer: Any) -> None:
    """With ``--chat-template`` (``ApiConfig.chat_template``) chats — completions and ``/tokenize`` alike — render with
    it instead of the model's."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    messages = [{"role": "user", "content": "hello world"}]
    expected = tokenizer.encode("[user] hello world\n[assistant]", add_special_tokens=False)
    server.api.config = dataclasses.replace(server.api.config, chat_template=template)
    try:
        assert httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"] == expected
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                              extra_body={"return_token_ids": True})
        assert chat.model_dump()["prompt_token_ids"] == expected
    finally:
        server.api.config = dataclasses.replace(server.api.config, chat_template=None)
    assert httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"] != expected


def test_n_choices_are_the_requests_of_seeds_seed_plus_i(client: openai.OpenAI) -> None:
    """n choices, each what a request with seed + i gives (vLLM's child requests); usage: the prompt
    once, the completions summed; greedy choices are all the greedy answer."""
    base: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    result = client.completions.create(**base, n=3, seed=11)
    singles = [client.completions.create(**base, seed=11 + i) for i in range(3)]
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in result.choices}) > 1  # seeds 11, 12, 13 draw differently
    assert result.usage is not None and singles[0].usage is not None
    assert result.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert result.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles if s.usage)
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, n=2)
    one = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 2
    assert [c.index for c in greedy.choices] == [0, 1]


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_stream_each_under_its_index(client: openai.OpenAI, chat: bool) -> None:
    """Streamed choices: every chunk names its choice, each choice's chunks add up to what the
    non-streamed request gives, one finish per choice, then one usage chunk over all of them."""
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 3}
    if chat:
        create: Any = client.chat.completions.create
        common["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        create = client.completions.create
        common["prompt"] = PROMPT
    whole = create(**common)
    texts, finishes, roles, usages = ["", "", ""], [None, None, None], [0, 0, 0], []
    for chunk in create(**common, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usages.append(chunk.usage)
            continue
        (choice,) = chunk.choices
        assert finishes[choice.index] is None  # nothing of a choice after its finish
        if chat:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
        else:
            texts[choice.index] += choice.text
        finishes[choice.index] = choice.finish_reason
    expected = [c.message.content if chat else c.text for c in whole.choices]
    assert texts == expected
    assert finishes == [c.finish_reason for c in whole.choices]
    assert roles == ([1, 1, 1] if chat else [0, 0, 0])
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)]


def test_a_batch_of_prompts_is_answered_prompt_by_prompt(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """A list of prompts (text or token ids): each prompt's n choices in order (index = prompt · n + i), each
    what the prompt alone gives; usage counts every prompt once."""
    prompts = [PROMPT, "hello world", "tiny experts route"]
    result = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in result.choices] == list(range(6))
    completion = 0
    for p, prompt in enumerate(prompts):
        generated = generate_greedy(hf_model, tokenizer.encode(prompt), 6)
        text, finish = expected_text(tokenizer, generated)
        assert [(c.text, c.finish_reason) for c in result.choices[2 * p: 2 * p + 2]] == [(text, finish)] * 2
        completion += 2 * len(generated)
    assert result.usage is not None
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert result.usage.completion_tokens == completion
    ids = [tokenizer.encode(p) for p in prompts[:2]]
    sampled = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=1.0, seed=3)
    assert [c.text for c in sampled.choices] == [
        client.completions.create(model=MODEL_NAME, prompt=one, max_tokens=5, temperature=1.0, seed=3).choices[0].text
        for one in ids]


def test_tool_calls_are_read_out_of_the_reply_with_the_hermes_parser(checkpoint: Path, hf_model: Any,
                                                                      tokenizer: Any) -> None:
    """With ``--tool-call-parser hermes``, a reply that calls tools (here scripted: the model writes the
    call) comes back as OpenAI's ``tool_calls`` with finish reason "tool_calls" and the text before it as
    content — streamed too, the content first, then the calls as they are written; ``parallel_tool_calls: false`` keeps the
    first call (vLLM's filter); without a parser a request whose
    tools may be called is a 400 naming tool_choice; with tool_choice "none" the reply stays text."""
    from serve_support import ScriptedStepModel, joined_tool_calls

    reply = ('ok\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
             '<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>')
    script = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.decode(script) == reply
    srv = make_server(checkpoint, hf_model, model=ScriptedStepModel(hf_model, script, tokenizer.eos_token_id))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x?"}], "tools": tools,
                              "max_tokens": 120}
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**kwargs)
        assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
        srv.api.config = dataclasses.replace(srv.api.config, tool_call_parser="hermes")
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "ok\n")
        assert choice.message.tool_calls is not None
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("function", "f", {"x": 1}), ("function", "f", {"x": 2})]
        one = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in one or []] == [{"x": 1}]
        for parallel, expected in ((True, [(0, {"x": 1}), (1, {"x": 2})]), (False, [(0, {"x": 1})])):
            content, deltas, finish = "", [], None
            for chunk in client.chat.completions.create(**kwargs, stream=True, parallel_tool_calls=parallel):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                deltas += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            assert (content, finish) == ("ok\n", "tool_calls")
            assert [(index, json.loads(arguments)) for index, _, _, arguments in joined_tool_calls(deltas)] == expected
        text = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
        assert (text.message.content, text.message.tool_calls, text.finish_reason) == (reply, None, "stop")
    finally:
        srv.close()


def test_qwen3_coder_calls_come_back_typed_by_the_requests_tools(checkpoint: Path, hf_model: Any,
                                                                 tokenizer: Any) -> None:
    """With ``--tool-call-parser qwen3_coder``, a reply in Qwen3-Coder's XML call format (scripted) comes back as
    ``tool_calls`` whose arguments are typed by the request's tools — the same text is an integer for a tool that
    declares one and text for a tool that declares a string — whole and streamed, the content first."""
    from serve_support import ScriptedStepModel, joined_tool_calls

    reply = "ok\n<tool_call>\n<function=f>\n<parameter=x>\n7\n</parameter>\n</function>\n</tool_call>"
    script = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.decode(script) == reply
    srv = make_server(checkpoint, hf_model, model=ScriptedStepModel(hf_model, script, tokenizer.eos_token_id))
    srv.api.config = dataclasses.replace(srv.api.config, tool_call_parser="qwen3_coder")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def tools(kind: str) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": kind}}}}}]

    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x?"}],
                              "max_tokens": len(script) + 1}  # the reply and its end (the tools make the prompt long)
    try:
        for kind, expected in (("integer", '{"x": 7}'), ("string", '{"x": "7"}')):
            choice = client.chat.completions.create(**kwargs, tools=tools(kind)).choices[0]
            # (the newline before <tool_call> is not content, as vLLM 0.32's parser gives it)
            assert (choice.finish_reason, choice.message.content) == ("tool_calls", "ok")
            assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [("f", expected)]
            content, deltas = "", []
            for chunk in client.chat.completions.create(**kwargs, tools=tools(kind), stream=True):
                content += chunk.choices[0].delta.content or ""
                deltas += chunk.choices[0].delta.tool_calls or []
            assert (content, [(name, arguments) for _, _, name, arguments in joined_tool_calls(deltas)]) == (
                "ok", [("f", expected)])
    finally:
        srv.close()


DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>")


KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
                "<|tool_call_argument_begin|>")
# parser → (its markers: calls begin, calls end, call begin, call end, separator; a reply calling f with {"x": 1})
SPECIAL_TOKEN_FORMATS = {
    "deepseek_v3": (DEEPSEEK_MARKERS, "ok {0}{2}function{4}f\n```json\n{{\"x\": 1}}\n```{3}{1}"),
    "deepseek_v31": (DEEPSEEK_MARKERS, 'ok {0}{2}f{4}{{"x": 1}}{3}{1}'),
    "kimi_k2": (KIMI_MARKERS, 'ok {0}{2}functions.f:0{4}{{"x": 1}}{3}{1}'),
}


@pytest.mark.parametrize("parser", sorted(SPECIAL_TOKEN_FORMATS))
def test_tool_calls_are_read_though_their_markers_are_special_tokens(tmp_path: Path, parser: str) -> None:
    """With ``--tool-call-parser deepseek_v3`` (``deepseek_v31``, ``kimi_k2``) a reply that calls tools in that
    format — whose markers are special tokens here, which the text leaves out by default — comes back as
    ``tool_calls`` (its request is detokenized with its special tokens), streamed too; with tool_choice "none" the
    markers stay out of the text; ``skip_special_tokens: false`` keeps them in any request's text (vLLM's field)."""
    from transformers import AutoModelForCausalLM

    from serve_support import ScriptedStepModel, build_tiny_checkpoint, joined_tool_calls, load_tokenizer

    markers, template = SPECIAL_TOKEN_FORMATS[parser]
    build_tiny_checkpoint(tmp_path, special_tokens=markers)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    tokenizer = load_tokenizer(tmp_path)
    begin = markers[0]
    reply = template.format(*markers)
    script = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.decode(script, skip_special_tokens=False) == reply
    without_markers = tokenizer.decode(script, skip_special_tokens=True)
    assert begin not in without_markers  # the markers are special: left out of the text by default
    srv = make_server(tmp_path, hf, model=ScriptedStepModel(hf, script, tokenizer.eos_token_id))
    srv.api.config = dataclasses.replace(srv.api.config, tool_call_parser=parser)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x?"}], "tools": tools,
                              "max_tokens": 120}
    try:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "ok ")
        assert choice.message.tool_calls is not None
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("f", '{"x": 1}')]
        content, deltas, finish = "", [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            content += chunk.choices[0].delta.content or ""
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert (content, finish) == ("ok ", "tool_calls")
        assert [(index, name, arguments) for index, _, name, arguments in joined_tool_calls(deltas)] == [
            (0, "f", '{"x": 1}')]
        # the OpenAI SDK's own stream accumulator reads the same call out of the deltas
        with client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion().choices[0]
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == [("f", '{"x": 1}')]
        assert final.finish_reason == "tool_calls"
        text = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
        assert (text.message.content, text.message.tool_calls) == (without_markers, None)
        completion = client.completions.create(model=MODEL_NAME, prompt="x?", max_tokens=120,
                                               extra_body={"skip_special_tokens": False})
        assert completion.choices[0].text == reply
        assert client.completions.create(model=MODEL_NAME, prompt="x?", max_tokens=120).choices[0].text == \
            without_markers
    finally:
        srv.close()


def test_n_choices_are_admitted_all_or_none(checkpoint: Path, hf_model: Any) -> None:
    """A request whose n choices do not all fit the waiting queue (they are queued together) is a 429,
    and the choices queued before the refusal never run; one that fits runs every choice."""
    srv = make_server(checkpoint, hf_model, max_running=1, max_batch_tokens=16, max_waiting=2)
    srv.model.gate = threading.Event()  # steps block: the first request holds the batch
    url = f"{srv.url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=30)
            _wait_for(lambda: srv.dispatcher.loads()[0].running == 1)
            refused = httpx.post(url, json={**body, "n": 3}, timeout=30)  # 2 queue, the third does not fit
            assert _error(refused, 429)["code"] == "overloaded"
            srv.model.gate.set()
            assert first.result().status_code == 200
        _wait_for(lambda: not srv.dispatcher.scheduler.has_work())
        assert len({item.seq_id for step in srv.model.steps for item in step}) == 1  # the first request's only
        answered = httpx.post(url, json={**body, "n": 2}, timeout=30).json()
        assert [c["index"] for c in answered["choices"]] == [0, 1]
        assert len({c["text"] for c in answered["choices"]}) == 1  # greedy: the same answer twice
    finally:
        srv.model.gate.set()
        srv.close()


def test_ping_is_health_and_load_counts_the_generation_requests_being_answered(checkpoint: Path,
                                                                                hf_model: Any) -> None:
    """vLLM's ``/ping`` (GET and POST, SageMaker's health check) answers as ``/health``; ``GET /load`` is vLLM's
    ``{"server_load": N}``: the generation requests this API server is answering, a stream until its end — not
    the other routes, and back to 0 once they are done, a refused one too."""
    srv = make_server(checkpoint, hf_model, max_running=1, max_batch_tokens=16)
    srv.model.gate = threading.Event()  # steps block: the first request stays in flight

    def load() -> int:
        return int(httpx.get(f"{srv.url}/load", timeout=10).json()["server_load"])

    try:
        for method in ("GET", "POST"):
            ping = httpx.request(method, f"{srv.url}/ping", timeout=10)
            assert ping.status_code == 200 and ping.json() == {"status": "ok"}
        assert load() == 0
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(lambda: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).text)
            _wait_for(lambda: srv.dispatcher.loads()[0].running == 1)
            assert load() == 1
            bad = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": -1}, timeout=30)
            assert bad.status_code == 400
            assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 200
            assert load() == 1  # the refused request and the models route are over, the stream is not
            srv.model.gate.set()
            assert streamed.result().rstrip().endswith("data: [DONE]")
        _wait_for(lambda: load() == 0)
    finally:
        srv.model.gate.set()
        srv.close()


def test_requests_are_logged_only_where_asked(server: Any, client: openai.OpenAI,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """``--enable-log-requests`` (vLLM's): one INFO line per generation request as it is queued — id, route, prompt
    lengths, at most ``--max-log-len`` prompt ids, sampling —; off (the default) no request reaches the log."""
    import logging

    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="vexpert_runtime.serve.api"):
        client.completions.create(**kwargs)
        assert not [r for r in caplog.records if r.getMessage().startswith("request ")]
        config = server.api.config
        server.api.config = dataclasses.replace(config, log_requests=True, max_log_len=3)
        try:
            result = client.completions.create(**kwargs, seed=5)
        finally:
            server.api.config = config
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    prompt_ids = server.api.prompts.tokenizer(PROMPT)["input_ids"]
    assert line.startswith(f"request {result.id}: /v1/completions, 1 choice(s), prompt tokens [{len(prompt_ids)}], "
                           "max_tokens 2, temperature 0")
    assert "seed 5" in line and line.endswith(f"prompt ids [{prompt_ids[:3]}]")


def test_a_busy_interval_logs_vllms_stats_line_and_an_idle_one_nothing(server: Any, client: openai.OpenAI) -> None:
    """vLLM's periodic line (``StatsLog``, every 10 s unless --disable-log-stats): the tokens since the last line as
    throughput, the ranks' running and waiting requests and KV-cache usage; an interval with nothing to say logs
    nothing."""
    import re

    from vexpert_runtime.serve.api import StatsLog

    stats = StatsLog(server.api)
    assert stats.line() is None  # idle
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.usage is not None
    line = stats.line()
    assert line is not None, "a request ran"
    match = re.fullmatch(r"Avg prompt throughput: ([0-9.]+) tokens/s, Avg generation throughput: ([0-9.]+) tokens/s, "
                         r"Running: [01] reqs, Waiting: 0 reqs, KV cache usage: ([0-9.]+)%, Prefix cache hit rate: "
                         r"([0-9.]+)%", line)  # (the rank may not have reported the request's end yet: 1)
    assert match and float(match[1]) > 0 and float(match[2]) > 0, line
    deadline = time.monotonic() + 10
    while server.dispatcher.loads()[0].running and time.monotonic() < deadline:  # the rank reports its end
        time.sleep(0.01)
    stats.line()
    assert stats.line() is None  # nothing since


def test_browser_origins_get_cors_answers_as_vllms(checkpoint: Path, hf_model: Any) -> None:
    """CORS as vLLM's server answers it: by default any origin — a preflight is answered before the API key is asked
    for, and a response (a stream's too) says ``*``; with a list of origins and credentials, only those origins, each
    named back, and a preflight from another origin or asking another header is a 400."""
    from vexpert_runtime.serve.cors import CorsPolicy

    srv = make_server(checkpoint, hf_model)
    srv.api.config = dataclasses.replace(srv.api.config, api_key="k")
    url = f"{srv.url}/v1/completions"
    origin = {"Origin": "https://app.example"}
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    try:
        pre = httpx.options(url, headers={**origin, "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
        assert "POST" in pre.headers["access-control-allow-methods"]
        auth = {**origin, "Authorization": "Bearer k"}
        assert httpx.post(url, json=body, headers=auth, timeout=30).headers["access-control-allow-origin"] == "*"
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth, timeout=30) as streamed:
            assert streamed.headers["access-control-allow-origin"] == "*"
            streamed.read()
        assert httpx.post(url, json=body, headers=origin, timeout=30).status_code == 401  # the key is still asked
        assert "access-control-allow-origin" not in httpx.get(f"{srv.url}/health").headers  # no Origin: no CORS
    finally:
        srv.close()
    strict = make_server(checkpoint, hf_model, cors=CorsPolicy(("https://app.example",), ("POST",), ("content-type",),
                                                               credentials=True))
    try:
        url = f"{strict.url}/v1/completions"
        pre = httpx.options(url, headers={**origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        assert pre.headers["access-control-allow-credentials"] == "true" and pre.headers["vary"] == "Origin"
        other = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        assert httpx.options(url, headers=other).status_code == 400
        extra = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-custom"}
        assert httpx.options(url, headers=extra).status_code == 400
        answered = httpx.post(url, json=body, headers=origin, timeout=30)
        assert answered.headers["access-control-allow-origin"] == "https://app.example"
        refused = httpx.post(url, json=body, headers={"Origin": "https://evil.example"}, timeout=30)
        assert refused.status_code == 200 and "access-control-allow-origin" not in refused.headers
    finally:
        strict.close()


def test_a_client_gone_cancels_every_choice(checkpoint: Path, hf_model: Any) -> None:
    srv = make_server(checkpoint, hf_model)
    srv.model.delay_s = 0.02
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 80, "ignore_eos": True, "stream": True, "n": 3}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as response:
            next(response.iter_lines())
        _wait_for(lambda: sorted(srv.model.released) == [0, 1, 2])
        assert not srv.dispatcher.scheduler.has_work()
    finally:
        srv.close()


def _log_softmax_after(hf_model: Any, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V]: transformers' log-softmax at each generated token's position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1: -1], dim=-1)


def test_completion_logprobs_are_the_models_log_softmax(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """logprobs k: per output token its text, its log-probability under transformers' logits, the k most
    likely tokens' with the sampled one (up to k + 1 entries, as OpenAI) and its text offset; the stream
    carries the same, chunk by chunk; at temperature 1.5 the values are still the model's (vLLM's raw)."""
    prompt_ids = tokenizer.encode(PROMPT)
    generated = generate_greedy(hf_model, prompt_ids, 6)
    expected = _log_softmax_after(hf_model, prompt_ids, generated)
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.tokens == [tokenizer.decode([t]) for t in generated]
    assert logprobs.token_logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(generated)], abs=1e-4)
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    for position, (top, token) in enumerate(zip(logprobs.top_logprobs, generated, strict=True)):
        values, ids = expected[position].topk(3)
        pairs = [*zip(ids.tolist(), values.tolist(), strict=True), (token, float(expected[position, token]))]
        want = {tokenizer.decode([i]): v for i, v in pairs}  # texts may repeat (byte pieces): the later one stays
        assert list(top) == list(want) and list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(generated))]
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values.extend(getattr(chunk.choices[0].logprobs, key))
    assert streamed == {key: getattr(logprobs, key) for key in streamed}
    sampled = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=1.5, seed=9,
                                        logprobs=0).choices[0].logprobs
    assert sampled is not None and sampled.tokens and sampled.token_logprobs
    first = expected[0]  # the distribution after the prompt: the same whatever was sampled
    assert any(tokenizer.decode([i]) == sampled.tokens[0] and abs(float(first[i]) - sampled.token_logprobs[0]) < 1e-4
               for i in range(first.shape[0]))


def test_echo_leads_with_the_prompt_and_its_log_probabilities(client: openai.OpenAI, hf_model: Any,
                                                                tokenizer: Any) -> None:
    """``echo``: the text is prompt + completion; with ``logprobs`` the prompt's tokens lead the log-probabilities
    (its first token with none, the others as transformers' log-softmax given the tokens before them), as an
    evaluation harness scoring a continuation reads them; streamed, the first chunk carries the prompt."""
    prompt_ids = tokenizer.encode(PROMPT)
    generated = generate_greedy(hf_model, prompt_ids, 4)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + generated])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], dim=-1)  # row p: the distribution of token p + 1
    every = prompt_ids + generated
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    result = client.completions.create(**kwargs, echo=True, logprobs=2)
    choice = result.choices[0]
    assert choice.text == PROMPT + tokenizer.decode(generated, skip_special_tokens=True)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens == [tokenizer.decode([t]) for t in every]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([float(expected[p - 1, t]) for p, t in enumerate(every)
                                                         if p > 0], abs=1e-4)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(every))]
    assert result.usage is not None and result.usage.completion_tokens == len(generated)
    plain = client.completions.create(**kwargs, echo=True).choices[0]
    assert plain.text == choice.text and plain.logprobs is None
    text, streamed_tokens, streamed_lps = "", [], []
    for chunk in client.completions.create(**kwargs, echo=True, logprobs=2, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                streamed_tokens += chunk.choices[0].logprobs.tokens
                streamed_lps += chunk.choices[0].logprobs.token_logprobs
    assert (text, streamed_tokens, streamed_lps) == (choice.text, logprobs.tokens, logprobs.token_logprobs)


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, hf_model: Any, tokenizer: Any) -> None:
    """Chat's logprobs: per output token its text, UTF-8 bytes, log-probability and the top_logprobs most
    likely tokens, most likely first; streamed chunks add up to the same content."""
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    generated = generate_greedy(hf_model, prompt_ids, 5)
    expected = _log_softmax_after(hf_model, prompt_ids, generated)
    common: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": 5, "temperature": 0,
                              "logprobs": True, "top_logprobs": 2}
    content = client.chat.completions.create(**common).choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in generated]
    for position, (entry, token) in enumerate(zip(content, generated, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        values, ids = expected[position].topk(2)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in ids.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    streamed = [entry for chunk in client.chat.completions.create(**common, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert streamed == content
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's ``return_tokens_as_token_ids``: the same log-probabilities, each token (and each of the most likely)
    named ``token_id:{id}``; a chat entry's bytes stay its text's, completions' text offsets count the names (vLLM's
    layout); streamed chunks the same; with echo the prompt's first token too."""
    messages = [{"role": "user", "content": "hello world"}]
    common: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": 5, "temperature": 0,
                              "logprobs": True, "top_logprobs": 2}
    texts = client.chat.completions.create(**common).choices[0].logprobs.content
    named = client.chat.completions.create(**common, extra_body={"return_tokens_as_token_ids": True}
                                           ).choices[0].logprobs.content
    for text, name in zip(texts, named, strict=True):
        token = int(name.token.removeprefix("token_id:"))
        assert name.token == f"token_id:{token}" and tokenizer.decode([token]) == text.token
        assert name.logprob == text.logprob and name.bytes == text.bytes
        assert [t.logprob for t in name.top_logprobs] == [t.logprob for t in text.top_logprobs]
        assert [tokenizer.decode([int(t.token.removeprefix("token_id:"))]) for t in name.top_logprobs] == [
            t.token for t in text.top_logprobs]
        assert all(t.bytes == list(t.token.encode()) for t in name.top_logprobs)
    streamed = [entry for chunk in client.chat.completions.create(
        **common, stream=True, extra_body={"return_tokens_as_token_ids": True})
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert streamed == named
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    plain = client.completions.create(**body).choices[0].logprobs
    ids = client.completions.create(**body, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    prompt_ids = tokenizer.encode(PROMPT)
    assert ids.tokens[: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    assert [tokenizer.decode([int(t.removeprefix("token_id:"))]) for t in ids.tokens] == plain.tokens
    assert ids.token_logprobs == plain.token_logprobs
    assert ids.text_offset == [sum(map(len, ids.tokens[:i])) for i in range(len(ids.tokens))]
    assert all(all(key.startswith("token_id:") for key in top) for top in ids.top_logprobs[1:])


def test_tokenize_gives_the_ids_the_generation_endpoints_run_and_detokenize_reverses_it(
        server: BackgroundServer, client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's ``/tokenize``: a prompt's ids (with the tokenizer's special tokens unless asked not to), a conversation's
    — the ones a chat completion with the same messages, tools and flags reports as its prompt (``return_token_ids``)
    —, their count, the context and (asked) their strings; ``/detokenize`` the text of ids; ``/version``. A wrong model
    is a 404, ids outside the vocabulary or a body with neither prompt nor messages a 400 naming the field."""
    url = server.url
    answer = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "model": MODEL_NAME}).json()
    assert answer == {"count": len(tokenizer.encode(PROMPT)), "max_model_len": MAX_CONTEXT,
                      "tokens": tokenizer.encode(PROMPT), "token_strs": None}
    strs = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True,
                                               "add_special_tokens": False}).json()
    assert strs["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    for extra in ({}, {"add_generation_prompt": False}):
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}).json()
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                              extra_body={"return_token_ids": True, **extra})
        assert tokenized["tokens"] == chat.model_dump()["prompt_token_ids"], extra
        assert tokenized["count"] == chat.usage.prompt_tokens  # type: ignore[union-attr]
    # the template shows tools (a prompt over this tiny model's context: /tokenize counts it all the same)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [tool]}).json()
    rendered = tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert tokenized["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenized["count"] > MAX_CONTEXT == tokenized["max_model_len"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": answer["tokens"], "model": MODEL_NAME}).json()
    assert text == {"prompt": tokenizer.decode(answer["tokens"])}
    assert httpx.get(f"{url}/version").json()["version"] == vexpert_runtime.__version__
    for path, body, status, param in (
            ("/tokenize", {"prompt": PROMPT, "model": "other"}, 404, "model"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
            ("/detokenize", {"tokens": [len(tokenizer) + 10**6]}, 400, "tokens"),
            ("/tokenize", {"text": PROMPT}, 400, "prompt")):
        error = httpx.post(f"{url}{path}", json=body)
        assert error.status_code == status and error.json()["error"]["param"] == param, (body, error.text)


def test_add_special_tokens_and_reasoning_effort_reach_the_tokenizer_and_the_template(tmp_path: Path) -> None:
    """vLLM's ``add_special_tokens`` (a completion's default true: the tokenizer's own special tokens, here a BOS; a
    chat's default false: the template's alone) and ``reasoning_effort`` (a variable of the chat template), in the
    prompt a request runs as in ``/tokenize``'s answer."""
    from tokenizers.processors import TemplateProcessing

    from serve_support import CHAT_TEMPLATE, build_tiny_checkpoint

    build_tiny_checkpoint(tmp_path)
    tok = load_tokenizer(tmp_path)
    bos = tok.convert_tokens_to_ids("<|im_start|>")  # stands in for a BOS the tokenizer adds
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                              special_tokens=[("<|im_start|>", bos)])
    tok.chat_template = CHAT_TEMPLATE + "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}"
    tok.save_pretrained(tmp_path)
    srv = make_server(tmp_path, load_model(tmp_path))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        with_bos = httpx.post(f"{srv.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        without = httpx.post(f"{srv.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
        assert with_bos == [bos, *without]
        for extra, count in (({}, len(with_bos)), ({"add_special_tokens": False}, len(without))):
            answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body=extra)
            assert answer.usage is not None and answer.usage.prompt_tokens == count, extra
        messages = [{"role": "user", "content": "hi"}]
        for extra in ({}, {"reasoning_effort": "low"}, {"add_special_tokens": True}):
            ids = httpx.post(f"{srv.url}/tokenize", json={"messages": messages, **extra}).json()["tokens"]
            assert ("effort=low" in tok.decode(ids)) == ("reasoning_effort" in extra)
            assert (ids[0] == bos and ids[1] == bos) == ("add_special_tokens" in extra)  # the template's is first too
            chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                                  extra_body={"return_token_ids": True, **extra})
            assert chat.model_dump()["prompt_token_ids"] == ids, extra
    finally:
        srv.close()


def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0.7, seed=1, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 3


def test_a_request_without_model_or_max_tokens_gets_vllms_defaults(server: BackgroundServer) -> None:
    """As vLLM 0.32: ``model`` may be left out (or null) — the served model answers and is named —, and a completion
    without ``max_tokens`` stops after 16 tokens as OpenAI's legacy completions do (it ran to the end of the context:
    a copied vLLM client call could generate thousands); ``max_tokens: null`` and a chat without it run to the end."""
    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(f"{server.url}{path}", json={"temperature": 0.7, "seed": 3, "ignore_eos": True, **body},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        return answer

    completion = post("/v1/completions", {"prompt": PROMPT})
    assert completion["model"] == MODEL_NAME and completion["usage"]["completion_tokens"] == 16
    prompt_tokens = completion["usage"]["prompt_tokens"]
    unbounded = post("/v1/completions", {"model": None, "prompt": PROMPT, "max_tokens": None})
    assert unbounded["usage"]["completion_tokens"] == MAX_CONTEXT - prompt_tokens
    chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["model"] == MODEL_NAME and chat["usage"]["completion_tokens"] + chat["usage"]["prompt_tokens"] == MAX_CONTEXT
    response = post("/v1/responses", {"input": "hi", "max_output_tokens": 2})
    assert response["model"] == MODEL_NAME and response["usage"]["output_tokens"] == 2


def test_sixteen_concurrent_streams(client: openai.OpenAI, server: BackgroundServer) -> None:
    """16 streams at once all complete; each seeded stream samples what it samples alone."""

    def stream(i: int) -> tuple[str, str | None, int]:
        chunks = list(
            client.completions.create(
                model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0.8, seed=i,
                stream=True, stream_options={"include_usage": True},
            )
        )
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert chunks[-1].usage is not None
        return "".join(c.choices[0].text for c in chunks if c.choices), finish[0], chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, range(16)))
    assert all(finish in ("stop", "length") and 1 <= n <= 8 for _, finish, n in results)
    assert max(len(step) for step in server.model.steps) > 1  # they really shared batches
    assert [stream(i) for i in (0, 5)] == [results[0], results[5]]


# ---- errors ---------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_errors_are_openai_error_objects(server: BackgroundServer, client: openai.OpenAI) -> None:
    url = f"{server.url}/v1/completions"
    assert _error(httpx.post(url, content=b"{not json", timeout=10), 400)["code"] == "invalid_json"
    assert _error(httpx.post(url, json=[1, 2], timeout=10), 400)["code"] == "invalid_json"
    base: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),  # OpenAI's limit is 128
        ({"n": 2.0}, "n"),
        ({"logprobs": 21}, "logprobs"),  # at most 20 most likely tokens, as vLLM
        ({"logprobs": True}, "logprobs"),  # completions take a count
        ({"prompt_logprobs": 21}, "prompt_logprobs"),  # at most 20 (vLLM's -1, the whole vocabulary, too)
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),  # not streamed (as vLLM)
        ({"prompt": []}, "prompt"),
        ({"prompt": [[3, 4]] * 129}, "prompt"),  # at most 128 sequences per request
        ({"prompt": ["one", "two"], "n": 65}, "prompt"),
        ({"prompt": ["one", [3, 4]]}, "prompt"),  # one kind of prompt per batch
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"model": 5}, "model"),  # (left out or null: the served model, as vLLM's)
        ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range: [-2, 2]
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),  # > 0
        ({"presence_penalty": "0"}, "presence_penalty"),
        ({"logit_bias": {"50256": -101}}, "logit_bias"),  # OpenAI's range: [-100, 100]
        ({"logit_bias": {"fox": 5}}, "logit_bias"),  # keys are token ids
        ({"logit_bias": {str(10**6): 5}}, "logit_bias"),  # outside the vocabulary (the rank checks)
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        # what would be silently wrong if ignored (banned tokens, vLLM's removed guided_* fields, …): refused by name
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"min_tokens": 6, "max_tokens": 5}, "min_tokens"),  # more than it may generate
        ({"suffix": " end"}, "suffix"),
        ({"priority": 1}, "priority"),  # vLLM's fields that would change the tokens or the answer, unsupported here
        ({"length_penalty": 0.8}, "length_penalty"),
        ({"logprob_token_ids": [3]}, "logprob_token_ids"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": ["fox", " "]}, "bad_words"),  # a blank word (a word is served: tests/test_bad_words.py)
        ({"bad_words": "fox"}, "bad_words"),  # a list of words
        ({"skip_special_tokens": 0}, "skip_special_tokens"),  # a boolean (false keeps special tokens: served)
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),  # a boolean
    ]
    for bad, param in cases:
        error = _error(httpx.post(url, json={**base, **bad}, timeout=10), 400)
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{param}: ") and f"{param}: {param}" not in error["message"], error
    assert _error(httpx.post(url, json={**base, "model": "gpt-4"}, timeout=10), 404)["code"] == "model_not_found"
    long_prompt = " ".join(["fox"] * (MAX_CONTEXT + 10))
    error = _error(httpx.post(url, json={**base, "prompt": long_prompt}, timeout=10), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    error = _error(httpx.post(url, json={**base, "max_tokens": MAX_CONTEXT}, timeout=10), 400)
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert _error(httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=10), 400)["param"] == "messages.0.content"
    tool = {"type": "function", "function": {"name": "lookup"}}
    hello = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    for bad, param in (
        ({"tools": [tool]}, "tool_choice"),  # tool_choice defaults to "auto": a tool call would never be parsed
        ({"tools": [tool], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools (with them: test_structured_output.py)
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # with the default add_generation_prompt
        ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # user last
        ({"echo": True}, "echo"),  # vLLM's chat echo (the last message repeated): unsupported
        ({"return_prompt_text": True}, "return_prompt_text"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ):
        error = _error(httpx.post(f"{server.url}/v1/chat/completions", json={**hello, **bad}, timeout=10), 400)
        assert error["param"] == param, (bad, error)
    assert _error(httpx.get(f"{server.url}/v1/nothing", timeout=10), 404)["code"] == "not_found"
    assert _error(httpx.get(url, timeout=10), 405)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
    # still serving; the neutral values OpenAI clients send by default are accepted
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).usage is not None
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, presence_penalty=0,
                                     frequency_penalty=0.0, logit_bias={},
                                     extra_body={"repetition_penalty": 1.0}).usage is not None
    assert client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          presence_penalty=0.0, response_format={"type": "text"}, tool_choice="none",
                                          extra_body={"min_tokens": 0, "skip_special_tokens": True,
                                                      "include_stop_str_in_output": False}).usage is not None


def test_metrics(server: BackgroundServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    assert 'vexpert_serve_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in (
        "vexpert_serve_time_to_first_token_seconds_count",
        "vexpert_serve_inter_token_latency_seconds_count",
        "vexpert_serve_generated_tokens_total",
        "vexpert_serve_prompt_tokens_total",
        "vexpert_serve_requests_running",
        "vexpert_serve_requests_waiting",
        "vexpert_serve_kv_cache_usage_ratio",
    ):
        assert name in text, name
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert samples["vexpert_serve_time_to_first_token_seconds_count"] >= 1
    assert samples["vexpert_serve_generated_tokens_total"] >= 4
    # the same series under vLLM's names and model_name label (what inference gateways and autoscalers read)
    from prometheus_client.parser import text_string_to_metric_families

    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    label = (("model_name", MODEL_NAME),)
    for vllm, ours in (("vllm:num_requests_running", "vexpert_serve_requests_running"),
                       ("vllm:num_requests_waiting", "vexpert_serve_requests_waiting"),
                       ("vllm:kv_cache_usage_perc", "vexpert_serve_kv_cache_usage_ratio"),
                       ("vllm:prompt_tokens_total", "vexpert_serve_prompt_tokens_total"),
                       ("vllm:generation_tokens_total", "vexpert_serve_generated_tokens_total"),
                       ("vllm:time_to_first_token_seconds_count", "vexpert_serve_time_to_first_token_seconds_count"),
                       ("vllm:inter_token_latency_seconds_sum", "vexpert_serve_inter_token_latency_seconds_sum"),
                       ("vllm:e2e_request_latency_seconds_count", "vexpert_serve_request_duration_seconds_count"),
                       ("vllm:request_queue_time_seconds_count", "vexpert_serve_request_queue_time_seconds_count"),
                       ("vllm:request_prefill_time_seconds_sum", "vexpert_serve_request_prefill_time_seconds_sum"),
                       ("vllm:request_decode_time_seconds_count", "vexpert_serve_request_decode_time_seconds_count"),
                       ("vllm:request_inference_time_seconds_sum", "vexpert_serve_request_inference_time_seconds_sum"),
                       ("vllm:request_prompt_tokens_sum", "vexpert_serve_request_prompt_tokens_sum"),
                       ("vllm:request_generation_tokens_count", "vexpert_serve_request_generation_tokens_count")):
        assert values[(vllm, label)] == values[(ours, ())], vllm
    # each finished request's time on its rank and token counts (vLLM's request_* histograms)
    assert values[("vexpert_serve_request_decode_time_seconds_count", ())] == values[
        ("vexpert_serve_request_duration_seconds_count", ())] >= 1
    assert 0 < values[("vexpert_serve_request_inference_time_seconds_sum", ())] <= values[
        ("vexpert_serve_request_duration_seconds_sum", ())]
    assert values[("vexpert_serve_request_generation_tokens_sum", ())] == values[
        ("vexpert_serve_generated_tokens_total", ())]
    assert values[("vllm:request_success_total", (("finished_reason", "length"), *label))] == values[
        ("vexpert_serve_request_finish_total", (("reason", "length"),))] >= 1


def test_latency_metrics_count_from_the_requests_arrival(server: BackgroundServer, client: openai.OpenAI,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """TTFT and duration include what happens before a rank accepts the request (here a slow
    tokenizer), as a client sees it — the operator tunes on these series."""
    def histogram_sum(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return sum(float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name + "_sum"))

    encode, delay = server.api.prompts.prompt_ids, 0.3

    def slow_encode(prompt: Any, tokenizer: Any = None, **options: Any) -> list[int]:
        time.sleep(delay)
        return encode(prompt, tokenizer, **options)

    monkeypatch.setattr(server.api.prompts, "prompt_ids", slow_encode)
    ttft, duration = (histogram_sum("vexpert_serve_time_to_first_token_seconds"),
                      histogram_sum("vexpert_serve_request_duration_seconds"))
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert histogram_sum("vexpert_serve_time_to_first_token_seconds") - ttft >= delay
    assert histogram_sum("vexpert_serve_request_duration_seconds") - duration >= delay


# ---- overload and shutdown --------------------------------------------------------------------


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_overload_gives_429_with_retry_after(checkpoint: Path, hf_model: Any) -> None:
    srv = make_server(checkpoint, hf_model, max_running=1, max_batch_tokens=16, max_waiting=1)
    srv.model.gate = threading.Event()  # steps block: the first request holds the batch
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    url = f"{srv.url}/v1/completions"
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=30)
            _wait_for(lambda: srv.dispatcher.loads()[0].running == 1)
            second = pool.submit(httpx.post, url, json=body, timeout=30)
            _wait_for(lambda: srv.dispatcher.loads()[0].waiting == 1)
            refused = httpx.post(url, json=body, timeout=30)
            assert _error(refused, 429)["code"] == "overloaded"
            assert int(refused.headers["Retry-After"]) >= 1
            srv.model.gate.set()
            assert first.result().status_code == second.result().status_code == 200
        assert 'status="429"' in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.model.gate.set()
        srv.close()


def test_shutdown_drains_in_flight_requests(checkpoint: Path, hf_model: Any) -> None:
    srv = make_server(checkpoint, hf_model)
    srv.model.delay_s = 0.02
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    url = f"{srv.url}/v1/completions"
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            plain = pool.submit(httpx.post, url, json=body, timeout=30)
            streamed = pool.submit(httpx.post, url, json={**body, "stream": True}, timeout=30)
            _wait_for(lambda: srv.dispatcher.loads()[0].running == 2)
            stopping = srv.stop_async()
            _wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503)
            refused = httpx.post(url, json=body, timeout=10)
            assert _error(refused, 503)["code"] == "shutting_down" and "Retry-After" in refused.headers
            assert plain.result().json()["choices"][0]["finish_reason"] == "length"
            assert streamed.result().text.endswith('"finish_reason": "length", "stop_reason": null}]}\n\ndata: [DONE]\n\n')
            stopping.result(30)
        assert sorted(srv.model.released) == [0, 1] and not srv.model.held
    finally:
        srv.close()


def test_shutdown_aborts_after_the_drain_timeout(checkpoint: Path, hf_model: Any) -> None:
    srv = make_server(checkpoint, hf_model, drain_timeout_s=0.3)
    srv.model.delay_s = 0.05  # 60 tokens take 3 s: longer than the drain timeout
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
    url = f"{srv.url}/v1/completions"
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(httpx.post, url, json=body, timeout=30)
            streamed = pool.submit(httpx.post, url, json={**body, "stream": True}, timeout=30)
            _wait_for(lambda: srv.dispatcher.loads()[0].running == 2)
            srv.stop_async().result(30)
            assert _error(plain.result(), 503)["code"] == "aborted"
            text = streamed.result().text
            assert '"code": "aborted"' in text and text.endswith("data: [DONE]\n\n")
        assert not srv.model.held
    finally:
        srv.close()


def test_client_disconnect_cancels_the_sequence(checkpoint: Path, hf_model: Any) -> None:
    srv = make_server(checkpoint, hf_model)
    srv.model.delay_s = 0.02
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 80, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as response:
            next(response.iter_lines())
        _wait_for(lambda: srv.model.released == [0])
        assert not srv.dispatcher.scheduler.has_work()
    finally:
        srv.close()


# ---- the scheduler alone ----------------------------------------------------------------------


class _RandomModel(SynchronousSteps):
    """A StepModel with random logits that records its batches (for scheduling properties)."""

    vocab_size = 64
    max_context = 64
    kv_cache_bytes = 0

    def __init__(self, kv_block_size: int = 1, kv_num_blocks: int = 1000) -> None:
        self.kv_block_size, self.kv_num_blocks = kv_block_size, kv_num_blocks
        self.steps: list[list[Any]] = []
        self.released: list[int] = []

    def kv_bytes_per_token(self) -> int:
        return 1

    def step(self, work: Any) -> torch.Tensor:
        self.steps.append(list(work))
        for item in work:
            assert len(item.blocks) * self.kv_block_size >= item.position + len(item.tokens)
        tokens = torch.randint(0, self.vocab_size, (len(work),))
        return torch.where(torch.tensor([item.sample is not None for item in work], dtype=torch.bool), tokens, -1)

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


class _Tok:
    """Decodes token i as the letter chr(97 + i % 26)."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def _request(rid: str, prompt_len: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_scheduler_idle_step_chunked_prefill_and_kv_budget() -> None:
    model = _RandomModel()
    scheduler = Scheduler(model, _Tok(), SchedulerConfig(kv_budget_tokens=64, max_batch_tokens=8, max_running=4))
    scheduler.run_iteration()
    assert model.steps == [[]]  # lockstep: an idle rank still steps

    events: list[Event] = []
    scheduler.submit(_request("short", 3, 30), events.append)
    scheduler.run_iteration()  # prefill of "short"
    scheduler.submit(_request("long", 20, 10), events.append)
    # a 40-token prompt (+ its first token) does not fit in what "short" and "long" leave of 64 blocks
    scheduler.submit(_request("blocked", 40, 10), events.append)
    for _ in range(4):
        scheduler.run_iteration()
    long_chunks = [w for step in model.steps[2:] for w in step if w.seq_id == 1]
    assert [len(w.tokens) for w in long_chunks[:3]] == [7, 7, 6]  # 8 tokens a step, one kept for the decode
    assert [w.position for w in long_chunks[:3]] == [0, 7, 14]
    assert all(any(w.seq_id == 0 for w in step) for step in model.steps[2:])  # "short" decodes every step
    assert scheduler.load().waiting == 1 and all(w.seq_id != 2 for step in model.steps for w in step)
    while scheduler.has_work():
        scheduler.run_iteration()
    finished = {e.request_id: e for e in events if e.finished}
    assert {r: e.finish_reason for r, e in finished.items()} == {"short": "length", "long": "length", "blocked": "length"}
    assert finished["short"].completion_tokens == 30 and sorted(set(model.released)) == [0, 1, 2]
    assert sum(e.new_tokens for e in events if e.request_id == "long") == 10
    # "blocked" got in once "long" left, then outgrew what "short" leaves: preempted, re-admitted, finished
    assert scheduler.load().preemptions == 1 and model.released.count(2) == 2
    assert sum(e.new_tokens for e in events if e.request_id == "blocked") == 10


def test_scheduler_refusals_and_cancel() -> None:
    model = _RandomModel()
    scheduler = Scheduler(model, _Tok(), SchedulerConfig(kv_budget_tokens=64, max_batch_tokens=8, max_running=1, max_waiting=1))
    with pytest.raises(VExpertInputError):
        scheduler.submit(_request("too-long", 60, 10), lambda e: None)
    events: list[Event] = []
    scheduler.submit(_request("a", 4, 50), events.append)
    with pytest.raises(ServeRefusal) as refused:
        scheduler.submit(_request("b", 4, 5), events.append)
    assert refused.value.status == 429
    scheduler.run_iteration()
    scheduler.cancel("a")
    scheduler.run_iteration()
    assert events[-1].finish_reason == "abort" and model.released == [0] and not scheduler.has_work()
    scheduler.stop_accepting()
    with pytest.raises(ServeRefusal) as refused:
        scheduler.submit(_request("c", 4, 5), events.append)
    assert refused.value.status == 503
    with pytest.raises(VExpertInputError, match="--max-model-len"):  # the fix names the knobs
        SchedulerConfig(kv_budget_tokens=32).check(64)


def test_kv_blocks_are_taken_on_growth_not_for_the_worst_case() -> None:
    """Block size 4, 8 usable blocks (32 tokens). A request whose prompt + max_tokens is the whole
    pool takes only the blocks its tokens fill, so a second one runs beside it at once."""
    model = _RandomModel(kv_block_size=4, kv_num_blocks=9)
    model.max_context = 32
    scheduler = Scheduler(model, _Tok(), SchedulerConfig(kv_budget_tokens=1000, max_batch_tokens=12, max_running=4))
    assert scheduler.pool.usable_blocks == 8 and scheduler.load().kv_tokens_budget == 32
    events: list[Event] = []
    scheduler.submit(_request("whole", 6, 26), events.append)  # may grow to 32 tokens = every block
    scheduler.submit(_request("next", 3, 2), events.append)
    scheduler.run_iteration()
    load = scheduler.load()
    assert (load.running, load.waiting) == (2, 0)
    assert load.kv_blocks_used == 3 and load.kv_tokens_used == 9  # 6 prompt tokens hold 2 blocks, 3 hold 1
    first = model.steps[0][0]
    assert first.blocks == (1, 2) and first.sample is not None
    for _ in range(3):
        scheduler.run_iteration()
    assert scheduler.load().kv_blocks_used == 3  # "next" finished (1 block back); "whole" grew a third at token 9
    assert scheduler.load().kv_tokens_used == 9
    while scheduler.has_work():
        scheduler.run_iteration()
    assert {e.request_id: e.finish_reason for e in events if e.finished} == {"whole": "length", "next": "length"}
    assert not any(e.error for e in events) and scheduler.load().preemptions == 0
    assert scheduler.pool.used_blocks == 0 and scheduler.load().kv_tokens_used == 0


def test_block_pool_grows_on_demand_and_frees() -> None:
    from vexpert_runtime.serve.kv_cache import SCRATCH_BLOCK, BlockPool, KVCacheFull

    pool = BlockPool(num_blocks=5, block_size=4)  # 4 usable
    pool.add(1)
    assert pool.grow(1, 1) == [1] and pool.grow(1, 4) == [1] and pool.grow(1, 5) == [1, 2]
    assert pool.slots(1, 3, 3) == [1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    with pytest.raises(ValueError):
        pool.add(1)
    pool.add(2)
    assert pool.grow(2, 4) == [3]
    with pytest.raises(KVCacheFull):
        pool.grow(2, 9)  # 2 more blocks, 1 free: refused whole
    assert pool.table(2) == [3] and pool.free_blocks == 1
    pool.free(1)
    assert pool.free_blocks == 3 and SCRATCH_BLOCK not in pool.table(2)
    pool.add(3)
    assert sorted(pool.grow(3, 12)) == [1, 2, 4]  # freed blocks are reused; the scratch block never
    pool.free(2)
    pool.free(3)
    pool.free(99)  # unknown: ignored
    assert pool.free_blocks == 4 and pool.used_blocks == 0


def test_what_crosses_process_boundaries_pickles() -> None:
    """A multi-process dispatcher sends requests, events, loads and refusals over queues."""
    import pickle

    from vexpert_runtime.serve.events import RankLoad, overloaded

    request = _request("r", 3, 4)
    event = Event("r", text="hi", new_tokens=1, finish_reason="length", prompt_tokens=3, completion_tokens=4,
                  logprobs=EventLogprobs((TokenLogprobs(7, -0.5, ((7, -0.5), (2, -1.5))),)))
    asks = dataclasses.replace(request, params=dataclasses.replace(request.params, logprobs=2))
    for item in (request, asks, event, RankLoad(1, 2, 3, 4, 5)):
        assert pickle.loads(pickle.dumps(item)) == item
    refusal = pickle.loads(pickle.dumps(overloaded(8)))
    assert (refusal.status, refusal.retry_after_s, str(refusal)) == (429, 1, str(overloaded(8)))
    from vexpert_runtime.serve.events import EventWithTokenIds, RankEvent, with_token_ids

    ids = with_token_ids(event, (5, 6, 7))  # return_token_ids: an event with its output ids, beside plain ones
    for message in (RankEvent(0, (event,), ("a", "b"), RankLoad(1, 2, 3, 4, 5)), RankEvent(2, (), ("c",)),
                    RankEvent(1, (event, event)), RankEvent(3, (event, ids, event, with_token_ids(event, ())))):
        back = pickle.loads(pickle.dumps(message))
        assert back == message and [type(e) for e in back.events] == [type(e) for e in message.events]
    assert isinstance(ids, EventWithTokenIds) and pickle.loads(pickle.dumps(RankEvent(0, (ids,)))).events[0] == ids


def test_a_ranks_iteration_reaches_the_api_as_one_message(hf_model: Any, tokenizer: Any) -> None:
    """Per iteration a rank sends one RankEvent with its events, the requests it queued and its
    load (each message wakes the API's reader thread); the dispatcher takes the load, answers
    ``submit`` from the acceptances in it, then routes the events."""
    import queue as queue_module

    from vexpert_runtime.serve.events import RankEvent, RankLoad
    from vexpert_runtime.serve.multirank import MultiRankDispatcher
    from vexpert_runtime.serve.rank import ServingRank
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    requests: queue_module.Queue[Any] = queue_module.Queue()
    events: queue_module.Queue[Any] = queue_module.Queue()
    rank = ServingRank.__new__(ServingRank)  # its constructor loads a model; the message methods need these
    rank.args = type("Args", (), {"requests": requests, "events": events})()  # type: ignore[assignment]
    rank.rank, rank.world = 0, 1
    rank._init_outboxes(events)
    rank.scheduler = Scheduler(RecomputeStepModel(hf_model, MAX_CONTEXT), tokenizer, SchedulerConfig(None, 64, 4, 4), [])
    requests.put(_request("r1", 3, 2))
    rank.take_requests()
    accepted = events.get_nowait()  # queued: the API may answer now (no iteration has run)
    assert isinstance(accepted, RankEvent) and accepted.accepted == ("r1",) and not accepted.events
    requests.put(_request("r2", 3, 2))
    rank._on_message(requests.get_nowait())  # queued by the loop, flushed with the iteration
    rank.scheduler.run_iteration()
    rank.flush_events(with_load=True)
    message = events.get_nowait()
    assert events.empty(), "one message for the iteration"
    assert isinstance(message, RankEvent) and message.accepted == ("r2",)
    assert isinstance(message.load, RankLoad) and message.load.running == 2
    rank.flush_events(with_load=True)  # nothing new: no message
    assert events.empty()
    rank.report_load(force=True)  # an idle rank's report: its load alone
    idle = events.get_nowait()
    assert isinstance(idle, RankEvent) and not idle.events and not idle.accepted and idle.load is not None

    async def dispatch() -> None:
        outbound: queue_module.Queue[Any] = queue_module.Queue()
        inbound: queue_module.Queue[Any] = queue_module.Queue()
        dispatcher = MultiRankDispatcher([outbound], inbound, 4, lambda: None, lambda: None, max_running=4)
        try:
            submitted = asyncio.ensure_future(dispatcher.submit(_request("x", 3, 1)))
            sent = await asyncio.to_thread(outbound.get, True, 5)
            assert sent.request_id == "x"
            done = Event("x", text="a", new_tokens=1, finish_reason="length", prompt_tokens=3, completion_tokens=1)
            inbound.put(RankEvent(0, (done,), ("x",), RankLoad(1, 0, 0, 0, 0)))
            stream = await asyncio.wait_for(submitted, 5)
            batches = [batch async for batch in stream]
            assert [e.text for batch in batches for e in batch] == ["a"]
            assert dispatcher.loads()[0] == RankLoad(1, 0, 0, 0, 0)
        finally:
            await dispatcher.shutdown(0.1)

    asyncio.run(dispatch())


def test_with_two_api_servers_a_rank_answers_each_request_to_the_server_that_sent_it(hf_model: Any,
                                                                                   tokenizer: Any) -> None:
    """Acceptances, events and refusals go to the sending server's queue; the load to every server."""
    import dataclasses
    import queue as queue_module

    from vexpert_runtime.serve.dispatcher import RankRefused
    from vexpert_runtime.serve.events import RankEvent
    from vexpert_runtime.serve.rank import ServingRank
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    requests: queue_module.Queue[Any] = queue_module.Queue()
    servers: list[queue_module.Queue[Any]] = [queue_module.Queue(), queue_module.Queue()]
    rank = ServingRank.__new__(ServingRank)  # its constructor loads a model; the message methods need these
    rank.args = type("Args", (), {"requests": requests, "events": servers})()  # type: ignore[assignment]
    rank.rank, rank.world = 0, 1
    rank._init_outboxes(servers)
    rank.scheduler = Scheduler(RecomputeStepModel(hf_model, MAX_CONTEXT), tokenizer, SchedulerConfig(None, 64, 4, 3), [])
    for rid, server in (("a", 0), ("b", 1), ("c", 1), ("full", 1)):  # 3 may wait: the fourth is refused (429)
        requests.put(dataclasses.replace(_request(rid, 3, 2), reply_to=server))
    rank.take_requests()
    got: list[list[Any]] = [[], []]
    for server, box in enumerate(servers):
        while not box.empty():
            got[server].append(box.get_nowait())
    assert [m.accepted for m in got[0] if isinstance(m, RankEvent)] == [("a",)]
    assert [m.accepted for m in got[1] if isinstance(m, RankEvent)] == [("b", "c")]
    assert [m.request_id for m in got[1] if isinstance(m, RankRefused)] == ["full"] and not any(
        isinstance(m, RankRefused) for m in got[0])
    finished: list[set[str]] = [set(), set()]
    loads = [0, 0]
    while rank.has_work():
        rank.scheduler.run_iteration()
        rank.flush_events(with_load=True)
        for server, box in enumerate(servers):
            while not box.empty():
                message = box.get_nowait()
                finished[server] |= {e.request_id for e in message.events if e.finished}
                loads[server] += message.load is not None
    assert finished == [{"a"}, {"b", "c"}] and loads[0] == loads[1] > 0
    assert rank._reply_to == {}  # forgotten once finished (or refused)


# ---- sampling pieces --------------------------------------------------------------------------


def test_stop_checker_holds_back_possible_prefixes() -> None:
    checker = StopChecker(["END", "xyz"])
    assert checker.push("abc E") == ("abc ", False)
    assert checker.push("N") == ("", False)
    assert checker.push("X") == ("ENX", False)  # not a stop string after all: released
    assert checker.push(" fooEN") == (" foo", False)
    assert checker.push("D and more") == ("", True)
    other = StopChecker(["xyz"])
    assert other.push("ax") == ("a", False) and other.flush() == "x"
    # include_stop_str_in_output: the text ends with the stop string that starts first (first listed on a tie)
    included = StopChecker(["yz", "xy"], include=True)
    assert included.push("ab x") == ("ab ", False)  # "x" held: it may start "xy"
    assert included.push("yz tail") == ("xy", True)  # "xy" starts before "yz"
    assert StopChecker(["b", "ab"], include=True).push("zab") == ("zab", True)
    assert StopChecker(["ab", "a"], include=True).push("zab") == ("zab", True)
    assert StopChecker(["a", "ab"], include=True).push("zab") == ("za", True)


def test_incremental_detokenizer_matches_full_decode(tokenizer: Any) -> None:
    text = "naïve café – déjà vu: 数字 🙂 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True) == text
    # After a prompt: tokenizers' DecodeStream and the window decode give the same deltas, which add
    # up to the text the generated tokens add to the prompt's.
    prompt = tokenizer.encode("A prompt that ends in a word")
    streaming = IncrementalDetokenizer(tokenizer, prompt)
    windows = IncrementalDetokenizer(tokenizer, prompt)
    assert streaming._stream is not None
    windows._stream = None
    deltas = [streaming.push(i) for i in ids]
    assert deltas == [windows.push(i) for i in ids]
    full = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    assert "".join(deltas) + streaming.flush() == full[len(tokenizer.decode(prompt, skip_special_tokens=True)):]


def test_sample_tokens_greedy_seeded_and_top_p() -> None:
    from vexpert_runtime.serve.sampling import sample_tokens, sampling_tensors
    from vexpert_runtime.serve.step import SamplingSpec

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = sample_tokens(logits, *sampling_tensors([SamplingSpec()] * 3, "cpu"))
    assert greedy.tolist() == logits.argmax(1).tolist()
    # A seeded row samples the same token whatever shares its batch; another draw index differs.
    spec = SamplingSpec(temperature=1.0, top_p=1.0, seed=11, draw=3)
    alone = sample_tokens(logits[:1], *sampling_tensors([spec], "cpu"))
    batched = sample_tokens(logits, *sampling_tensors([spec, SamplingSpec(), SamplingSpec(1.0, 0.5, 4, 0)], "cpu"))
    assert alone[0] == batched[0]
    draws = [int(sample_tokens(logits[:1], *sampling_tensors([SamplingSpec(1.0, 1.0, 11, d)], "cpu"))[0])
             for d in range(200)]
    assert len(set(draws)) > 10
    # Frequencies follow softmax: the hash race is a fair draw (2,000 draws over 4 tokens).
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    picks = torch.tensor([int(sample_tokens(probs.log(), *sampling_tensors([SamplingSpec(1.0, 1.0, 5, d)], "cpu"))[0])
                          for d in range(2000)])
    freq = torch.bincount(picks, minlength=4).float() / 2000
    assert torch.allclose(freq, probs[0], atol=0.04)
    # top-p: a token whose higher-ranked mass equals top_p exactly is outside the set.
    edge = torch.tensor([[0.5, 0.25, 0.25]]).log()
    kept = {int(sample_tokens(edge, *sampling_tensors([SamplingSpec(1.0, 0.75, 9, d)], "cpu"))[0]) for d in range(300)}
    assert kept == {0, 1}
    kept = {int(sample_tokens(edge, *sampling_tensors([SamplingSpec(1.0, 0.5, 9, d)], "cpu"))[0]) for d in range(300)}
    assert kept == {0}


def test_top_p_keeps_the_smallest_sufficient_set() -> None:
    """The tokens sample_tokens can draw under top-p are exactly the smallest most-likely set."""
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.1]]).log()

    def drawable(top_p: float) -> set[int]:
        return {int(sample_tokens(logits, *sampling_tensors([SamplingSpec(1.0, top_p, 3, d)], "cpu"))[0])
                for d in range(400)}

    assert drawable(0.7) == {1, 2}
    assert drawable(0.01) == {1}


def _drawn(probs: list[float], spec: SamplingSpec, draws: int = 2000) -> torch.Tensor:
    """How often each token is drawn under ``spec`` (its seed and temperature; draws 0 … draws−1)."""
    logits = torch.tensor([probs]).log()
    specs = [SamplingSpec(spec.temperature, spec.top_p, spec.seed, d, spec.top_k, spec.min_p) for d in range(draws)]
    picks = sample_tokens(logits.repeat(draws, 1), *sampling_tensors(specs, "cpu"))
    return torch.bincount(picks, minlength=len(probs)).float() / draws


def test_min_p_then_top_k_then_top_p_over_what_is_left_as_vllm_samples() -> None:
    """vLLM's order: min-p (p ≥ min_p · max p), top-k, then top-p over the renormalised rest; the kept
    tokens are drawn in proportion to their probabilities."""
    probs = [0.4, 0.3, 0.2, 0.1]
    for spec, kept in (
        (SamplingSpec(1.0, top_k=2), {0: 0.4 / 0.7, 1: 0.3 / 0.7}),
        (SamplingSpec(1.0, top_k=1), {0: 1.0}),
        (SamplingSpec(1.0, top_k=10), dict(enumerate(probs))),  # k past the vocabulary: everything
        (SamplingSpec(1.0, min_p=0.6), {0: 0.4 / 0.7, 1: 0.3 / 0.7}),  # threshold 0.24
        (SamplingSpec(1.0, min_p=0.45), {0: 0.4 / 0.9, 1: 0.3 / 0.9, 2: 0.2 / 0.9}),  # 0.18
        # top-p over the top 2 renormalised (0.57, 0.43): the second has 0.57 ≥ 0.5 above it. Over the
        # whole distribution it would have 0.4 < 0.5 above it and stay.
        (SamplingSpec(1.0, 0.5, top_k=2), {0: 1.0}),
        (SamplingSpec(1.0, 0.5, min_p=0.6), {0: 1.0}),
        (SamplingSpec(1.0, 0.5), {0: 0.4 / 0.7, 1: 0.3 / 0.7}),
        (SamplingSpec(1.0, 0.8, top_k=3), {0: 0.4 / 0.9, 1: 0.3 / 0.9, 2: 0.2 / 0.9}),  # 0.78 above the third
    ):
        freq = _drawn(probs, dataclasses.replace(spec, seed=5))
        want = torch.tensor([kept.get(t, 0.0) for t in range(len(probs))])
        assert set(torch.nonzero(freq).flatten().tolist()) == set(kept), spec
        assert torch.allclose(freq, want, atol=0.04), (spec, freq)
    # a greedy row ignores them all; min_p 1 and top_k 1 leave the argmax only
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    for spec in (SamplingSpec(0.0, 0.3, 1, 0, 5, 0.5), SamplingSpec(1.0, 1.0, 2, 7, top_k=1),
                 SamplingSpec(0.9, 1.0, 4, 1, min_p=1.0)):
        assert sample_tokens(logits, *sampling_tensors([spec] * 3, "cpu")).tolist() == logits.argmax(1).tolist()


def test_event_channel_hands_over_every_event_that_has_arrived_in_one_batch() -> None:
    """The API writes one batch per socket write: what arrived together (one wake-up of the loop),
    or while the stream's writer was busy, comes out together; nothing after the finishing event."""
    import asyncio

    from vexpert_runtime.serve.dispatcher import EventChannel

    async def main() -> list[list[str]]:
        channel = EventChannel(asyncio.get_running_loop())
        batches = channel.__aiter__()
        EventChannel.put_all([(channel, Event("r", text="a", new_tokens=1)), (channel, Event("r", text="b", new_tokens=1))])
        got = [await batches.__anext__()]
        channel.put(Event("r", text="c", new_tokens=1))
        got.append(await batches.__anext__())  # one that comes alone is not held back for company
        for event in (Event("r", text="d", new_tokens=1), Event("r", text="e", new_tokens=1, finish_reason="length"),
                      Event("r", text="late")):
            channel.put(event)
        await asyncio.sleep(0)  # all three queued before the writer looks
        got.append(await batches.__anext__())
        rest = [batch async for batch in batches]
        return [[event.text for event in batch] for batch in got + rest]

    assert asyncio.run(main()) == [["a", "b"], ["c"], ["d", "e"]]


def test_short_prompts_tokenized_on_the_loop_while_long_ones_go_to_the_thread(server: BackgroundServer,
                                                                              tokenizer: Any) -> None:
    """Short prompts are tokenized on the event loop, long ones on the tokenizer thread, at the same
    time: each path has its own tokenizer (a fast tokenizer shared across threads can fail with
    "Already borrowed"), and both give the tokenizer's own ids."""
    from concurrent.futures import ThreadPoolExecutor

    from vexpert_runtime.serve.prompts import INLINE_TOKENIZE_CHARS

    shorts = [f"{PROMPT} {i}" for i in range(16)]
    long_prompt = ("the quick brown fox " * (INLINE_TOKENIZE_CHARS // 10))[: INLINE_TOKENIZE_CHARS + 50]
    long_tokens = len(tokenizer.encode(long_prompt))

    def send(prompt: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, [p for short in shorts for p in (short, long_prompt)]))
    for prompt, response in zip([p for short in shorts for p in (short, long_prompt)], responses, strict=True):
        if prompt is long_prompt:  # past the tiny model's context: refused, naming its token count
            assert response.status_code == 400, response.text
            assert f"{long_tokens} tokens" in response.json()["error"]["message"]
        else:
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_a_tokenizer_that_cannot_be_copied_leaves_every_prompt_to_the_tokenizer_thread(tokenizer: Any) -> None:
    from vexpert_runtime.serve.api import ApiConfig, ServeApi

    class Uncopyable:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __deepcopy__(self, memo: Any) -> Any:
            raise TypeError("cannot copy")

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return list(self.inner.encode(text, **kwargs))

    api = ServeApi(None, Uncopyable(tokenizer), ApiConfig(MODEL_NAME, MAX_CONTEXT, len(tokenizer)))  # type: ignore[arg-type]
    try:
        assert api.prompts.loop_tokenizer is None
        ids = asyncio.run(api.prompts.run(api.prompts.prompt_ids, PROMPT, len(PROMPT)))
        assert ids == list(tokenizer.encode(PROMPT))
    finally:
        api.close()


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_sends_the_first_token_at_once_then_every_nth_and_the_rest_with_the_finish(
        interval: int) -> None:
    """``stream_interval`` 3: 10 tokens as events of 1 (the first: time to first token), 3, 3, then the
    last 3 with the finish; 1: one event a token. The text and token counts add up to the same either
    way, and a cancel hands the held text over with the abort."""
    model = _RandomModel()
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=8, max_running=2, stream_interval=interval)
    scheduler = Scheduler(model, _Tok(), config)
    events: list[Event] = []
    scheduler.submit(_request("a", 3, 10), events.append)
    scheduler.submit(_request("b", 3, 50), events.append)
    for _ in range(12):
        scheduler.run_iteration()
    a = [e for e in events if e.request_id == "a"]
    expected = [1] * 10 if interval == 1 else [1, 3, 3, 3]
    assert [e.new_tokens for e in a] == expected and a[-1].finish_reason == "length"
    assert a[-1].completion_tokens == 10 and len("".join(e.text for e in a)) == 10
    b_before = [e for e in events if e.request_id == "b"]
    scheduler.cancel("b")
    scheduler.run_iteration()
    b = [e for e in events if e.request_id == "b"]
    assert b[-1].finish_reason == "abort" and len(b) == len(b_before) + 1
    produced = sum(e.new_tokens for e in b)
    assert produced == b[-1].completion_tokens and len("".join(e.text for e in b)) == produced
    with pytest.raises(VExpertInputError, match="stream_interval"):
        SchedulerConfig(kv_budget_tokens=None, stream_interval=0).check(64)


@pytest.mark.parametrize("chat", [False, True])
def test_a_text_chunk_framed_once_per_stream_is_the_chunk_encoded_whole(chat: bool) -> None:
    """The SSE writer JSON-encodes a stream's chunk once with a mark for its text, then each text-only
    chunk is the bytes around the mark + the text's JSON: byte for byte what encoding it whole gives."""
    import json as json_module

    from vexpert_runtime.serve import openai_api as oa
    from vexpert_runtime.serve.api import _TEXT_MARK, _sse, _text_frame

    def chunk(text: str, model: str = "m\u00e9-1", index: int = 2) -> dict[str, Any]:
        if chat:
            return oa.chat_chunk("chatcmpl-1", 17, model, {"content": text}, None, index)
        return oa.completion_chunk("cmpl-1", 17, model, text, None, index)

    frame = _text_frame(chunk(_TEXT_MARK))
    assert frame is not None
    for text in (" fox", 'a "quoted"\n\ttab \\ back', "\u00fc\u4e2d\U0001f600", "\ufffd", "", "\uf8ff"):
        framed = frame[0] + json_module.dumps(text, ensure_ascii=False).encode() + frame[1]
        assert framed == _sse(chunk(text))
    assert _text_frame(chunk(_TEXT_MARK, model=_TEXT_MARK)) is None  # the mark twice: no frame, encoded whole


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens_as_vllm(server: BackgroundServer,
                                                                       client: openai.OpenAI) -> None:
    """vLLM's ``truncate_prompt_tokens`` k: the prompt's last k tokens (``truncation_side: "right"``: its first k) are
    what the model sees — the same answer and usage as sending those tokens — also for chat and ``echo``; −1 keeps
    what the context holds less one; more than the context is a 400 naming the field."""
    ids = list(range(5, 30))
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}

    def complete(**fields: Any) -> Any:
        return client.completions.create(**{**body, **fields})  # type: ignore[call-overload]

    last, first = complete(prompt=ids[-8:]), complete(prompt=ids[:8])
    assert last.choices[0].text != first.choices[0].text  # the two halves answer differently
    cut = complete(prompt=ids, extra_body={"truncate_prompt_tokens": 8})
    assert (cut.choices[0].text, cut.usage.prompt_tokens) == (last.choices[0].text, 8)  # type: ignore[union-attr]
    right = complete(prompt=ids, extra_body={"truncate_prompt_tokens": 8, "truncation_side": "right"})
    assert right.choices[0].text == first.choices[0].text
    echoed = complete(prompt=ids, echo=True, extra_body={"truncate_prompt_tokens": 8})
    kept_text = server.api.prompts.tokenizer.decode(ids[-8:])
    assert echoed.choices[0].text == kept_text + last.choices[0].text
    assert complete(prompt=ids, extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == len(ids)  # type: ignore[union-attr]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT * 3}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    for bad in (MAX_CONTEXT + 1, -2):
        error = _error(httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ids,
                                                                       "truncate_prompt_tokens": bad}, timeout=10), 400)
        assert error["param"] == "truncate_prompt_tokens", error


def test_prompt_logprobs_are_vllms_with_each_prompt_tokens_rank(server: BackgroundServer, client: openai.OpenAI,
                                                                  hf_model: Any) -> None:
    """vLLM's ``prompt_logprobs`` k: per prompt token after the first, its log-probability given the tokens before
    it and its rank in the model's distribution, then the k most likely (ranks 1…k) — transformers' numbers; the
    first is null; ``logprobs`` then covers only the output; a chat response carries its prompt's once."""
    ids = [5, 17, 3, 42, 8, 99, 23]
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    answer = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 3, "logprobs": 1},
        timeout=30).json()
    choice = answer["choices"][0]
    listed = choice["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for position, entry in enumerate(listed[1:], 1):
        row, token = logp[position - 1], ids[position]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert mine["rank"] == int((row >= row[token]).sum())
        best = torch.topk(row, 3)
        for rank, (value, top) in enumerate(zip(best.values.tolist(), best.indices.tolist(), strict=True), 1):
            assert entry[str(top)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert entry[str(top)]["rank"] == (mine["rank"] if top == token else rank)
    assert len(choice["logprobs"]["tokens"]) == answer["usage"]["completion_tokens"] == 3  # the output's only
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "n": 2,
        "prompt_logprobs": 0}, timeout=30).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # k = 0: the prompt token alone


def test_return_token_ids_gives_the_prompt_and_output_ids_as_vllm(server: BackgroundServer, client: openai.OpenAI,
                                                                    tokenizer: Any) -> None:
    """vLLM's ``return_token_ids``: each completion choice's ``prompt_token_ids`` and ``token_ids`` (every output token,
    the one that ended it too: as many as the usage counts; their text is the choice's), a chat response's prompt ids
    once; streamed, each chunk's ids (a completion choice's first chunk with its prompt's, a chat's role chunk with
    them), which join into the ids of the same request unstreamed."""
    answer = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": [PROMPT, "fox"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3,
        "return_token_ids": True}, timeout=30).json()
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("fox")]
    assert [c["prompt_token_ids"] for c in answer["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert sum(len(c["token_ids"]) for c in answer["choices"]) == answer["usage"]["completion_tokens"]
    for choice in answer["choices"]:
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True},
        timeout=30).json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})  # only when asked

    def streamed(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=30) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    body = {"model": MODEL_NAME, "prompt": [PROMPT, "fox"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "return_token_ids": True}
    ids: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    prompt_ids: dict[int, list[list[int]]] = {}
    for chunk in streamed("/v1/completions", body):
        for choice in chunk["choices"]:
            index = choice["index"]
            if index not in ids:  # the choice's first chunk leads with its prompt's ids
                prompt_ids[index] = [choice["prompt_token_ids"]]
            elif "prompt_token_ids" in choice:
                prompt_ids[index].append(choice["prompt_token_ids"])
            ids.setdefault(index, []).extend(choice["token_ids"])
            text[index] = text.get(index, "") + choice["text"]
    assert [prompt_ids[i] for i in range(4)] == [[prompts[0]]] * 2 + [[prompts[1]]] * 2
    assert [ids[i] for i in range(4)] == [c["token_ids"] for c in answer["choices"]]
    assert [text[i] for i in range(4)] == [c["text"] for c in answer["choices"]]
    chat_body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                 "return_token_ids": True, "temperature": 1.0, "seed": 5}
    unstreamed = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body, timeout=30).json()
    chunks = streamed("/v1/chat/completions", chat_body)
    assert chunks[0]["prompt_token_ids"] == unstreamed["prompt_token_ids"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    joined = [token for chunk in chunks[1:] for choice in chunk["choices"] for token in choice["token_ids"]]
    assert joined == unstreamed["choices"][0]["token_ids"] and len(joined) == unstreamed["usage"]["completion_tokens"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:]) \
        == unstreamed["choices"][0]["message"]["content"]
