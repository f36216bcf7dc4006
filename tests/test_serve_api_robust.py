"""``vexpert serve``'s API under bad input and attack (issue 22, points 1–3, 6–8).

Large prompts are refused by size before they are read or tokenized (413) and neither stall ``/health``
nor keep memory; malformed JSON, lone surrogates, wrong types, wrong Content-Type, unknown roles and
oversized headers get 4xx OpenAI error objects, never a 500; ``--api-key`` guards ``/v1/*``; a slow-loris
connection is closed after the header timeout. The last test runs the real ``vexpert serve`` process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from runtime_support import wait_healthy
from serve_support import (
    MAX_CONTEXT,
    MODEL_NAME,
    BackgroundServer,
    RecomputeStepModel,
    build_tiny_checkpoint,
    load_model,
    load_tokenizer,
    single_rank_api,
)
from vexpert_runtime.serve.api import MAX_JSON_DEPTH, body_limit, json_too_deep, not_text
from vexpert_runtime.serve.sampling import eos_token_ids
from vexpert_runtime.serve.scheduler import SchedulerConfig

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-0123456789"
BIG = 20 * 1024 * 1024
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe")
    build_tiny_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    return load_model(checkpoint)


def _server(checkpoint: Path, hf_model: Any, **config: Any) -> BackgroundServer:
    """A started single-rank in-process server whose :class:`ApiConfig` has ``config`` changed."""
    model = RecomputeStepModel(hf_model)
    rank_tokenizer = load_tokenizer(checkpoint)
    api = single_rank_api(model, load_tokenizer(checkpoint), rank_tokenizer, MODEL_NAME,
                          SchedulerConfig(4 * MAX_CONTEXT, 64, 32, 64), eos_token_ids(rank_tokenizer), 10.0,
                          CollectorRegistry())
    api.config = dataclasses.replace(api.config, **config)
    return BackgroundServer(api, api.dispatcher, model).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(checkpoint: Path, hf_model: Any) -> Iterator[BackgroundServer]:
    srv = _server(checkpoint, hf_model, header_timeout_s=1.0)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def keyed(checkpoint: Path, hf_model: Any) -> Iterator[BackgroundServer]:
    srv = _server(checkpoint, hf_model, api_key=API_KEY)
    yield srv
    srv.close()


def _error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """The OpenAI error object of a 4xx answer (``status`` if given)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, response.text[:500]
    assert response.headers["Content-Type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"] and "pydantic" not in error["message"].lower()
    return error


def _rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class HealthPoller:
    """Polls ``/health`` on a thread and records each answer's latency."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url + "/health"
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                status = client.get(self.url).status_code
                self.latencies.append(time.monotonic() - start)
                self.statuses.append(status)
                time.sleep(0.05)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _big_prompt_body() -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "fox " * (BIG // 4), "max_tokens": 1}).encode()


# ---- point 1 and 2: large prompts ---------------------------------------------------------------


def test_body_limit_follows_the_context() -> None:
    assert body_limit(96) == 96 * 16 + 64 * 1024
    assert body_limit(131072) == 131072 * 16 + 64 * 1024
    assert body_limit(10**7) == 4 * 1024 * 1024  # never more than 4 MiB


def test_a_20mb_prompt_is_refused_without_stalling_or_keeping_memory(server: BackgroundServer) -> None:
    body = _big_prompt_body()
    url = f"{server.url}/v1/completions"
    httpx.post(url, json={"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 1}, timeout=30)
    before = _rss_bytes()
    with HealthPoller(server.url) as poller:
        for _ in range(3):
            error = _error(httpx.post(url, content=body, headers=JSON, timeout=60), 413)
            assert error["code"] == "request_too_large" and str(body_limit(MAX_CONTEXT)) in error["message"]
        time.sleep(0.3)
    after = _rss_bytes()
    assert poller.latencies and max(poller.latencies) < 1.0, max(poller.latencies)
    assert set(poller.statuses) == {200}
    assert after - before < 100 * 1024 * 1024, (before, after)
    # chunked (no Content-Length): refused once the limit is read
    chunks = (body[i : i + 65536] for i in range(0, 2 * 1024 * 1024, 65536))
    assert _error(httpx.post(url, content=chunks, headers=JSON, timeout=60), 413)["code"] == "request_too_large"
    assert httpx.post(url, json={"model": MODEL_NAME, "prompt": "still", "max_tokens": 1}, timeout=30).status_code == 200


def test_tokenizing_a_long_prompt_does_not_stall_the_loop(checkpoint: Path, hf_model: Any) -> None:
    """A server with a 4 MiB limit tokenizes a 3 MB prompt on its tokenizer thread: /health keeps answering."""
    srv = _server(checkpoint, hf_model, max_body_bytes=4 * 1024 * 1024)
    try:
        prompt = "the quick brown fox jumps over the lazy dog " * (3 * 1024 * 1024 // 44)
        with HealthPoller(srv.url) as poller:
            for endpoint, body in (
                ("completions", {"model": MODEL_NAME, "prompt": prompt}),
                ("chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}]}),
            ):
                error = _error(httpx.post(f"{srv.url}/v1/{endpoint}", json=body, timeout=120), 400)
                assert error["code"] == "context_length_exceeded"
        assert max(poller.latencies) < 1.0, max(poller.latencies)
    finally:
        srv.close()


# ---- points 3 and 7: malformed requests ---------------------------------------------------------


def test_json_depth_scan_and_surrogate_check() -> None:
    assert json_too_deep(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert not json_too_deep(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    assert not json_too_deep(json.dumps({"prompt": "[" * 1000 + '\\"{' * 100}).encode())  # inside a string
    assert not_text({"messages": [{"content": "ok"}, {"content": "\ud800"}]}) == "messages.1.content"
    assert not_text({"prompt": "😀 naïve"}) is None


def _fuzz_cases() -> list[tuple[str, str, bytes, dict[str, str], str | None]]:
    """(name, endpoint, body, headers, expected param) of malformed requests."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    ok_prompt: dict[str, Any] = {"model": MODEL_NAME, "prompt": "the quick brown fox"}
    ok_chat: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}]}

    def with_(base: dict[str, Any], **changes: Any) -> bytes:
        return json.dumps({**base, **changes}).encode()

    cases: list[tuple[str, str, bytes, dict[str, str], str | None]] = []
    for endpoint in (comp, chat):
        cases += [
            ("nested arrays", endpoint, b"[" * 100_000, JSON, None),
            ("nested arrays under the limit", endpoint, b"[" * 60_000, JSON, None),
            ("nested objects", endpoint, b'{"a":' * 100_000, JSON, None),
            ("nested in a field", endpoint, b'{"model": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON, None),
            ("truncated", endpoint, b'{"model": "', JSON, None),
            ("not utf-8", endpoint, b'{"model": "\xff\xfe"}', JSON, None),
            ("null", endpoint, b"null", JSON, None),
            ("string", endpoint, b'"hello"', JSON, None),
            ("empty", endpoint, b"", JSON, None),
            ("form", endpoint, b"model=x&prompt=y", {"Content-Type": "application/x-www-form-urlencoded"}, None),
            ("xml", endpoint, b"<request><model>x</model></request>", {"Content-Type": "application/xml"}, None),
            ("text", endpoint, with_(ok_prompt), {"Content-Type": "text/plain"}, None),
        ]
    cases += [
        ("surrogate prompt", comp, b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL_NAME.encode(), JSON, "prompt"),
        ("surrogate in list", comp, b'{"model": "%s", "prompt": ["\\udfff"]}' % MODEL_NAME.encode(), JSON, "prompt.0"),
        ("surrogate stop", comp, with_(ok_prompt, stop=["\ud800"]), JSON, "stop.0"),
        ("max_tokens true", comp, with_(ok_prompt, max_tokens=True), JSON, "max_tokens"),
        ("max_tokens 0", comp, with_(ok_prompt, max_tokens=0), JSON, "max_tokens"),
        ("max_tokens -3", comp, with_(ok_prompt, max_tokens=-3), JSON, "max_tokens"),
        ("max_tokens 1.5", comp, with_(ok_prompt, max_tokens=1.5), JSON, "max_tokens"),
        ("max_tokens string", comp, with_(ok_prompt, max_tokens="5"), JSON, "max_tokens"),
        ("stream yes", comp, with_(ok_prompt, stream="yes"), JSON, "stream"),
        ("stream 1", comp, with_(ok_prompt, stream=1), JSON, "stream"),
        ("temperature string", comp, with_(ok_prompt, temperature="hot"), JSON, "temperature"),
        ("temperature true", comp, with_(ok_prompt, temperature=True), JSON, "temperature"),
        ("top_p 0", comp, with_(ok_prompt, top_p=0), JSON, "top_p"),
        ("seed huge", comp, with_(ok_prompt, seed=2**70), JSON, "seed"),
        ("n true", comp, with_(ok_prompt, n=True), JSON, "n"),
        ("ignore_eos string", comp, with_(ok_prompt, ignore_eos="1"), JSON, "ignore_eos"),
        ("stop ints", comp, with_(ok_prompt, stop=[1]), JSON, "stop"),
        ("stream_options string", comp, with_(ok_prompt, stream_options="x"), JSON, "stream_options"),
        ("include_usage string", comp, with_(ok_prompt, stream=True, stream_options={"include_usage": "y"}), JSON,
         "stream_options.include_usage"),
        ("prompt number", comp, with_(ok_prompt, prompt=5), JSON, "prompt"),
        ("prompt bools", comp, with_(ok_prompt, prompt=[True, False]), JSON, "prompt"),
        ("prompt empty list", comp, with_(ok_prompt, prompt=[]), JSON, "prompt"),
        ("prompt negative id", comp, with_(ok_prompt, prompt=[-1]), JSON, "prompt"),
        ("prompt mixed batch", comp, with_(ok_prompt, prompt=[[1, 2], "three"]), JSON, "prompt"),
        ("prompt empty", comp, with_(ok_prompt, prompt=""), JSON, "prompt"),
        ("model number", comp, with_(ok_prompt, model=3), JSON, "model"),
        ("no prompt", comp, json.dumps({"model": MODEL_NAME}).encode(), JSON, "prompt"),
        ("surrogate content", chat, b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
         % MODEL_NAME.encode(), JSON, "messages.0.content"),
        ("surrogate part", chat, b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
         b'"text": "\\udc00"}]}]}' % MODEL_NAME.encode(), JSON, "messages.0.content.0.text"),
        ("bogus role", chat, with_(ok_chat, messages=[{"role": "bogus", "content": "x"}]), JSON, "messages.0.role"),
        ("role number", chat, with_(ok_chat, messages=[{"role": 1, "content": "x"}]), JSON, "messages.0.role"),
        ("content number", chat, with_(ok_chat, messages=[{"role": "user", "content": 5}]), JSON,
         "messages.0.content"),
        ("messages empty", chat, with_(ok_chat, messages=[]), JSON, "messages"),
        ("messages string", chat, with_(ok_chat, messages="hi"), JSON, "messages"),
        ("message string", chat, with_(ok_chat, messages=["hi"]), JSON, "messages.0"),
        ("image part", chat, with_(ok_chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), JSON,
         "messages.0.content"),
        ("max_completion_tokens true", chat, with_(ok_chat, max_completion_tokens=True), JSON,
         "max_completion_tokens"),
        ("max_completion_tokens 0", chat, with_(ok_chat, max_completion_tokens=0), JSON, "max_completion_tokens"),
        ("logprobs string", chat, with_(ok_chat, logprobs="yes"), JSON, "logprobs"),
        ("stream string", chat, with_(ok_chat, stream="true"), JSON, "stream"),
    ]
    return cases


def test_fuzz_malformed_requests_get_4xx_openai_errors(server: BackgroundServer) -> None:
    failures = []
    with httpx.Client(timeout=60) as client:
        for name, endpoint, body, headers, param in _fuzz_cases():
            response = client.post(server.url + endpoint, content=body, headers=headers)
            try:
                error = _error(response)
                if param is not None:
                    assert error["param"] == param, error
                    assert error["message"].startswith(param), error
            except (AssertionError, ValueError, KeyError) as exc:
                failures.append(f"{name}: {response.status_code} {response.text[:300]} ({exc})")
    assert not failures, "\n".join(failures)
    # still serving
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "fox", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200, ok.text


def test_status_codes_of_specific_refusals(server: BackgroundServer) -> None:
    url = f"{server.url}/v1/completions"
    form = httpx.post(url, content=b"model=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert _error(form, 415)["code"] == "unsupported_media_type"
    for nested in (b"[" * 60_000, b'{"a":' * 12_000):  # under the body limit: the depth scan refuses them
        assert _error(httpx.post(url, content=nested, headers=JSON), 400)["code"] == "invalid_json"
    error = _error(httpx.post(url, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}), 400)
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    # charset parameters are fine, and a prompt full of brackets is text, not nesting
    good = httpx.post(url, content=json.dumps({"model": MODEL_NAME, "prompt": "[[[{{", "max_tokens": 1}).encode(),
                      headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert good.status_code == 200, good.text
    # valid surrogate pairs (an emoji, JSON-escaped) are text
    emoji = b'{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL_NAME.encode()
    assert httpx.post(url, content=emoji, headers=JSON, timeout=30).status_code == 200
    chat = {"model": MODEL_NAME, "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200


def test_an_oversized_header_gets_a_json_error(server: BackgroundServer) -> None:
    response = httpx.get(f"{server.url}/health", headers={"X-Big": "a" * 10_000}, timeout=10)
    error = _error(response, 400)
    assert error["code"] == "header_too_large"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- point 6: authentication and the header timeout ---------------------------------------------


def test_api_key_guards_v1_and_the_tokenizer_endpoints_only(keyed: BackgroundServer) -> None:
    url = keyed.url
    body = {"model": MODEL_NAME, "prompt": "fox", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer " + API_KEY[:-1]}):
        for response in (httpx.get(f"{url}/v1/models", headers=headers), httpx.post(f"{url}/v1/completions",
                                                                                     json=body, headers=headers),
                         httpx.post(f"{url}/tokenize", json={"prompt": "fox"}, headers=headers),
                         httpx.post(f"{url}/detokenize", json={"tokens": [1]}, headers=headers)):
            error = _error(response, 401)
            assert error["code"] == "invalid_api_key" and API_KEY not in error["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/version").status_code == 200
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{url}/tokenize", json={"prompt": "fox"}, headers=auth).json()["count"] > 0
    assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert client.completions.create(model=MODEL_NAME, prompt="fox", max_tokens=1).usage is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_a_slow_loris_connection_is_closed(server: BackgroundServer) -> None:
    """The server (header timeout 1 s) closes a connection that drips its headers one byte at a time."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        closed_after = None
        while time.monotonic() - start < 10:
            try:
                sock.sendall(b"X")
                sock.settimeout(0.2)
                if sock.recv(4096) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed_after = time.monotonic() - start
                break
        assert closed_after is not None and closed_after < 4.0, closed_after
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- the real ``vexpert serve`` process (point 8, and 1 and 6 there) ------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    from vexpert_runtime.ports import free_port

    tmp = tmp_path_factory.mktemp("node")
    checkpoint = tmp / "tiny"
    build_tiny_checkpoint(checkpoint)
    port = free_port()
    log = tmp / "serve.log"
    env = {**os.environ, "VEXPERT_API_KEY": API_KEY,
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vexpert_runtime", "serve", "--model", str(checkpoint), "--cpu-workers", "1",
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME, "--max-batch-tokens", "64"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 180)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_node_server_refuses_bad_max_tokens_large_prompts_and_missing_keys(
    node: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    url, proc, log = node
    auth = {"Authorization": f"Bearer {API_KEY}"}
    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    assert _error(httpx.get(f"{url}/v1/models", timeout=10), 401)["code"] == "invalid_api_key"
    for max_tokens in (0, -3, True):
        error = _error(httpx.post(comp, json={"model": MODEL_NAME, "prompt": "fox", "max_tokens": max_tokens},
                                  headers=auth, timeout=30), 400)
        assert (error["param"], error["type"]) == ("max_tokens", "invalid_request_error"), error
        error = _error(httpx.post(chat, json={"model": MODEL_NAME, "max_tokens": max_tokens,
                                              "messages": [{"role": "user", "content": "hi"}]},
                                  headers=auth, timeout=30), 400)
        assert error["param"] == "max_tokens", error
    # a field only the rank checks (the vocabulary's range): refused through the node's processes with the field named
    # once (until 2026-12-07 the message came back as "logit_bias: logit_bias: …")
    error = _error(httpx.post(comp, json={"model": MODEL_NAME, "prompt": "fox", "max_tokens": 2,
                                          "logit_bias": {str(10**6): 5}}, headers=auth, timeout=30), 400)
    assert error["param"] == "logit_bias" and error["message"].startswith("logit_bias: token ids must be in [0, "), error
    ok = httpx.post(comp, json={"model": MODEL_NAME, "prompt": "fox", "max_tokens": 2}, headers=auth, timeout=60)
    assert ok.status_code == 200, ok.text
    body = _big_prompt_body()
    before = _rss_bytes(proc.pid)
    with HealthPoller(url) as poller:
        for _ in range(3):
            assert _error(httpx.post(comp, content=body, headers={**JSON, **auth}, timeout=60), 413)
        time.sleep(0.3)
    after = _rss_bytes(proc.pid)
    assert max(poller.latencies) < 1.0, max(poller.latencies)
    assert after - before < 100 * 1024 * 1024, (before, after)
    assert proc.poll() is None, log.read_text()[-3000:]
