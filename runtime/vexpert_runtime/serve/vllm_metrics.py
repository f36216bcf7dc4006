"""The API's series under vLLM's names (``vllm:…``, with vLLM's ``model_name`` label): what inference gateways and
autoscalers built for vLLM read from a model server's ``/metrics`` — the Gateway API Inference Extension's endpoint
picker routes on ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``, KEDA setups scale on the queue —, so
a vexpert pod stands where a vLLM pod stood. The values are the ``vexpert_serve_*`` series' own, read at scrape time
(nothing observed twice).

The ranks' totals (running and waiting requests, KV usage, preemptions, prefix-cache tokens) are gauges here, as every
API server reads the same (``--api-servers N`` sums counters across servers, not gauges); vLLM types its preemption
and prefix-cache totals as counters — the names and values are vLLM's, a ``rate()`` over them reads the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from vexpert_runtime.serve.histogram import CountedHistogram


class ServeSeries(Protocol):
    """The API's own series this module names again (:class:`~.api.ServeMetrics`'s)."""

    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    preemptions: Gauge
    prefix_query_tokens: Gauge
    prefix_hit_tokens: Gauge
    prompt_tokens: Counter
    generation_tokens: Counter
    finished: Counter
    ttft: CountedHistogram
    itl: CountedHistogram
    duration: CountedHistogram
    queue_time: CountedHistogram
    prefill_time: CountedHistogram
    decode_time: CountedHistogram
    inference_time: CountedHistogram
    request_prompt_tokens: CountedHistogram
    request_generation_tokens: CountedHistogram


class VllmSeries(Collector):
    """vLLM's names for ``metrics``' series, labelled with the served model's name (``model_name()``, read at
    scrape time: the one vLLM's would carry)."""

    def __init__(self, metrics: ServeSeries, model_name: Callable[[], str]) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        m, labels = self.metrics, {"model_name": self.model_name()}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the ranks' batches", _value(m.running))
        yield gauge("vllm:num_requests_waiting", "Requests queued for admission", _value(m.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", _value(m.kv_usage))
        yield gauge("vllm:num_preemptions_total", "Sequences preempted since the ranks started", _value(m.preemptions))
        yield gauge("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                    _value(m.prefix_query_tokens))
        yield gauge("vllm:prefix_cache_hits_total", "Prompt tokens served from the prefix cache",
                    _value(m.prefix_hit_tokens))
        yield counter("vllm:prompt_tokens", "Prompt tokens of finished requests", _value(m.prompt_tokens))
        yield counter("vllm:generation_tokens", "Tokens generated", _value(m.generation_tokens))
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason",
                                      labels=[*labels, "finished_reason"])
        for sample in _samples(m.finished, "vexpert_serve_request_finish_total"):
            success.add_metric([*labels.values(), sample.labels["reason"]], sample.value)
        yield success
        for name, doc, histogram in (("vllm:time_to_first_token_seconds", "Request arrival to first token", m.ttft),
                                     ("vllm:inter_token_latency_seconds", "Time between a request's tokens", m.itl),
                                     ("vllm:e2e_request_latency_seconds", "Request arrival to last token", m.duration),
                                     ("vllm:request_queue_time_seconds", "Time waiting before the first admission",
                                      m.queue_time),
                                     ("vllm:request_prefill_time_seconds", "First admission to first token",
                                      m.prefill_time),
                                     ("vllm:request_decode_time_seconds", "First token to last", m.decode_time),
                                     ("vllm:request_inference_time_seconds", "First admission to last token",
                                      m.inference_time),
                                     ("vllm:request_prompt_tokens", "Prompt tokens per request", m.request_prompt_tokens),
                                     ("vllm:request_generation_tokens", "Generated tokens per request",
                                      m.request_generation_tokens)):
            yield histogram.family(name, doc, labels)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # (collected at scrape time only: no names to reserve at registration)


def _value(metric: Collector) -> float:
    """The value of an unlabelled prometheus_client gauge or counter."""
    for family in metric.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                return float(sample.value)
    return 0.0


def _samples(metric: Collector, name: str) -> list[Sample]:
    """The samples named ``name`` of a labelled prometheus_client metric."""
    return [sample for family in metric.collect() for sample in family.samples if sample.name == name]
