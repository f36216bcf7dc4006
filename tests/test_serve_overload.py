"""Issue 22, points 4–6, against a real ``vexpert serve`` process (2 CPU EP ranks, the tiny
Qwen3-MoE made here): overload is answered 429 + Retry-After before any stream starts (streaming
and not), a killed worker fails what runs at once with a clean 503 and the server exits non-zero,
and the single-node rendezvous listens on loopback only."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
aiohttp = pytest.importorskip("aiohttp")

from serve_process import child_pids, descendant_pids, start_cpu_serve  # noqa: E402

INTERNAL = ("/__w/", ".cc:", ".py", "Traceback", "gloo", "pytorch")


def _serve(tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    return start_cpu_serve(tmp, "--max-batch-tokens", "64", *extra)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _one(session: aiohttp.ClientSession, url: str, stream: bool, i: int) -> tuple[int, str | None, str]:
    body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 24, "stream": stream, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        text = await resp.text()
        return resp.status, resp.headers.get("Retry-After"), text


def test_overload_is_429_with_retry_after_before_any_stream_and_the_rendezvous_is_loopback(tmp_path: Path) -> None:
    proc, url, log = _serve(tmp_path, "--max-running", "2", "--max-waiting", "1")
    try:
        # the rendezvous store and gloo pairs of this single-node group: nothing beyond loopback but the API
        listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout.splitlines()
        ours = {str(proc.pid), *map(str, descendant_pids(proc.pid))}  # the workers are the node process's children
        wide = [line for line in listening if any(f"pid={p}," in line for p in ours)
                and not line.split()[3].startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:"))]
        if wide:  # torch's TCPStore binds the wildcard address: reported, not hidden
            print("listening beyond loopback:", *wide, sep="\n")

        async def burst() -> list[tuple[int, str | None, str]]:
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await asyncio.gather(*(_one(session, url, i % 2 == 0, i) for i in range(40)))

        started = time.monotonic()
        results = asyncio.run(burst())
        elapsed = time.monotonic() - started
        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 429}, [(s, t[:200]) for s, _, t in results if s not in (200, 429)]
        refused = [(retry, text) for status, retry, text in results if status == 429]
        assert refused, statuses  # 2 ranks × (2 running + 1 waiting) cannot hold 40
        assert all(retry is not None and int(retry) >= 1 for retry, _ in refused)
        for _, text in refused:
            assert json.loads(text)["error"]["code"] == "overloaded", text
        served = [text for status, _, text in results if status == 200]
        assert len(served) >= 6, statuses  # at least the capacity of the two ranks
        for i, (status, _, text) in enumerate(results):
            if status == 200 and i % 2 == 0:  # a served stream ends normally, with no error chunk
                assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
        print(f"40 concurrent: {len(served)} × 200, {len(refused)} × 429 in {elapsed:.1f} s")
        # after the burst the server serves again
        status, _, _ = asyncio.run(_single(url))
        assert status == 200
        # n choices through the EP ranks: more than one rank holds (2 running + 1 waiting), each choice
        # what a request with seed + i gives
        body = {"model": "tiny", "prompt": "request n", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        choices = _post(url, {**body, "n": 4, "seed": 3})["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert [c["text"] for c in choices] == [_post(url, {**body, "seed": 3 + i})["choices"][0]["text"]
                                                for i in range(4)]
        # log-probabilities through the EP ranks: the log-softmax of transformers' logits at each greedy token
        logprobs = _post(url, {**body, "temperature": 0, "logprobs": 2})["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"] == pytest.approx(_greedy_logprobs(tmp_path / "ckpt", "request n", 6), abs=1e-3)
        assert all(max(top.values()) == pytest.approx(lp, abs=1e-6)  # greedy: the most likely token
                   for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True))
        # the prompt's log-probabilities (echo) through the EP ranks: transformers' log-softmax at each prompt token
        echoed = _post(url, {**body, "temperature": 0, "echo": True, "logprobs": 1, "max_tokens": 2})["choices"][0]
        assert echoed["text"].startswith("request n") and echoed["logprobs"]["token_logprobs"][0] is None
        prompt_lps = echoed["logprobs"]["token_logprobs"][1:-2]
        assert prompt_lps == pytest.approx(_prompt_logprobs(tmp_path / "ckpt", "request n"), abs=1e-3)
        # penalties in the EP ranks' graphs-free CPU step: transformers' greedy with its repetition_penalty
        penalized = _post(url, {**body, "temperature": 0, "repetition_penalty": 1.5, "max_tokens": 10})
        assert penalized["choices"][0]["text"] == _greedy_text(tmp_path / "ckpt", "request n", 10, repetition_penalty=1.5)
        # and a logit bias (transformers' sequence_bias of single tokens): ban two tokens, favour one
        bias = {5: -100.0, 6: -100.0, 40: 4.0}
        biased = _post(url, {**body, "temperature": 0, "max_tokens": 10, "logit_bias": {str(t): v for t, v in bias.items()}})
        assert biased["choices"][0]["text"] == _greedy_text(tmp_path / "ckpt", "request n", 10,
                                                            sequence_bias={(t,): v for t, v in bias.items()})
        # min_tokens: EOS, favoured by a logit bias, only after 4 tokens (the bias row rewritten then)
        eos = _reference(tmp_path / "ckpt")[1].eos_token_id
        forced = {**body, "temperature": 0, "max_tokens": 10, "ignore_eos": False, "logit_bias": {str(eos): 100}}
        assert _post(url, forced)["usage"]["completion_tokens"] == 1
        held = _post(url, {**forced, "min_tokens": 4})
        assert (held["choices"][0]["finish_reason"], held["usage"]["completion_tokens"]) == ("stop", 5)
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


@functools.cache
def _reference(checkpoint: Path) -> tuple[Any, Any]:
    """transformers' model (float32) and tokenizer of the served checkpoint, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32),
            AutoTokenizer.from_pretrained(str(checkpoint)))


def _greedy_logprobs(checkpoint: Path, prompt: str, tokens: int) -> list[float]:
    """transformers' greedy continuation of ``prompt``: each token's log-probability."""
    import torch

    model, tokenizer = _reference(checkpoint)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                             output_logits=True, return_dict_in_generate=True)
    return [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in
            zip(out.logits, out.sequences[0, len(ids):].tolist(), strict=True)]


def _greedy_text(checkpoint: Path, prompt: str, tokens: int, **processors: Any) -> str:
    """transformers' greedy continuation of ``prompt`` with ``processors`` (its generate arguments), as text."""
    import torch

    model, tokenizer = _reference(checkpoint)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                             **processors)
    return str(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))


def _prompt_logprobs(checkpoint: Path, prompt: str) -> list[float]:
    """transformers' log-probability of each prompt token after the first, given the tokens before it."""
    import torch

    model, tokenizer = _reference(checkpoint)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return [float(logp[p, t]) for p, t in enumerate(ids[1:])]


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


async def _single(url: str) -> tuple[int, str | None, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await _one(session, url, False, 0)


def test_a_killed_worker_fails_requests_with_a_clean_503_and_the_server_exits(tmp_path: Path) -> None:
    proc, url, log = _serve(tmp_path, "--max-running", "8")
    try:
        children = descendant_pids(proc.pid)
        spawned = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(spawned) >= 4, spawned  # the node process, its coordinator and 2 workers (one is the victim)

        async def main() -> tuple[list[tuple[int, str]], float, list[int]]:
            timeout = aiohttp.ClientTimeout(total=90)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                body = {"model": "tiny", "prompt": "go", "max_tokens": 240, "ignore_eos": True}
                tasks = [asyncio.create_task(session.post(url + "/v1/completions", json={**body, "stream": False}))
                         for _ in range(3)]
                streamed = await session.post(url + "/v1/completions", json={**body, "stream": True})
                first = await streamed.content.readline()  # a stream runs: the node dies mid-request
                victim = _worker_pids(proc.pid)[0]  # the workers start before the coordinator
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                rest = (await streamed.content.read()).decode()
                outcomes = [(streamed.status, first.decode() + rest)]
                for task in tasks:
                    resp = await task
                    outcomes.append((resp.status, await resp.text()))
                waited = time.monotonic() - killed
                later = []
                for _ in range(3):  # new requests while the node is down: 503, or the server is gone already
                    try:
                        async with session.post(url + "/v1/completions", json=body) as resp:
                            later.append(resp.status)
                            assert resp.status != 503 or resp.headers.get("Retry-After"), resp.headers
                    except aiohttp.ClientError:
                        later.append(0)
                return outcomes, waited, later

        started = time.monotonic()
        outcomes, waited, later = asyncio.run(main())
        assert waited < 30, waited  # no hang
        stream_status, stream_text = outcomes[0]  # killed mid-stream: the 200 stream ends with a 503 error object
        assert stream_status == 200 and '"code": "aborted"' in stream_text and "node failed" in stream_text, stream_text
        for status, text in outcomes:
            # non-streaming: 503 (or done before the kill: 200 with its whole result)
            assert status == 503 or (status == 200 and ("node failed" in text or '"finish_reason": "length"' in text)), text
            errors = [line for line in text.splitlines() if '"error"' in line]  # (generated text is random bytes)
            assert not any(mark in line for line in errors for mark in INTERNAL), errors
        assert all(code in (0, 503) for code in later), later
        assert proc.wait(60) == 1, log.read_text()[-3000:]
        time.sleep(0.5)  # nothing of the node is left: the other worker, the coordinator (reaped or gone)
        alive = [pid for pid in children if Path(f"/proc/{pid}").exists()
                 and "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])]
        assert not alive, alive
        print(f"killed worker: requests failed after {waited:.1f} s, exit 1 after {time.monotonic() - started:.1f} s,"
              f" later requests {later}")
    finally:  # a failed check must not leave the server running (its children die with it)
        if proc.poll() is None:
            proc.kill()


def _spawned(pid: int) -> list[int]:
    """``pid``'s children that multiprocessing spawned (not the resource tracker), oldest first."""
    return [p for p in child_pids(pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _worker_pids(pid: int) -> list[int]:
    """The server's node process spawns the workers, then the coordinator."""
    (node,) = _spawned(pid)
    return _spawned(node)
