"""Prometheus metrics of one node (own registry) and the node's HTTP endpoint.

The endpoint (``runtime.metrics_port``) serves ``GET /metrics`` (Prometheus text; ``/`` too) and
``GET /ready`` for the pod's readiness probe: ``200 ready`` once the node can serve (see
:meth:`NodeMetrics.serve`), else ``503 not ready: <reason>`` in one line. Any other path is a 404.

Names (all prefixed ``vexpert_``): ``balance_ratio{layer}`` (measured: mean/max GPU load, averaged
over the last window), ``static_balance_ratio{layer}`` (what the static placement would have had on
the same tokens), ``vexperts{layer}``, ``bytes_streamed_total``, ``slot_fill_wait_seconds``,
``allocator_seconds``, ``step_seconds``, ``tokens_per_second``, ``pooled_experts`` (Np),
``slot_bytes_per_worker``, ``pool_bytes``,
``allocation_interval`` (k), ``degraded`` (1 while groups run without their vExperts),
``plan_id``, ``dispatch_mode{mode}`` (1 for the replica dispatch the workers run), ``iterations_total``, ``degraded_groups_total``, ``config_reloads_total``,
``config_reload_errors_total``, ``slot_fill_errors_total``, ``fill_loop_restarts_total``,
``worker_gc_seconds_total{generation}`` (the workers' time in Python's cyclic collector) and
``worker_gc_frozen_objects{rank}`` (their startup heaps, frozen before they report ready and on a GPU after iteration 0: :mod:`vexpert_runtime.gc_heap`), and the
operator's tuning inputs:

``balance_decay``
    How much balance an allocation loses before the next one: for each *allocation interval* (the
    consecutive iterations that ran one allocator plan), the relative drop of the layer-mean balance
    ratio from its first to its last iteration, ``(b_first − b_last) / b_first``; the gauge is the
    mean over the last :data:`HISTORY` intervals (signed: noise averages out, the tuner clamps at 0).
    NaN until an interval of the current k has completed (the history restarts when k changes).
``pool_hit_ratio``
    Of the vExperts the allocator would have planned *without* the pool restriction (the same
    allocation run with every expert eligible), the fraction whose expert is in the pinned pool —
    what the allocator wanted vs what Np allowed. Summed over the last :data:`HISTORY` allocations;
    1 when Np = E (every expert is pooled) or nothing was wanted, NaN until the first allocation
    with Np < E (the history restarts when Np changes).
``pinned_memory_pressure``
    (pinned pool bytes + slot bytes in host memory) / ``runtime.host_memory_limit_bytes``; 0 when no
    limit is configured. The bytes are those the start-up limit check counts, so 1 is the most a
    running node can report: on CUDA the slots live in GPU memory and only the pool counts; CPU
    workers keep their slots and base experts in host memory, and both count.

NaN means "no data yet": the operator's parser drops non-finite samples.
"""

from __future__ import annotations

import math
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HISTORY = 8  # allocation intervals / allocations the tuning gauges average over

Readiness = Callable[[], str | None]  # None: ready; else the one-line reason it is not


class NodeMetrics:
    """The node's metrics; :meth:`serve` exposes them (and ``/ready``) over HTTP."""

    def __init__(self, num_layers: int) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.num_layers = num_layers
        self.balance = Gauge("vexpert_balance_ratio", "Measured balance ratio per layer (last window)", ["layer"], registry=reg)
        self.static_balance = Gauge(
            "vexpert_static_balance_ratio", "Balance ratio of the static placement on the same tokens", ["layer"], registry=reg
        )
        self.vexperts = Gauge("vexpert_vexperts", "vExperts per GPU streamed for each layer (current plan)", ["layer"], registry=reg)
        self.bytes_streamed = Counter("vexpert_bytes_streamed_total", "Bytes copied from the L2 pool into L1 slots", registry=reg)
        self.slot_wait = Histogram(
            "vexpert_slot_fill_wait_seconds", "Time a worker waited for its slots per iteration", buckets=_TIME_BUCKETS, registry=reg
        )
        self.allocator_time = Histogram("vexpert_allocator_seconds", "Allocator run time", buckets=_TIME_BUCKETS, registry=reg)
        self.allocations_skipped = Counter(
            "vexpert_allocations_skipped", "Windows not allocated: every layer above the balance threshold, no vExpert "
            "placed (the plan would not change)", registry=reg)
        self.step_time = Histogram("vexpert_step_seconds", "Iteration time (slowest worker)", buckets=_TIME_BUCKETS, registry=reg)
        self.tokens_per_second = Gauge("vexpert_tokens_per_second", "Tokens per second over the last window", registry=reg)
        self.slot_bytes = Gauge("vexpert_slot_bytes_per_worker", "L1 slot memory of one worker (both ping-pong buffers)", registry=reg)
        self.pool_bytes = Gauge("vexpert_pool_bytes", "L2 pool memory on this node", registry=reg)
        self.pooled_experts = Gauge("vexpert_pooled_experts", "Np: experts per layer in the L2 pool", registry=reg)
        self.allocation_interval = Gauge("vexpert_allocation_interval", "k: iterations between allocations", registry=reg)
        self.degraded = Gauge("vexpert_degraded", "1 while groups run without their vExperts (slot fill late, coordinator down)", registry=reg)
        self.plan_id = Gauge("vexpert_plan_id", "Id of the plan the workers run", registry=reg)
        self.dispatch = Gauge(
            "vexpert_dispatch_mode", "1 for the replica dispatch the workers run (plan, local or global)", ["mode"], registry=reg
        )
        self.iterations = Counter("vexpert_iterations_total", "Iterations completed", registry=reg)
        self.degraded_groups = Counter("vexpert_degraded_groups_total", "Groups run on the static placement", registry=reg)
        self.reloads = Counter("vexpert_config_reloads_total", "Config file reloads applied", registry=reg)
        self.reload_errors = Counter("vexpert_config_reload_errors_total", "Config file reloads rejected", registry=reg)
        self.slot_fill_errors = Counter(
            "vexpert_slot_fill_errors_total", "Fill loops that failed (their coordinator exited and was restarted)", registry=reg
        )
        self.graphed_steps = Counter(
            "vexpert_graphed_steps_total",
            "Worker decode steps run as a replay of the worker's captured CUDA graph (summed over workers)",
            registry=reg,
        )
        self.rescued_layers = Counter(
            "vexpert_rescued_layers_total",
            "Layers a worker filled from the checkpoint itself because the coordinator that announced them died",
            registry=reg,
        )
        self.worker_gc_seconds = Counter(
            "vexpert_worker_gc_seconds", "Seconds the workers spent in Python's cyclic garbage collector (summed over "
            "workers; one worker's pause stalls its EP group)", ["generation"], registry=reg,
        )
        self.worker_gc_frozen = Gauge(
            "vexpert_worker_gc_frozen_objects", "Objects of a worker's startup heap frozen out of the collector's reach "
            "(0 until its first iteration reports)", ["rank"], registry=reg,
        )
        self.fill_loop_restarts = Counter(
            "vexpert_fill_loop_restarts_total", "Times the coordinator's slot fill loop died and was restarted", registry=reg
        )
        self.coordinator_restarts = Counter(
            "vexpert_coordinator_restarts_total", "Times the coordinator process died and was restarted", registry=reg
        )
        self.coordinator_up = Gauge(
            "vexpert_coordinator_up", "1 while a coordinator process is attached (streaming vExperts into the slots)", registry=reg
        )
        self.balance_decay = Gauge(
            "vexpert_balance_decay",
            "Mean relative drop of the balance ratio from the first to the last iteration of an allocation interval",
            registry=reg,
        )
        self.pool_hit_ratio = Gauge(
            "vexpert_pool_hit_ratio",
            "Fraction of the vExperts the allocator wanted (unrestricted by the pool) whose expert is pinned",
            registry=reg,
        )
        self.pinned_memory_pressure = Gauge(
            "vexpert_pinned_memory_pressure", "(pinned pool + host slot bytes) / host memory limit (0: no limit)", registry=reg
        )
        self.balance_decay.set(math.nan)
        self.pool_hit_ratio.set(math.nan)
        self.pinned_memory_pressure.set(0.0)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def set_layers(self, gauge: Gauge, values: list[float]) -> None:
        for layer, value in enumerate(values):
            gauge.labels(layer=str(layer)).set(value)

    def app(self, readiness: Readiness | None = None) -> Callable[..., Iterable[bytes]]:
        """The WSGI app: ``/metrics`` (and ``/``) Prometheus, ``/ready`` from ``readiness``, else 404."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "") or "/"
            if path in ("/metrics", "/"):
                result: Iterable[bytes] = metrics_app(environ, start_response)
                return result
            if path == "/ready":
                try:
                    reason = readiness() if readiness is not None else None
                except Exception as exc:  # a probe must answer, never raise
                    reason = f"readiness check failed: {exc!r}"
                if reason is None:
                    status, body = "200 OK", "ready\n"
                else:
                    status, body = "503 Service Unavailable", "not ready: " + " ".join(reason.split()) + "\n"
            else:
                status, body = "404 Not Found", "not found: serving /metrics and /ready\n"
            data = body.encode()
            start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))])
            return [data]

        return app

    def serve(self, port: int, addr: str = "0.0.0.0", readiness: Readiness | None = None) -> int:
        """Start the HTTP endpoint in a daemon thread; returns the bound port (``port=0`` picks a free
        one). ``readiness`` answers ``/ready``: None = ready, a string = why not (503)."""
        server_class = _ThreadingServer6 if ":" in addr else _ThreadingServer
        server = make_server(addr, port, self.app(readiness), server_class, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                                  name="vexpert-metrics")
        thread.start()
        self._server, self._thread = server, thread
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Tuning inputs
# ---------------------------------------------------------------------------------------------


class BalanceDecay:
    """Relative balance drop over allocation intervals, from per-iteration plan ids and balances
    that arrive separately and in any order (the workers' reports vs the all-reduced windows).

    An interval is a maximal run of consecutive iterations on one plan; it is complete when the
    next iteration shows another plan, or starts where the allocator kept the plan in effect
    (:meth:`kept`: a window it skipped). Intervals of a single iteration, in progress at a
    :meth:`reset`, or on the static placement (plan 0) that no allocation chose are skipped.
    """

    MAX_PENDING = 4096  # iterations waiting for their other half (bounds memory if one never comes)

    def __init__(self, history: int = HISTORY) -> None:
        self._plans: dict[int, int] = {}
        self._balances: dict[int, float] = {}
        self._next = 0  # first iteration not folded into an interval yet
        self._plan = -1
        self._valid = False  # the interval in progress started at its first iteration
        self._first = self._last = math.nan
        self._length = 0
        self._chosen = False  # the interval in progress runs a plan an allocation chose (or kept)
        self._kept: set[int] = set()  # iterations from which an allocation kept the plan in effect
        self._drops: deque[float] = deque(maxlen=history)

    def plan(self, iteration: int, plan_id: int) -> None:
        if iteration >= self._next:
            self._plans[iteration] = plan_id
            self._advance()

    def balance(self, iteration: int, value: float) -> None:
        if iteration >= self._next:
            self._balances[iteration] = value
            self._advance()

    def kept(self, iteration: int) -> None:
        """The allocator kept the plan in effect (it skipped a window) from ``iteration`` on: a new
        interval starts there, counted even on the static placement."""
        if iteration >= self._next:
            self._kept.add(iteration)
            self._advance()

    def reset(self) -> None:
        """Forget the completed intervals and the one in progress (k changed: they had another length)."""
        self._drops.clear()
        self._valid = False

    @property
    def value(self) -> float:
        """Mean relative drop over the last intervals (NaN without one)."""
        return sum(self._drops) / len(self._drops) if self._drops else math.nan

    @property
    def intervals(self) -> int:
        return len(self._drops)

    def _advance(self) -> None:
        while self._next in self._plans and self._next in self._balances:
            plan, value = self._plans.pop(self._next), self._balances.pop(self._next)
            kept = self._next in self._kept
            if plan != self._plan or kept:
                self._kept.discard(self._next)
                self._close()
                self._plan, self._first, self._length, self._valid = plan, value, 0, True
                self._chosen = plan > 0 or kept
            self._last = value
            self._length += 1
            self._next += 1
        if len(self._plans) > self.MAX_PENDING or len(self._balances) > self.MAX_PENDING:
            self._next = max(self._plans.keys() | self._balances.keys()) + 1
            self._plans.clear()
            self._balances.clear()
            self._kept.clear()
            self._valid = False

    def _close(self) -> None:
        if self._valid and self._chosen and self._length >= 2 and self._first > 0:
            self._drops.append((self._first - self._last) / self._first)


class PoolHits:
    """Wanted vs pooled vExperts over the last allocations (see ``vexpert_pool_hit_ratio``)."""

    def __init__(self, history: int = HISTORY) -> None:
        self._counts: deque[tuple[int, int]] = deque(maxlen=history)

    def add(self, hits: int, wanted: int) -> None:
        if not 0 <= hits <= wanted:
            raise ValueError(f"hits {hits} must be within 0..wanted {wanted}")
        self._counts.append((hits, wanted))

    def reset(self) -> None:
        self._counts.clear()

    @property
    def value(self) -> float:
        """Σ hits / Σ wanted (1 when nothing was wanted, NaN before any allocation)."""
        if not self._counts:
            return math.nan
        wanted = sum(w for _, w in self._counts)
        return sum(h for h, _ in self._counts) / wanted if wanted else 1.0


def memory_pressure(pinned_bytes: int, limit_bytes: int | None) -> float:
    """``pinned / limit``; 0 without a (positive) limit."""
    return pinned_bytes / limit_bytes if limit_bytes else 0.0
