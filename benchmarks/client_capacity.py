"""How many streamed tokens/s the benchmark's own load generator can take (``serve_load.load_processes``).

A minimal aiohttp server (a subprocess) stands in for ``vexpert serve``: one "iteration" every ``--tick-ms``
emits one token chunk to every open stream, so it offers ``streams / tick`` tokens/s; the load generator runs
as in ``serve_engine.py`` (closed-loop streaming clients, ``--client-processes``). Printed: tokens/s taken,
and the CPU share of the client process(es) and of the fake server.

    .venv/bin/python benchmarks/client_capacity.py --streams 256 --client-processes 1
    .venv/bin/python benchmarks/client_capacity.py --streams 256 --client-processes 1 --pool-limit 100   # aiohttp's default pool

Results on the 2-core CI kind of machine: ``results/client_capacity.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import load_processes

from vexpert_runtime.ports import free_port


def fake_server(port: int, tick_s: float) -> None:
    from aiohttp import web

    streams: set[asyncio.Queue[int]] = set()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        queue: asyncio.Queue[int] = asyncio.Queue()
        streams.add(queue)
        try:
            for _ in range(body["max_tokens"]):
                await queue.get()
                chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": " tok", "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"id": "x", "choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": 60}}
            await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            streams.discard(queue)
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        while True:
            await asyncio.sleep(tick_s)
            for queue in list(streams):
                queue.put_nowait(1)

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--tick-ms", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--pool-limit", type=int, default=0, help="aiohttp connection pool size (0: unbounded)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "TICK_S"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        fake_server(int(args.serve[0]), float(args.serve[1]))
        return
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(args.tick_ms / 1000)])
    time.sleep(2)
    try:
        client0, server0, start = time.process_time(), cpu_seconds(server.pid), time.perf_counter()
        result = load_processes(f"http://127.0.0.1:{port}", "hello", args.streams, args.duration, args.warmup, 64,
                                args.client_processes, pool_limit=args.pool_limit)
        wall = time.perf_counter() - start
        print(json.dumps({"streams": args.streams, "client_processes": args.client_processes, "pool_limit": args.pool_limit,
                          "offered_tokens_per_s": round(args.streams / (args.tick_ms / 1000)),
                          "tokens_per_s": result["tokens_per_s"], "itl_ms_mean": result["itl_ms_mean"],
                          "client_cpu_share": round((time.process_time() - client0) / wall, 2),  # this process only
                          "server_cpu_share": round((cpu_seconds(server.pid) - server0) / wall, 2)}))
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
