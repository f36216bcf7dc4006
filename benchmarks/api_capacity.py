"""The API process's host cost per request and per streamed token: what bounds ``vexpert serve`` at
hundreds of streams once the GPU step is fast.

On one H200 at 256 closed-loop streams (issue #21, run 18) the server's own time to first token —
from a request's arrival at the API to its first token sent — was 200–600 ms while the rank's queue
stayed empty: requests wait in the API process (one Python process, one GIL: the aiohttp loop,
the tokenizer thread, the thread that reads the ranks' events). This measures that process alone,
driven as in production: the product's :class:`~vexpert_runtime.serve.api.ServeApi` and
:class:`~vexpert_runtime.serve.api.ApiServer` over a
:class:`~vexpert_runtime.serve.multirank.MultiRankDispatcher`, the checkpoint's tokenizer, and a
rank process that speaks the rank's protocol through the product's own
:class:`~vexpert_runtime.serve.rank.ServingRank` methods (queueing, acceptances, batched events,
load reports) over the product's :class:`~vexpert_runtime.serve.scheduler.Scheduler`, whose model
computes nothing (``serve_host_cost.HostOnlyStepModel``) and is paced to one iteration every
``--tick-ms`` (a GPU step). The load is ``serve_load``'s closed-loop streaming clients.

Printed per run: tokens/s and requests/s taken, the API process's CPU seconds per request
(``api_cpu_ms_per_request``: everything it does for one request of ``--max-tokens`` tokens, divided
by the requests served) and its CPU share (near 1: it is the limit), and with ``--profile`` its
top functions (cProfile of the API process, µs per request).

    python benchmarks/api_capacity.py --streams 64 --tick-ms 3 --duration 12 --warmup 3
    python benchmarks/api_capacity.py --streams 64 --tick-ms 3 --profile

Results: ``results/api_capacity_cpu.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_host_cost import HostOnlyStepModel
from serve_load import load_processes, scrape

from vexpert_runtime.ports import free_port
from vexpert_runtime.serve.demo_model import ensure_demo_model


def rank_process(requests: Any, events: Any, model_dir: str, tick_s: float, streams: int, stream_interval: int = 1) -> None:
    """A rank: the product's message handling and scheduler, a model that computes nothing, one
    iteration per ``tick_s`` (an idle rank waits for requests as the serving loop does)."""
    from transformers import AutoTokenizer

    from vexpert_runtime.serve.dispatcher import RankCapacity
    from vexpert_runtime.serve.rank import ServingRank
    from vexpert_runtime.serve.sampling import eos_token_ids
    from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=max(512, 2 * streams), max_running=streams,
                             max_waiting=2 * streams, stream_interval=stream_interval)
    model = HostOnlyStepModel(len(tokenizer), 2048, config.max_batch_tokens, streams, streams * 10 + 2)
    # ServingRank's constructor loads a checkpoint; its queue / event / load methods need only these fields
    rank = ServingRank.__new__(ServingRank)
    rank.args = argparse.Namespace(requests=requests, events=events)  # type: ignore[assignment]
    rank.rank, rank.world = 0, 1
    rank.scheduler = Scheduler(model, tokenizer, replace(config, max_waiting=config.max_running + config.max_waiting),
                               eos_token_ids(tokenizer))
    rank._init_outboxes(events)
    events.put(RankCapacity(0, config.max_running, config.max_waiting))
    next_at = time.perf_counter()
    while True:
        rank.take_requests(timeout_s=0.0 if rank.has_work() else 0.05)
        if not rank.has_work():
            rank.report_load()
            next_at = time.perf_counter()
            continue
        rank.scheduler.run_iteration()
        rank.flush_events(with_load=True)  # as ServingRank.run_iteration: one message an iteration
        next_at += tick_s
        time.sleep(max(0.0, next_at - time.perf_counter()))


def api_process(port: int, requests: Any, events: Any, model_dir: str, profile_out: str | None) -> None:
    """The API process as ``vexpert serve`` builds it (one rank), optionally under cProfile."""
    from transformers import AutoTokenizer

    from vexpert_runtime.serve.api import ApiConfig, ServeApi, run_server
    from vexpert_runtime.serve.multirank import MultiRankDispatcher

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    dispatcher = MultiRankDispatcher([requests], events, 512, lambda: None, lambda: None)
    api = ServeApi(dispatcher, tokenizer, ApiConfig("bench", 2048, len(tokenizer), drain_timeout_s=2.0))
    profiler = cProfile.Profile() if profile_out else None
    if profiler is not None:
        profiler.enable()
    try:
        run_server(api, "127.0.0.1", port)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_out)


def wait_ready(api: Any, url: str, timeout_s: float) -> None:
    """Until ``url``/health answers 200 (the rank reported its capacity); raise if the API process died."""
    import urllib.error
    import urllib.request

    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if not api.is_alive():
            raise RuntimeError(f"the API process exited with code {api.exitcode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health not ready after {timeout_s} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def top_functions(path: str, requests: int, top: int = 25) -> list[tuple[str, float, float]]:
    """(function, cumulative µs per request, own µs per request), by own time."""
    stats = pstats.Stats(path)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    return [(f"{Path(f).name}:{line} {name}", round(ct / requests * 1e6, 1), round(tt / requests * 1e6, 1))
            for (f, line, name), (_, _, tt, ct, _) in rows]


def run(args: argparse.Namespace, streams: int, model_dir: Path, workdir: Path) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    requests, events = context.Queue(), context.Queue()
    port = free_port()
    profile_out = str(workdir / f"api_{streams}.prof") if args.profile else None
    rank = context.Process(target=rank_process, daemon=True,
                           args=(requests, events, str(model_dir), args.tick_ms / 1e3, streams, args.stream_interval))
    api = context.Process(target=api_process, args=(port, requests, events, str(model_dir), profile_out))
    rank.start()
    api.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(api, url, 120)
        cpu_before = cpu_seconds(api.pid)  # type: ignore[arg-type]
        sampler = None
        if args.pyspy:  # sampling, not tracing: the shares are those of the unprofiled process
            sampler = subprocess.Popen(["bash", "-c", f"sleep {args.warmup}; exec {shutil.which('py-spy') or 'py-spy'} record "
                                        f"--pid {api.pid} --nonblocking --function --threads --rate 200 --format raw "
                                        f"--duration {int(args.pyspy)} -o {workdir / 'api.pyspy.txt'}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wall_before = time.perf_counter()
        result = load_processes(url, "A mixture of experts model sends every token to a few of its experts. " * 4,
                                streams, args.duration, args.warmup, args.max_tokens, args.client_processes)
        api_cpu = cpu_seconds(api.pid) - cpu_before  # type: ignore[arg-type]
        wall = time.perf_counter() - wall_before
        served = scrape(url).get("vexpert_serve_request_duration_seconds_count", 0.0)
        if sampler is not None:
            sampler.wait(60)
    finally:
        os.kill(api.pid, signal.SIGTERM)  # type: ignore[arg-type]
        api.join(30)
        rank.terminate()
        rank.join(10)
    served = max(served, 1.0)
    result.update({"streams": streams, "stream_interval": args.stream_interval, "tick_ms": args.tick_ms,
                   "offered_tokens_per_s": round(streams / args.tick_ms * 1e3),
                   "api_cpu_share": round(api_cpu / wall, 2), "api_cpu_ms_per_request": round(api_cpu / served * 1e3, 3),
                   "requests_served": int(served)})
    if args.pyspy:
        from serve_engine import summarise_host_profile

        result["api_pyspy"] = summarise_host_profile(workdir / "api.pyspy.txt", top=25)
    if profile_out:
        result["api_top_functions_us_per_request"] = top_functions(profile_out, int(served))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[64])
    parser.add_argument("--tick-ms", type=float, default=3.0, help="the rank's iteration time (a GPU step)")
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--stream-interval", type=int, default=1, help="vexpert serve --stream-interval")
    parser.add_argument("--profile", action="store_true", help="cProfile the API process (slower)")
    parser.add_argument("--pyspy", type=float, default=0.0, help="seconds of py-spy sampling of the API process")
    parser.add_argument("--out", type=Path, help="append the results as JSON lines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vexpert-api-capacity-") as tmp:
        model_dir = ensure_demo_model(Path(tempfile.gettempdir()) / "vexpert-demo-model")
        for streams in args.streams:
            result = run(args, streams, model_dir, Path(tmp))
            print(json.dumps(result), flush=True)
            if args.out:
                with args.out.open("a") as out:
                    out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
