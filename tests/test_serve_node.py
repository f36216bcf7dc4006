"""``vexpert serve`` itself, as a process: a node (coordinator + 2 CPU EP workers, slots, allocator)
behind the OpenAI API, on tiny random Qwen3-MoE and DeepSeek-V3 checkpoints made here.

Greedy outputs equal the unmodified transformers model's while the allocator has put vExperts into
the slots and the coordinator streamed them; the official ``openai`` client works for completions,
chat and streaming; 16 concurrent streams complete; bad requests get OpenAI errors and the server
keeps answering; SIGTERM lets in-flight requests finish and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from serve_support import build_tiny_checkpoint, load_model, load_tokenizer  # noqa: E402
from vexpert_runtime.ports import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "hello world, how are", "experts are routed per token", "once upon a time",
           "naïve café", "the router picks"]
NEW_TOKENS = 8


def _config(path: Path, checkpoint: Path) -> Path:
    """float32 CPU node, 2 ranks, an allocation every 2 iterations for any imbalance, and a fast host
    link in the cost model, so vExperts are placed and streamed within a few requests."""
    raw = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.99},
        "tuning": {"allocation_interval": 2},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0, "slot_fill_timeout_s": 30.0},
        "profile": {"hardware": {"h2d_bandwidth_gb_per_s": 5000.0, "contention_eta": 0.0}},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, checkpoint: Path, log: Path) -> None:
        self.proc, self.port, self.checkpoint, self.log = proc, port, checkpoint, log
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def post(self, path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def client(self) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _start(tmp: Path, family: str, overlap_steps: str = "auto") -> Server:
    checkpoint = tmp / family
    build_tiny_checkpoint(checkpoint, family)
    config = _config(tmp / f"{family}.yaml", checkpoint)
    port = free_port()
    log = tmp / f"{family}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vexpert_runtime", "serve", "--config", str(config), "--port", str(port),
         "--served-model-name", "tiny", "--max-batch-tokens", "64", "--max-running", "16", "--drain-timeout", "20",
         "--overlap-steps", overlap_steps],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp,
        start_new_session=True,  # a process group of its own, as a terminal gives it (Ctrl-C reaches all of it)
    )
    server = Server(proc, port, checkpoint, log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if server.get("/health")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("server not healthy within 180 s:\n" + log.read_text()[-3000:])


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()


# DeepSeek-V3's server runs overlapped steps on CPU: the protocol CUDA graphs use on a GPU (the scheduler
# launches step i+1 before reading step i, fed decodes, the worker reports i after i+1 is enqueued).
@pytest.fixture(scope="module", params=[("qwen3_moe", "auto"), ("deepseek_v3", "on")], ids=["qwen3_moe", "deepseek_v3-overlapped"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    family, overlap_steps = request.param
    srv = _start(tmp_path_factory.mktemp(family), family, overlap_steps)
    yield srv
    _stop(srv)


def _reference_texts(checkpoint: Path) -> list[str]:
    tokenizer, model = load_tokenizer(checkpoint), load_model(checkpoint)
    model.generation_config.eos_token_id = None  # as the requests' ignore_eos: EOS is a token like any other
    texts = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))  # as the server decodes
    return texts


async def _complete_all(server: Server, rounds: int) -> list[list[str]]:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(prompt: str) -> str:
        out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
        return out.choices[0].text

    results = []
    for _ in range(rounds):  # concurrent: both ranks run batches of several sequences
        results.append(list(await asyncio.gather(*(one(p) for p in PROMPTS))))
    await client.close()
    return results


def test_greedy_outputs_equal_transformers_while_vexperts_stream(server: Server) -> None:
    expected = _reference_texts(server.checkpoint)
    rounds = asyncio.run(_complete_all(server, rounds=6))
    for got in rounds:
        assert got == expected
    # the allocator placed vExperts and the coordinator streamed them while those requests ran
    assert server.metric("vexpert_bytes_streamed_total") > 0, server.log.read_text()[-2000:]
    assert server.metric("vexpert_plan_id") > 0
    assert server.metric("vexpert_serve_requests_total") >= 6 * len(PROMPTS)


def test_openai_client_completions_chat_and_streaming(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage is not None


def test_anthropic_messages_and_stop_reasons_cross_the_ranks(server: Server) -> None:
    """Through the node's ranks (events pickled between processes): Anthropic's client gets the chat completion's
    text as a message, and a stop string that ends a reply comes back as vLLM's ``stop_reason`` and as Anthropic's
    ``stop_sequence``."""
    import anthropic

    client = server.client()
    messages: Any = [{"role": "user", "content": "hi"}]
    greedy = {"temperature": 0, "ignore_eos": True}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, extra_body={"ignore_eos": True},
                                           temperature=0).choices[0]
    message = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60).messages.create(
        model="tiny", max_tokens=12, messages=messages, extra_body=greedy)
    assert message.content[0].text == whole.message.content and message.stop_reason == "max_tokens"  # type: ignore[union-attr]
    text = whole.message.content or ""
    stop = text[3:6]
    assert len(stop) == 3, text
    stopped = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                             stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert (stopped.message.content, stopped.model_extra["stop_reason"]) == (text[: text.index(stop)], stop)  # type: ignore[index]
    anthropic_stop = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
        model="tiny", max_tokens=12, messages=messages, extra_body=greedy, stop_sequences=[stop])
    assert (anthropic_stop.stop_reason, anthropic_stop.stop_sequence) == ("stop_sequence", stop)


def test_sixteen_concurrent_streams_complete(server: Server) -> None:
    async def stream(i: int) -> tuple[str, str | None]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        text, reason = "", None
        async for chunk in await client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=12,
                                                           stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        await client.close()
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        return list(await asyncio.gather(*(stream(i) for i in range(16))))

    results = asyncio.run(main())
    assert len(results) == 16 and all(reason == "length" for _, reason in results)


def test_every_serving_process_froze_its_startup_heap_and_reports_its_gc_time(server: Server) -> None:
    """The API process once it listens and each worker before it reported ready moved their startup heaps
    (tokenizer, model, torch's own objects: hundreds of thousands) out of the collector's reach
    (gc_heap), and /metrics reports the time they spend collecting what remains."""
    done = server.client().completions.create(model="tiny", prompt="hello", max_tokens=3,
                                              extra_body={"ignore_eos": True})  # iterations that report
    assert done.usage is not None and done.usage.completion_tokens == 3
    _, text = server.get("/metrics")
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["vexpert_serve_api_gc_frozen_objects"] > 50_000
    for rank in (0, 1):
        assert samples[f'vexpert_worker_gc_frozen_objects{{rank="{rank}"}}'] > 50_000
    for generation in (0, 1, 2):
        assert samples[f'vexpert_serve_api_gc_seconds_total{{generation="{generation}"}}'] >= 0.0
    assert samples['vexpert_worker_gc_seconds_total{generation="2"}'] > 0.0  # the freeze's own full collection, at least


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: Server) -> None:
    status, body = server.post("/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = server.post("/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": "word " * 400, "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3
    assert server.get("/health")[0] == 200


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_first_iteration_at_start_then_ctrl_c_finishes_in_flight_requests_and_leaves_no_process(
        tmp_path: Path) -> None:
    """Every rank runs iteration 0 at once, an empty lockstep step (on a GPU it captures the CUDA
    graphs and compiles the fused pieces there, not when the first request comes); after it an
    idle server runs no iterations. Then a terminal's Ctrl-C — SIGINT to the whole process group,
    workers and coordinator included — with requests in flight: they finish their tokens, the
    server exits 0 without a traceback (or a leak report of
    Triton's bindings) and nothing of the node is left (a child that took the
    SIGINT used to die with a KeyboardInterrupt and fail the node). SIGTERM to the server alone
    (Kubernetes) drains the same way: the module's fixture stops with it. (One server for both
    checks: a start costs ~28 s of CPU here.)"""
    server = _start(tmp_path, "qwen3_moe")
    children = _children(server.proc.pid)
    assert len(children) >= 3  # coordinator + 2 workers (and the resource tracker)
    deadline = time.monotonic() + 60
    while server.metric("vexpert_iterations_total") < 1:
        assert time.monotonic() < deadline, server.log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    assert server.metric("vexpert_iterations_total") == 1  # idle: nothing more without requests

    async def main() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def stream(i: int) -> str | None:
            reason = None
            async for chunk in await client.completions.create(model="tiny", prompt=f"go {i}", max_tokens=40,
                                                               stream=True, extra_body={"ignore_eos": True}):
                reason = chunk.choices[0].finish_reason or reason
            return reason

        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        await asyncio.sleep(1.0)  # requests are running
        os.killpg(server.proc.pid, signal.SIGINT)
        return list(await asyncio.gather(*tasks))

    reasons = asyncio.run(main())
    assert reasons == ["length"] * 4  # drained: every in-flight request finished its tokens
    assert server.proc.wait(60) == 0, server.log.read_text()[-3000:]
    log = server.log.read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "failed" not in log, log[-3000:]
    assert "leaked" not in log, log[-3000:]  # the frozen heaps are thawed at exit (gc_heap)
    time.sleep(0.5)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists()
             and "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])]
    assert not alive, alive


