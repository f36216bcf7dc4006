"""Priority scheduling under a saturated rank: what ``--scheduling-policy priority`` buys an urgent request.

``vexpert serve`` itself (the embedded demo model, CPU workers) is started once per policy with a small batch
(``--max-running``) — and with ``--servers vexpert vllm`` vLLM's CPU build too (``--vllm-python``; vLLM's
``--scheduling-policy`` and ``--max-num-seqs``), both on the side-by-side benchmark's tiny Qwen3-MoE
(``cpu_serve_compare.py``'s, built once under ``--work``) —, and loaded with ``--streams`` closed-loop streaming
completions (``priority`` 0,
``ignore_eos``, ``--max-tokens`` each) — more than the batch holds, so requests queue. Beside them a prober sends
one short streaming request at a time (``--probe-tokens``), ``priority`` −1 under ``priority`` and 0 (the only value
``fcfs`` accepts) under ``fcfs``: the same load, the same requests, only the order differs. Reported per policy: the
probes' time to first token and latency, and the background's tokens/s and time to first token — what the urgent
requests gain and what the others pay for it.

    python benchmarks/priority_scheduling.py --out benchmarks/results/priority_scheduling_cpu.json
    python benchmarks/priority_scheduling.py --servers vexpert vllm --out benchmarks/results/priority_scheduling_vllm_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from vexpert_runtime.ports import free_port  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from cpu_serve_compare import MODEL_NAME, build_checkpoint, stop_server, wait_healthy  # noqa: E402

PROMPT = "A mixture of experts model sends every token to a few of its many expert networks, and the busiest"


async def stream_request(session: Any, url: str, max_tokens: int, priority: int) -> tuple[float, float, int]:
    """One streaming completion: (time to first text, total time, completion tokens)."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "priority": priority, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return (first or end) - sent, end - sent, tokens


async def load(url: str, args: argparse.Namespace, probe_priority: int) -> dict[str, Any]:
    """The background streams and the prober for ``args.duration`` s, the first ``args.warmup`` not counted."""
    import aiohttp

    start = time.perf_counter()
    stop_at, count_from = start + args.duration, start + args.warmup
    background: list[tuple[float, float, int]] = []
    probes: list[tuple[float, float, int]] = []

    async def background_client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop_at:
            sent = time.perf_counter()
            sample = await stream_request(session, url, args.max_tokens, 0)
            if sent >= count_from:
                background.append(sample)

    async def prober(session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(args.warmup)
        while time.perf_counter() < stop_at:
            probes.append(await stream_request(session, url, args.probe_tokens, probe_priority))
            await asyncio.sleep(args.probe_gap)

    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(prober(session), *(background_client(session) for _ in range(args.streams)))
    measured = time.perf_counter() - count_from

    def pct(values: list[float], q: float) -> float | None:
        return round(1000 * sorted(values)[int(q * (len(values) - 1))], 1) if values else None

    return {
        "probes": len(probes), "probe_priority": probe_priority,
        "probe_ttft_ms_p50": pct([p[0] for p in probes], 0.5), "probe_ttft_ms_p90": pct([p[0] for p in probes], 0.9),
        "probe_latency_ms_p50": pct([p[1] for p in probes], 0.5),
        "probe_latency_ms_p90": pct([p[1] for p in probes], 0.9),
        "background_requests": len(background),
        "background_tokens_per_s": round(sum(b[2] for b in background) / measured, 1),
        "background_ttft_ms_p50": pct([b[0] for b in background], 0.5),
        "background_ttft_ms_p90": pct([b[0] for b in background], 0.9),
        "background_ttft_ms_mean": round(1000 * statistics.fmean(b[0] for b in background), 1) if background else None,
    }


def server_command(server: str, policy: str, port: int, model: Path | None, args: argparse.Namespace
                   ) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``server`` (vexpert, vllm) scheduling by ``policy``."""
    if server == "vllm":
        assert model is not None
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_running),
                "--scheduling-policy", policy], env
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "vexpert_runtime", "serve", "--port", str(port), "--cpu-workers", str(args.cpu_workers),
           "--max-running", str(args.max_running), "--max-waiting", str(4 * args.streams), "--served-model-name",
           MODEL_NAME, "--scheduling-policy", policy, "--drain-timeout", "5"]
    return cmd + (["--model", str(model)] if model is not None else []), env


def run_policy(server: str, policy: str, model: Path | None, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Start ``server`` with ``--scheduling-policy policy``, load it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(server, policy, port, model, args)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, log, 300)
        return {"server": server, "policy": policy, **asyncio.run(load(url, args, -1 if policy == "priority" else 0))}
    finally:
        stop_server(proc, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file the rows are written to")
    parser.add_argument("--policies", nargs="+", default=["fcfs", "priority"], choices=["fcfs", "priority"])
    parser.add_argument("--servers", nargs="+", default=["vexpert"], choices=["vexpert", "vllm"],
                        help="vllm (or more than one): every server on cpu_serve_compare.py's tiny Qwen3-MoE")
    parser.add_argument("--vllm-python", type=Path, default=Path("/work/vllm-venv/bin/python"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/vexpert-cpu-compare"), help="where the checkpoint is")
    parser.add_argument("--checkpoint", choices=["demo", "qwen3"], default=None,
                        help="demo: vexpert's embedded model; qwen3: cpu_serve_compare.py's tiny Qwen3-MoE (default: "
                             "qwen3 where vLLM runs, else demo)")
    parser.add_argument("--cpu-workers", type=int, default=1)
    parser.add_argument("--max-running", type=int, default=8, help="the batch: fewer than --streams, so requests queue")
    parser.add_argument("--streams", type=int, default=24, help="background closed-loop streams (priority 0)")
    parser.add_argument("--max-tokens", type=int, default=32, help="each background request's tokens")
    parser.add_argument("--probe-tokens", type=int, default=4, help="each probe's tokens")
    parser.add_argument("--probe-gap", type=float, default=0.2, help="seconds between a probe's end and the next")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=1, help="policies run in turn this many times (interleaved)")
    args = parser.parse_args(argv)
    rows = []
    checkpoint = args.checkpoint or ("demo" if args.servers == ["vexpert"] else "qwen3")
    if checkpoint == "demo" and "vllm" in args.servers:
        parser.error("--checkpoint demo: vLLM cannot load vexpert's embedded model; use qwen3")
    model = build_checkpoint(args.work / "model") if checkpoint == "qwen3" else None
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for server in args.servers:
                for policy in args.policies:
                    log = Path(tmp) / f"{server}_{policy}_{round_}.log"
                    row = {"round": round_ + 1, **run_policy(server, policy, model, args, log)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "settings": settings,
                                    "command": "python benchmarks/priority_scheduling.py " + " ".join(argv or sys.argv[1:]),
                                    "rows": rows}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
