"""The node runtime (supervisor, allocator, coordinator handle) in a process of its own beside the API
process of ``vexpert serve``.

Why a process: the supervisor handles every worker's report of every iteration and runs the allocator
every k iterations; on one H200 at 256 streams (a 2 ms step) it took 30 % of the API process's samples
(benchmarks/README.md §10, run 19), and the API process — one interpreter, one GIL for the HTTP loop,
tokenization and the ranks' events — was what bounded throughput. With 8 ranks per node the
supervisor's share grows eightfold. The ranks' request and event queues do not pass through this
process: the API process talks to the ranks directly, and to the node only for what is the node's —

- readiness: pushed here whenever it changes (:class:`NodeStatus`), read by ``/health`` and the
  dispatcher without a round trip;
- metrics: the node's Prometheus exposition on request (:class:`RenderMetrics` → :class:`NodeMetricsText`),
  appended to the API's own on ``/metrics``;
- stop: :class:`StopNode` once the drain is over;
- failure: :class:`NodeFailed` (or the process's exit code, when it dies without a word) fails every
  request in flight and stops the server, as before.

The node process dies with the API process (``PR_SET_PDEATHSIG``) and its own children die with it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vexpert_runtime.gc_heap import freeze_heap
from vexpert_runtime.node.processes import exit_line, ignore_stop_signals, stop_signals_held

READINESS_POLL_S = 0.05  # how often the node process looks whether its readiness changed
METRICS_TIMEOUT_S = 5.0  # a node that does not render its metrics in this long is left out of /metrics
STOP_TIMEOUT_S = 60.0  # the node's own drain: its workers finish the iteration they run, then exit
STARTING = "starting the node process"


# -- messages: API process → node process -------------------------------------------------------


@dataclass(frozen=True)
class RenderMetrics:
    """Send the node's Prometheus exposition (answered by :class:`NodeMetricsText` of ``seq``)."""

    seq: int


@dataclass(frozen=True)
class StopNode:
    """Stop at the next iteration boundary (the drain is over)."""


# -- messages: node process → API process -------------------------------------------------------


@dataclass(frozen=True)
class NodeStatus:
    """The node's readiness changed: None = it serves, else why not (one line)."""

    readiness: str | None


@dataclass(frozen=True)
class NodeMetricsText:
    """The node's Prometheus exposition (text format 0.0.4), the answer to :class:`RenderMetrics` ``seq``."""

    seq: int
    text: bytes


@dataclass(frozen=True)
class NodeFailed:
    """The node runtime raised: the process exits 1 after this."""

    error: str


# -- the node process ---------------------------------------------------------------------------


def node_process_main(setup: Any, options: Any, conn: Any, parent_pid: int) -> None:
    """Entry point of the node process: run :class:`~vexpert_runtime.node.NodeRuntime` until stopped.

    ``setup``/``options``: the node's :class:`~vexpert_runtime.node.NodeSetup` and
    :class:`~vexpert_runtime.node.NodeOptions` (pickled at spawn, the ranks' queues with them);
    ``conn``: this end of the pipe to the API process."""
    from vexpert_runtime.node import NodeRuntime
    from vexpert_runtime.node.coordinator import die_with_parent

    ignore_stop_signals()  # a group's Ctrl-C / SIGTERM is the API process's: it drains, then stops this one
    die_with_parent(parent_pid)
    runtime = NodeRuntime(setup, options)
    freeze_heap()  # torch, the allocator, the checkpoint's index: out of the collector's reach (gc_heap)
    send_lock = threading.Lock()

    def send(msg: Any) -> None:
        with send_lock, contextlib.suppress(OSError, ValueError):
            conn.send(msg)

    finished = threading.Event()
    commands = threading.Thread(target=_serve_commands, args=(runtime, conn, send, finished),
                                name="vexpert-node-commands", daemon=True)
    commands.start()
    try:
        runtime.run()
    except BaseException as exc:  # the node is down: the API process fails what runs and stops
        send(NodeFailed(str(exc) or type(exc).__name__))
        raise SystemExit(1) from None
    finally:
        finished.set()
        commands.join(timeout=1.0)
        conn.close()


def _serve_commands(runtime: Any, conn: Any, send: Callable[[Any], None], finished: threading.Event) -> None:
    """Answer the API process's commands and push readiness changes until the runtime returns."""
    from prometheus_client import generate_latest

    last: object = object()  # what was sent last (nothing yet)
    while not finished.is_set():
        readiness = runtime.readiness()
        if readiness != last:
            send(NodeStatus(readiness))
            last = readiness
        try:
            if not conn.poll(READINESS_POLL_S):
                continue
            msg = conn.recv()
        except (EOFError, OSError):  # the API process is gone: stop (its death also kills this one)
            runtime.request_stop()
            return
        if isinstance(msg, RenderMetrics):
            send(NodeMetricsText(msg.seq, generate_latest(runtime.metrics.registry)))
        elif isinstance(msg, StopNode):
            runtime.request_stop()


# -- the API process's side ---------------------------------------------------------------------


class SharedNodeStatus:
    """The node's readiness and failure, in shared memory: the first API server's :class:`NodeProcess`
    writes them, every API server reads them (``--api-servers``: pickled at spawn)."""

    SIZE = 2048  # bytes of the reason kept (UTF-8, cut at a character)

    def __init__(self, ctx: Any) -> None:
        self._text = ctx.Array("c", self.SIZE)
        self._failed = ctx.Value("b", 0, lock=False)  # written under the text's lock
        self.set(STARTING)

    def set(self, readiness: str | None, failed: bool = False) -> None:
        """The node's readiness now (None: it serves); with ``failed``, ``readiness`` is its failure
        (kept from then on)."""
        raw = (readiness or "").encode()[: self.SIZE - 1].decode(errors="ignore").encode()
        with self._text.get_lock():
            if not self._failed.value:
                self._text.value = raw
                self._failed.value = int(failed)

    def readiness(self) -> str | None:
        """Why the node cannot take requests now (None: it can)."""
        with self._text.get_lock():
            raw, failed = self._text.value, self._failed.value
        text = raw.decode(errors="replace")
        return f"node failed: {text}" if failed else (text or None)

    def failure(self) -> str | None:
        """The node's failure (None while it has not failed)."""
        with self._text.get_lock():
            raw, failed = self._text.value, self._failed.value
        return raw.decode(errors="replace") if failed else None


class NodeProcess:
    """The node process, seen from the API process: start it, read its readiness and metrics, stop it.

    ``on_failure(message)`` runs (on the reader thread) once when the node fails — it raised, or its
    process died — and not when it stops because it was asked to; ``on_ready()`` once, when the node first
    takes requests."""

    def __init__(self, ctx: Any, setup: Any, options: Any, on_failure: Callable[[str], None],
                 on_ready: Callable[[], None] | None = None) -> None:
        self.on_failure = on_failure
        self.on_ready = on_ready  # once, when the node first takes requests (before /health says so)
        self.status = SharedNodeStatus(ctx)  # readiness and failure, where the other API servers read them too
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=node_process_main, args=(setup, options, child, os.getpid()),
                                 name="vexpert-node")
        self._child_conn = child
        self._send_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._metrics: queue.Queue[NodeMetricsText] = queue.Queue()
        self._seq = itertools.count(1)
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="vexpert-node-reader", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self) -> None:
        with stop_signals_held():  # Ctrl-C, systemd's SIGTERM reach the whole group: the API process handles them
            self._proc.start()
        self._child_conn.close()  # the child holds its end: EOF here once it exits
        self._reader.start()

    def readiness(self) -> str | None:
        """Why the node cannot take requests now (None: it can)."""
        return self.status.readiness()

    @property
    def failure(self) -> str | None:
        """Why the node failed (None: it has not)."""
        return self.status.failure()

    def metrics_text(self) -> bytes:
        """The node's Prometheus exposition; empty when the node is not running or does not answer
        within ``METRICS_TIMEOUT_S`` (``/metrics`` still shows the API's own series)."""
        if not self._proc.is_alive():
            return b""
        with self._metrics_lock:
            seq = next(self._seq)
            if not self._send(RenderMetrics(seq)):
                return b""
            try:
                while True:
                    reply = self._metrics.get(timeout=METRICS_TIMEOUT_S)
                    if reply.seq == seq:  # an older one arrived after its caller gave up
                        return reply.text
            except queue.Empty:
                return b""

    def request_stop(self) -> None:
        """Stop the node at its next iteration boundary (called once the drain is over)."""
        self._stopping = True
        self._send(StopNode())

    def stop(self) -> None:
        """Stop the node and wait for its process (kill it if it does not exit in time: it ignores SIGTERM)."""
        self.request_stop()
        self._proc.join(timeout=STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._reader.join(timeout=2.0)
        self._conn.close()

    # -- internals ----------------------------------------------------------------------------

    def _send(self, msg: Any) -> bool:
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the node process is gone (or the pipe closed)
                return False
        return True

    def _read(self) -> None:
        failure: str | None = None
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, NodeStatus):
                if msg.readiness is None and self.on_ready is not None:
                    self.on_ready()
                    self.on_ready = None
                self.status.set(msg.readiness)
            elif isinstance(msg, NodeMetricsText):
                self._metrics.put(msg)
            elif isinstance(msg, NodeFailed):
                failure = msg.error
        self._proc.join(timeout=10.0)
        code = self._proc.exitcode
        if failure is None and code not in (0, None):
            failure = exit_line(self._proc)
        elif failure is None and code == 0 and not self._stopping:
            failure = "the node process exited"
        if failure is not None:
            self.status.set(failure, failed=True)
            self.on_failure(failure)

