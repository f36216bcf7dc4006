"""Several API servers' ``/metrics`` as one (serve/metrics_share.py): counters and histograms summed per
series, gauges the answering server's own, a series only another server has added, creation times
not summed; published files are whole (written atomically) and a stopped server's counts stay."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from vexpert_runtime.serve.histogram import CountedHistogram
from vexpert_runtime.serve.metrics_share import MetricsShare, merge_expositions


def _server(ok: int, refused: int, running: float, ttft: list[float]) -> CollectorRegistry:
    registry = CollectorRegistry()
    requests = Counter("vexpert_serve_requests", "by status", ["status"], registry=registry)
    if ok:
        requests.labels("200").inc(ok)
    if refused:
        requests.labels("429").inc(refused)
    Gauge("vexpert_serve_requests_running", "from the ranks' loads", registry=registry).set(running)
    histogram = CountedHistogram("vexpert_serve_ttft_seconds", "ttft", [0.1, 1.0], registry)
    for value in ttft:
        histogram.observe(value)
    return registry


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_counters_and_histograms_add_up_gauges_stay_the_answering_servers(tmp_path: Path) -> None:
    first, second = _server(3, 0, 5.0, [0.05, 0.5]), _server(4, 2, 7.0, [2.0])
    shares = [MetricsShare(tmp_path, 0), MetricsShare(tmp_path, 1)]
    shares[1].publish(second)
    merged = _samples(shares[0].merged(first))
    assert merged[("vexpert_serve_requests_total", (("status", "200"),))] == 7
    assert merged[("vexpert_serve_requests_total", (("status", "429"),))] == 2  # only the second had one
    assert merged[("vexpert_serve_requests_running", ())] == 5.0  # the answering server's gauge
    assert merged[("vexpert_serve_ttft_seconds_count", ())] == 3
    assert merged[("vexpert_serve_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("vexpert_serve_ttft_seconds_bucket", (("le", "+Inf"),))] == 3
    assert abs(merged[("vexpert_serve_ttft_seconds_sum", ())] - 2.55) < 1e-9
    created = _samples(merge_expositions(_exposition(first), [_exposition(second)]))
    own = _samples(_exposition_bytes(first))
    key = ("vexpert_serve_requests_created", (("status", "200"),))
    assert created[key] == own[key]  # a creation time is not summed
    # the second stops: what it counted stays in the sum; no other file: its own exposition alone
    shares[1].stop(second)
    assert _samples(shares[0].merged(first))[("vexpert_serve_requests_total", (("status", "200"),))] == 7
    assert not list(tmp_path.glob("*.tmp"))
    alone = MetricsShare(tmp_path / "empty", 0)
    (tmp_path / "empty").mkdir()
    assert _samples(alone.merged(first))[("vexpert_serve_requests_total", (("status", "200"),))] == 3


def _exposition_bytes(registry: CollectorRegistry) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(registry)


def _exposition(registry: CollectorRegistry) -> str:
    return _exposition_bytes(registry).decode()
