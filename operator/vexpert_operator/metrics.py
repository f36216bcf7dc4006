"""Operator metrics (prometheus-client), in a registry of their own."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter("vexpert_operator_reconciles_total", "Deployment reconciles", ["trigger"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("vexpert_operator_reconcile_errors_total", "Reconciles that raised", ["kind"],
                           registry=REGISTRY)
RECONCILE_SECONDS = Histogram("vexpert_operator_reconcile_duration_seconds", "Time of one reconcile",
                              registry=REGISTRY, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
CALIBRATION_JOBS = Counter("vexpert_operator_calibration_jobs_total", "Calibration Jobs by kind and outcome",
                           ["kind", "outcome"], registry=REGISTRY)
TUNING_DECISIONS = Counter("vexpert_operator_tuning_decisions_total", "Tuning decisions by parameter and change",
                           ["parameter", "change"], registry=REGISTRY)
GROUP_REFORMS = Counter("vexpert_operator_group_reforms_total", "Node groups re-formed", ["cause"], registry=REGISTRY)
CHILD_WRITES = Counter("vexpert_operator_child_writes_total", "Children created/updated", ["kind", "action"],
                       registry=REGISTRY)

PHASES = ("Pending", "Calibrating", "Deploying", "Running", "Degraded", "Invalid")


class _PhaseCollector(Collector):
    """``vexpert_operator_deployments{phase}`` from the last phase written per deployment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}

    def set(self, namespace: str, name: str, phase: str) -> None:
        with self._lock:
            self._phases[(namespace, name)] = phase

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phases.pop((namespace, name), None)

    def reset(self) -> None:
        with self._lock:
            self._phases.clear()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("vexpert_operator_deployments", "VExpertDeployments by phase", labels=["phase"])
        with self._lock:
            counts = {p: 0 for p in PHASES}
            for phase in self._phases.values():
                counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            family.add_metric([phase], count)
        yield family


DEPLOYMENT_PHASES = _PhaseCollector()
REGISTRY.register(DEPLOYMENT_PHASES)

_server_started = False


def serve(port: int) -> None:
    """Start the /metrics HTTP server once per process (0 = disabled)."""
    global _server_started
    if port and not _server_started:
        start_http_server(port, registry=REGISTRY)
        _server_started = True
