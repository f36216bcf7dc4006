"""One ``/metrics`` over several API server processes (``vexpert serve --api-servers N``).

The servers share one port (``SO_REUSEPORT``): a scrape reaches whichever one the kernel picks, so
each answers for all of them. Each publishes its own exposition to a file in a directory they share
(every :data:`PUBLISH_S`, and once more when it stops); the one scraped renders its own now and adds
the others' last published: counters and histograms summed per series, gauges its own (they mirror
the ranks' loads, which every server receives). A series another server has and this one has not
yet (a status code only it answered) is added as it is. The node's own series come from the server
that owns the node (fresh there, at most :data:`PUBLISH_S` old on the others).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PUBLISH_S = 1.0  # how stale another server's series may be on a scrape
_SUFFIX = ".prom"
_NODE_FILE = "node.metrics"  # the node's series, published by the server that owns the node


def merge_expositions(own: str, others: Iterable[str]) -> bytes:
    """``own`` (text format 0.0.4) with the counters and histograms of ``others`` added in."""
    families: dict[str, Metric] = {family.name: family for family in text_string_to_metric_families(own)}
    for text in others:
        for family in text_string_to_metric_families(text):
            mine = families.get(family.name)
            if mine is None:
                if family.type != "gauge":
                    families[family.name] = family
                continue
            if family.type == "gauge" or family.type != mine.type:
                continue
            at = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(mine.samples)}
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                i = at.get(key)
                if i is None:
                    at[key] = len(mine.samples)
                    mine.samples.append(sample)
                elif not sample.name.endswith("_created"):  # a creation time is not a count
                    mine.samples[i] = mine.samples[i]._replace(value=mine.samples[i].value + sample.value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class MetricsShare:
    """Server ``index``'s side of the shared directory ``directory``."""

    def __init__(self, directory: str | Path, index: int) -> None:
        self.directory = Path(directory)
        self.index = index
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.directory / f"api-{self.index}{_SUFFIX}"

    def publish(self, registry: CollectorRegistry) -> None:
        """Write this server's exposition (atomically: a reader never sees half of it)."""
        _write_atomically(self.path, generate_latest(registry))

    def merged(self, registry: CollectorRegistry) -> bytes:
        """This server's exposition now, with the other servers' last published added in."""
        others = []
        for path in sorted(self.directory.glob(f"api-*{_SUFFIX}")):
            if path != self.path:
                with contextlib.suppress(OSError):  # a server that just went away
                    others.append(path.read_text())
        own = generate_latest(registry).decode()
        return merge_expositions(own, others) if others else own.encode()

    def node_text(self) -> bytes:
        """The node's exposition as the server that owns the node last published it."""
        try:
            return (self.directory / _NODE_FILE).read_bytes()
        except OSError:
            return b""

    def start(self, registry: CollectorRegistry, node_metrics: Callable[[], bytes] | None = None) -> None:
        """Publish every :data:`PUBLISH_S` on a daemon thread until :meth:`stop` (with
        ``node_metrics``, the server that owns the node: its exposition too)."""

        def loop() -> None:
            while not self._stop.wait(PUBLISH_S):
                with contextlib.suppress(OSError):
                    self.publish(registry)
                    if node_metrics is not None:
                        _write_atomically(self.directory / _NODE_FILE, node_metrics())

        self._thread = threading.Thread(target=loop, name="vexpert-metrics-share", daemon=True)
        self._thread.start()

    def stop(self, registry: CollectorRegistry) -> None:
        """Stop publishing; publish once more (what this server counted until now stays summed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self.publish(registry)
