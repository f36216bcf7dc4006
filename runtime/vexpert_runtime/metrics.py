"""Prometheus metrics of one node (own registry, one HTTP endpoint per node).

Names (all prefixed ``vexpert_``): ``balance_ratio{layer}`` (measured: mean/max GPU load, averaged
over the last window), ``static_balance_ratio{layer}`` (what the static placement would have had on
the same tokens), ``vexperts{layer}``, ``bytes_streamed_total``, ``slot_fill_wait_seconds``,
``allocator_seconds``, ``step_seconds``, ``tokens_per_second``, ``pooled_experts`` (Np),
``slot_bytes_per_worker``, ``pool_bytes``,
``allocation_interval`` (k), ``degraded`` (1 while groups run without their vExperts),
``plan_id``, ``iterations_total``, ``degraded_groups_total``, ``config_reloads_total``,
``config_reload_errors_total``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class NodeMetrics:
    """The node's metrics; :meth:`serve` exposes them over HTTP."""

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
        self.step_time = Histogram("vexpert_step_seconds", "Iteration time (slowest worker)", buckets=_TIME_BUCKETS, registry=reg)
        self.tokens_per_second = Gauge("vexpert_tokens_per_second", "Tokens per second over the last window", registry=reg)
        self.slot_bytes = Gauge("vexpert_slot_bytes_per_worker", "L1 slot memory of one worker (both ping-pong buffers)", registry=reg)
        self.pool_bytes = Gauge("vexpert_pool_bytes", "L2 pool memory on this node", registry=reg)
        self.pooled_experts = Gauge("vexpert_pooled_experts", "Np: experts per layer in the L2 pool", registry=reg)
        self.allocation_interval = Gauge("vexpert_allocation_interval", "k: iterations between allocations", registry=reg)
        self.degraded = Gauge("vexpert_degraded", "1 while groups run without their vExperts (slot fill late)", registry=reg)
        self.plan_id = Gauge("vexpert_plan_id", "Id of the plan the workers run", registry=reg)
        self.iterations = Counter("vexpert_iterations_total", "Iterations completed", registry=reg)
        self.degraded_groups = Counter("vexpert_degraded_groups_total", "Groups run on the static placement", registry=reg)
        self.reloads = Counter("vexpert_config_reloads_total", "Config file reloads applied", registry=reg)
        self.reload_errors = Counter("vexpert_config_reload_errors_total", "Config file reloads rejected", registry=reg)
        self._server: Any = None
        self._thread: Any = None

    def set_layers(self, gauge: Gauge, values: list[float]) -> None:
        for layer, value in enumerate(values):
            gauge.labels(layer=str(layer)).set(value)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint; returns the bound port (``port=0`` picks a free one)."""
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        bound: int = self._server.server_port
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def render(self) -> str:
        return generate_latest(self.registry).decode()
