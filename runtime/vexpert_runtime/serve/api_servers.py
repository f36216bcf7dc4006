"""More API server processes on the first one's port (``vexpert serve --api-servers N``, as vLLM's
``--api-server-count``).

One API process is one interpreter: its event loop, its tokenizer and the reader of the ranks'
events share one GIL, and at hundreds of streams that process, not the GPU, bounded throughput
(benchmarks/README.md §10, run 19). Servers 1..N-1 are processes like server 0 without the node:
each binds the same host and port with ``SO_REUSEPORT`` (the kernel spreads connections over them),
tokenizes its own requests, sends them to the ranks' queues stamped with its index (``reply_to``) and
reads its own events queue (the ranks send each request's events to its server, their loads to
all). Server 0 owns the node process; the others read its readiness and failure from shared memory
(:class:`~vexpert_runtime.node.runtime_process.SharedNodeStatus`). ``/metrics`` on any server counts
all of them (:mod:`.metrics_share`).

Stopping: server 0 forwards its SIGTERM / SIGINT to the others, each drains its own requests, and
server 0 stops the node once they have exited. If the node fails, every server fails its requests
and exits; if a server dies, server 0 stops the whole server (exit 1: the pod restarts).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vexpert_runtime.node.runtime_process import SharedNodeStatus
    from vexpert_runtime.serve.api import ApiConfig

log = logging.getLogger(__name__)

WATCH_S = 0.1  # how often a server looks whether the node failed (and server 0 whether a server died)


@dataclass
class ApiServerArgs:
    """What API server ``index`` (≥ 1) needs (pickled at spawn)."""

    index: int
    host: str
    port: int
    model_dir: str
    api_config: ApiConfig
    requests: list[Any]  # the ranks' inbound queues
    events: Any  # this server's events queue
    max_waiting: int
    node_status: SharedNodeStatus
    metrics_dir: str
    parent_pid: int
    prefix_block_size: int | None = None  # cache-aware routing over the ranks (prefix caching); None: off


def api_server_main(args: ApiServerArgs) -> None:
    """Entry point of API server ``args.index``: serve until SIGTERM / SIGINT; exit 1 if the node failed."""
    from transformers import AutoTokenizer

    from vexpert_runtime.node.coordinator import die_with_parent
    from vexpert_runtime.node.processes import TERMINAL_INTERRUPT, ignore_stop_signals
    from vexpert_runtime.serve.api import ServeApi, configure_logging, run_server
    from vexpert_runtime.serve.metrics_share import MetricsShare
    from vexpert_runtime.serve.multirank import MultiRankDispatcher

    configure_logging()
    # SIGTERM stays: it drains this server (run_server), whether server 0 forwards it or it reached the group
    ignore_stop_signals(TERMINAL_INTERRUPT)  # until run_server handles it: a Ctrl-C while importing is no traceback
    die_with_parent(args.parent_pid)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    # server 0 stops the node once every server drained: nothing to do here when this one has
    dispatcher = MultiRankDispatcher(args.requests, args.events, args.max_waiting, args.node_status.readiness,
                                     on_drained=lambda: None, reply_to=args.index,
                                     prefix_block_size=args.prefix_block_size)
    threading.Thread(target=_watch_node, args=(args.node_status, dispatcher.fail_all), name="vexpert-node-watch",
                     daemon=True).start()
    api = ServeApi(dispatcher, tokenizer, args.api_config, metrics_share=MetricsShare(args.metrics_dir, args.index))
    try:
        run_server(api, args.host, args.port, reuse_port=True, announce=False)
    finally:
        dispatcher.close()
    if args.node_status.failure() is not None:
        sys.exit(1)


def _watch_node(status: SharedNodeStatus, fail_requests: Callable[[str], None]) -> None:
    """When the node fails: end this server's requests with the failure, then stop this server."""
    while (failure := status.failure()) is None:
        time.sleep(WATCH_S)
    fail_requests(f"the node failed: {failure}")
    os.kill(os.getpid(), signal.SIGTERM)


class ApiServers:
    """Servers 1..N-1, seen from server 0: start them, forward the stop, wait for them, and call
    ``on_death(line)`` once if one exits while they should be serving."""

    def __init__(self, ctx: Any, args: list[ApiServerArgs], on_death: Callable[[str], None]) -> None:
        self.procs = [ctx.Process(target=api_server_main, args=(a,), name=f"vexpert-api-{a.index}") for a in args]
        self.on_death = on_death
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="vexpert-api-watch", daemon=True)

    def start(self) -> None:
        from vexpert_runtime.node.processes import TERMINAL_INTERRUPT, stop_signals_held

        with stop_signals_held(TERMINAL_INTERRUPT):  # each handles SIGINT once it serves (and server 0 forwards it)
            for proc in self.procs:
                proc.start()
        self._watcher.start()

    def expect_exit(self) -> None:
        """The servers exit on their own now (the node failed): not a death to report."""
        self._stopping.set()

    def stop(self) -> None:
        """Forward the stop (SIGTERM: each drains its requests)."""
        self._stopping.set()
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    def join(self, timeout_s: float) -> None:
        """Wait for every server to exit (SIGKILL what is left after ``timeout_s``)."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("%s did not stop in %.0f s: killed", proc.name, timeout_s)
                proc.kill()
                proc.join()

    def _watch(self) -> None:
        from vexpert_runtime.node.processes import exit_line

        while not self._stopping.wait(WATCH_S):
            for proc in self.procs:
                if proc.exitcode is not None:
                    if not self._stopping.is_set():
                        self.on_death(exit_line(proc))
                    return
