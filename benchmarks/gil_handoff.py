"""What a busy event loop costs the API process's other threads: the GIL hand-off.

The API process of ``vexpert serve`` runs its aiohttp event loop beside a tokenizer thread and a
thread that reads the ranks' events from a pipe. A thread that released the GIL (for the pipe's read,
or inside the tokenizer's Rust code) gets it back only when the holder releases it — a busy loop does
so every ``sys.getswitchinterval()`` (5 ms by default). This measures, with the event loop kept busy
by Python work in short slices (as when it writes hundreds of streams), the wall time of

* ``tokenize``: one prompt through the product's ``ServeApi`` tokenizer path — on its tokenizer
  thread (``_off_loop``, long prompts) and inline on the loop (short prompts);
* ``event``: one message from another process through a ``multiprocessing`` queue to a reader thread
  that hands it to the loop (``call_soon_threadsafe``), as ``MultiRankDispatcher`` does;

at the default switch interval and at ``API_SWITCH_INTERVAL_S``, which ``run_server`` sets.

    .venv/bin/python benchmarks/gil_handoff.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vexpert_runtime.serve.api import API_SWITCH_INTERVAL_S, ApiConfig, ServeApi
from vexpert_runtime.serve.demo_model import ensure_demo_model

PROMPT = "A mixture of experts model sends every token to a few of its many expert networks. " * 4


def _sender(queue: Any, count: int, period_s: float) -> None:
    for _ in range(count):
        queue.put(time.perf_counter())
        time.sleep(period_s)


async def _busy(stop: asyncio.Event, slice_s: float) -> None:
    """Keep the loop busy with pure-Python work, yielding every ``slice_s`` (a loop serving streams)."""
    while not stop.is_set():
        end = time.perf_counter() + slice_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


async def measure(api: ServeApi, samples: int, slice_s: float, limit_s: float) -> dict[str, Any]:
    stop = asyncio.Event()
    busy = asyncio.ensure_future(_busy(stop, slice_s))
    loop = asyncio.get_running_loop()
    off_loop, inline = [], []
    for _ in range(samples):
        start = time.perf_counter()
        # a starved thread may take seconds: counted at the limit (the job itself cannot be cancelled)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(api.prompts.off_loop(api.prompts.prompt_ids, PROMPT), limit_s)
        off_loop.append(time.perf_counter() - start)
        start = time.perf_counter()
        api.prompts.prompt_ids(PROMPT)
        inline.append(time.perf_counter() - start)
        await asyncio.sleep(0)
    # events: another process sends timestamps; a reader thread blocks on the queue and hands each to the loop
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    delays: list[float] = []

    def read() -> None:
        for _ in range(samples):
            sent = queue.get()
            loop.call_soon_threadsafe(lambda sent=sent: delays.append(time.perf_counter() - sent))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sender = context.Process(target=_sender, args=(queue, samples, 0.002), daemon=True)
    sender.start()
    deadline = time.perf_counter() + limit_s * 2
    while len(delays) < samples and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    stop.set()
    await busy
    sender.join(5)

    def ms(values: list[float], q: float) -> float | None:
        return round(1000 * sorted(values)[int(q * (len(values) - 1))], 3) if values else None

    return {"tokenize_off_loop_ms_p50": ms(off_loop, 0.5), "tokenize_off_loop_ms_p90": ms(off_loop, 0.9),
            "tokenize_off_loop_ms_max": ms(off_loop, 1.0), "tokenize_inline_ms_p50": ms(inline, 0.5),
            "tokenize_inline_ms_max": ms(inline, 1.0),
            "events_delivered": len(delays), "events_sent": samples,
            "event_to_loop_ms_p50": ms(delays, 0.5), "event_to_loop_ms_p90": ms(delays, 0.9),
            "event_to_loop_ms_max": ms(delays, 1.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--limit-s", type=float, default=5.0, help="the longest wait counted for one sample")
    parser.add_argument("--slice-ms", type=float, default=1.0, help="the busy loop's work between yields")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = ensure_demo_model(Path(tempfile.gettempdir()) / "vexpert-demo-model")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    api = ServeApi(None, tokenizer, ApiConfig("bench", 2048, len(tokenizer)))  # type: ignore[arg-type]
    default = sys.getswitchinterval()
    for interval in (default, API_SWITCH_INTERVAL_S):
        sys.setswitchinterval(interval)
        result = asyncio.run(measure(api, args.samples, args.slice_ms / 1e3, args.limit_s))
        print(json.dumps({"switch_interval_ms": interval * 1e3, "busy_slice_ms": args.slice_ms,
                          "prompt_chars": len(PROMPT), **result}), flush=True)
    api.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
