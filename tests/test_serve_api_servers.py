"""``vexpert serve --api-servers 2`` as a process (2 CPU EP ranks, the tiny Qwen3-MoE made here): two
API server processes listen on one port, both serve requests, each request's tokens come back to the
server that took it (greedy outputs equal across servers and ranks, with ``--prefix-caching`` reusing the
prompts' shared blocks), ``/metrics`` on either counts both, SIGTERM
drains both and leaves no process; a killed worker fails the requests on every server and the server
exits 1. A shared port needs a fixed one: ``--port 0`` is refused."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers")
aiohttp = pytest.importorskip("aiohttp")

from serve_process import child_pids, descendant_pids, start_cpu_serve  # noqa: E402

REQUESTS = 48
TOKENS = 12


def _serve(tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    # several /health answers in a row: each server is up (the kernel spreads the connections)
    return start_cpu_serve(tmp, "--api-servers", "2", *extra, healthy_in_a_row=8)


def _listeners(port: int) -> set[int]:
    """Pids of the processes listening on ``port``."""
    lines = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return {int(pid) for pid in re.findall(r"pid=(\d+)", lines)}


def _both_listening(proc: subprocess.Popen[bytes], url: str, log: Path) -> set[int]:
    """The two servers' pids, once both listen (the second may bind after the first is healthy)."""
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while len(listeners := _listeners(port)) < 2:
        assert time.monotonic() < deadline, (listeners, log.read_text()[-3000:])
        time.sleep(0.3)
    assert len(listeners) == 2 and proc.pid in listeners, (listeners, proc.pid)
    return listeners


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, str, str | None]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        text, reason = "", None
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
        return resp.status, text, reason


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_two_api_servers_share_the_port_serve_both_count_both_and_stop_together(tmp_path: Path) -> None:
    proc, url, log = _serve(tmp_path, "--prefix-caching")  # and the prompts share whole blocks
    try:
        listeners = _both_listening(proc, url, log)
        (other,) = listeners - {proc.pid}
        before = {pid: _cpu_s(pid) for pid in listeners}

        async def load() -> list[tuple[int, str, str | None]]:
            # a connection per request: the kernel spreads connections, not requests, over the servers
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                prompts = ["the quick brown fox jumps over the lazy dog " * 5 + f"{i % 4}" for i in range(REQUESTS)]
                return list(await asyncio.gather(*(_stream(session, url, p) for p in prompts)))

        results = asyncio.run(load())
        used = {pid: _cpu_s(pid) - before[pid] for pid in listeners}
        assert all(status == 200 and reason == "length" for status, _, reason in results), results[:3]
        by_prompt: dict[int, set[str]] = {}
        for i, (_, text, _) in enumerate(results):
            by_prompt.setdefault(i % 4, set()).add(text)
        # greedy: the same on either server and rank, whether the prompt's blocks were cached there or not
        assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
        assert min(used.values()) > 0.15 * sum(used.values()), used  # both servers took requests
        # whichever server a scrape reaches counts both (the other's counts at most a second old: each scrape
        # may reach the other server, so every name waits); each server's own, summed once: not twice. vLLM's
        # names (an inference gateway's): the same counts, summed over both servers too
        for name, expected in (("vexpert_serve_request_finish_total", REQUESTS),
                               ("vexpert_serve_generated_tokens_total", REQUESTS * TOKENS),
                               ("vllm:generation_tokens_total", REQUESTS * TOKENS),
                               ("vllm:request_success_total", REQUESTS)):
            deadline = time.monotonic() + 10
            while (counted := _metric(url, name)) != expected:
                assert counted < expected and time.monotonic() < deadline, (name, counted)
                time.sleep(0.3)
        for _ in range(6):  # on either server: the node's series too
            assert _metric(url, "vexpert_iterations_total") > 0
        # return_token_ids from worker processes (the ids cross the rank → API pipe beside the events' rows)
        body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": TOKENS, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
        choice = answer["choices"][0]
        assert len(choice["token_ids"]) == TOKENS and len(choice["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
        request = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            chunks = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                      if line.startswith("data: {")]
        assert [t for chunk in chunks for c in chunk["choices"] for t in c["token_ids"]] == choice["token_ids"]
        # the usage names the prompt tokens the prefix cache served (OpenAI's prompt_tokens_details): a prompt of the
        # load above, whole 16-token blocks of it (the detail crosses the rank → API pipe on the last event)
        cached = {**body, "prompt": "the quick brown fox jumps over the lazy dog " * 5 + "1", "return_token_ids": False}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(cached).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            usage = json.loads(resp.read())["usage"]
        hit = usage["prompt_tokens_details"]["cached_tokens"]
        assert hit % 16 == 0 and 16 <= hit < usage["prompt_tokens"], usage
        # the same prompt with a cache_salt (vLLM's) shares no cached block with it: none served from the cache
        request = urllib.request.Request(url + "/v1/completions", json.dumps({**cached, "cache_salt": "tenant-b"}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # 4 prompts over 2 ranks: after each rank's first of each, the prompts' whole blocks come from the
        # cache (2944 of 3072 tokens here; prompts admitted in one iteration may still both compute)
        queried = _metric(url, "vexpert_serve_prefix_cache_queried_tokens")
        assert _metric(url, "vexpert_serve_prefix_cache_hit_tokens") >= queried / 2 > 0
        processes = descendant_pids(proc.pid)
        assert other in processes
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, log.read_text()[-3000:]
    time.sleep(0.5)
    assert not _alive(processes), _alive(processes)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_a_killed_worker_fails_the_requests_of_every_api_server_and_the_server_exits_1(tmp_path: Path) -> None:
    proc, url, log = _serve(tmp_path, "--max-running", "8")
    try:
        listeners = _both_listening(proc, url, log)
        (node,) = [pid for pid in child_pids(proc.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and pid not in listeners]
        worker = child_pids(node)[0]  # the node process spawns the workers first

        async def main() -> list[tuple[int, str]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=90)) as session:
                body = {"model": "tiny", "prompt": "go", "max_tokens": 240, "ignore_eos": True, "stream": True}
                streams = [await session.post(url + "/v1/completions", json=body) for _ in range(8)]
                firsts = [await stream.content.readline() for stream in streams]  # all 8 run (both servers)
                os.kill(worker, signal.SIGKILL)
                return [(stream.status, first.decode() + (await stream.content.read()).decode())
                        for stream, first in zip(streams, firsts, strict=True)]

        started = time.monotonic()
        outcomes = asyncio.run(main())
        waited = time.monotonic() - started
        assert waited < 40, waited  # no request waits for the drain timeout
        # each stream ends with the abort error object naming the node's failure, on either server
        assert all(status == 200 and '"code": "aborted"' in text and "node failed" in text
                   for status, text in outcomes), [text[-300:] for _, text in outcomes]
        assert proc.wait(60) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
