"""``vexpert serve`` as a process, for the tests that run the whole server: a 2-rank CPU server on the
tiny Qwen3-MoE of :mod:`serve_support`, and the processes it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from serve_support import build_tiny_checkpoint
from vexpert_runtime.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def start_cpu_serve(tmp: Path, *extra: str, healthy_in_a_row: int = 1,
                    timeout_s: float = 180.0) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``vexpert serve`` (2 CPU EP ranks, model id "tiny", 127.0.0.1, a free port, ``extra`` flags; its
    own session), once ``/health`` answered 200 ``healthy_in_a_row`` times in a row (several API
    servers: each connection may reach another); (process, base URL, its log)."""
    checkpoint = tmp / "ckpt"
    build_tiny_checkpoint(checkpoint, "qwen3_moe")
    config = tmp / "runtime.yaml"
    config.write_text(json.dumps({  # JSON is YAML; no master_port: the node picks a free loopback one
        "model": {"dtype": "float32"},  # the checkpoint named as vLLM users do: `vexpert serve PATH`
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0, "slot_fill_timeout_s": 30.0},
    }))
    port = free_port()
    log = tmp / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vexpert_runtime", "serve", str(checkpoint), "--config", str(config), "--host", "127.0.0.1",
         "--port", str(port), "--served-model-name", "tiny", *extra],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    healthy = 0
    while healthy < healthy_in_a_row:
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError(f"vexpert serve not healthy within {timeout_s:.0f} s (exit {proc.poll()}):\n"
                                 + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                healthy = healthy + 1 if resp.status == 200 else 0
        except OSError:
            healthy = 0
            time.sleep(0.5)
    return proc, url, log


def child_pids(pid: int) -> list[int]:
    """``pid``'s children, by pid."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def descendant_pids(pid: int) -> list[int]:
    """Every descendant of ``pid``, generation by generation."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in child_pids(parent)]
        found += frontier
    return found
