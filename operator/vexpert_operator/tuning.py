"""The tuning loop's decisions: k (allocation interval) and Np (pinned experts). Pure functions.

Inputs are the node pods' Prometheus metrics (``GET /metrics`` on ``runtime.httpPort``, the port of
``vexpert serve``), as the node runtime (:mod:`vexpert_runtime.node.metrics`) exports them; names
must match exactly:

=====================================  ==============================================================
``vexpert_balance_ratio``              mean over layers of mean/max GPU load (SGLang's balancedness)
``vexpert_balance_ratio_after_allocation``  the same, right after the latest allocation (optional)
``vexpert_balance_decay``              relative drop of the balance ratio from the first to the last
                                       iteration of an allocation interval, mean of the last few
                                       (optional; else computed from the two above)
``vexpert_tokens_per_second``          decode throughput of the pod
``vexpert_allocator_seconds``          time of one allocation (gauge, or histogram: mean = sum/count)
``vexpert_step_seconds``               time of one decode step (gauge or histogram)
``vexpert_allocation_interval``        k the runtime is using (shows the ConfigMap was applied)
``vexpert_pooled_experts``             Np the runtime is using
``vexpert_degraded``                   1 while the pod runs degraded (e.g. slots not filled in time)
``vexpert_pool_hit_ratio``             of the vExperts the allocator wanted without the pool
                                       restriction, the share whose expert is pinned (optional)
``vexpert_pinned_memory_pressure``     host bytes the runtime's limit check counts (the pinned pool;
                                       CPU workers add slots and base experts) / its host memory
                                       limit, 0 without a limit (optional)
=====================================  ==============================================================

and, when the pod serves requests, the serving series (summed over their label sets; counters and
histograms are cumulative, so the operator takes their change between two scrapes of one pod, see
:func:`serving_rates`):

=============================================  ======================================================
``vexpert_serve_generated_tokens_total``       tokens generated → generated tokens/s
``vexpert_serve_inter_token_latency_seconds``  histogram: Δ_sum/Δ_count = mean inter-token latency
``vexpert_serve_time_to_first_token_seconds``  histogram: mean time to first token (reported)
``vexpert_serve_requests_total``,              counters (parsed, not used by the rules)
``vexpert_serve_prompt_tokens_total``
``vexpert_serve_requests_running``,            gauges: requests decoding / queued (reported)
``vexpert_serve_requests_waiting``,
``vexpert_serve_kv_cache_usage_ratio``
=============================================  ======================================================

The runtime exports NaN for "no data yet" (no allocation interval of the current k completed, no
allocation with the current Np): the parser drops non-finite samples, so such a gauge is absent.

Rules (each with a dead band, so a value near a threshold does not flap):

* k shorter (÷ step) when the balance decays by more than ``decay_high`` between allocations and
  the allocator is cheap; k longer (× step) when the allocator takes more than ``share_high`` of
  step time (amortised over k) and the balance barely decays (< ``decay_low``).
* Np is as large as node memory allows (the cap). It shrinks (× ``np_shrink``) only when pinned
  memory pressure exceeds ``pressure_high``, and grows back toward the cap when the pool misses
  (hit ratio < ``hit_low``) and pressure is below ``pressure_low``.
* A change never goes so far that, with the metric scaled by the change (decay ∝ k, allocator
  share ∝ 1/k, pinned pressure ∝ Np), the opposite rule would fire at once: the dead bands hold
  whatever the step sizes.
* With serving series, what users see is the objective: the allocator's share is taken of the
  measured inter-token latency (the step plus everything else on a token's path, allocation stalls
  included) instead of the step-time gauge, and k is held while no tokens were generated between
  two scrapes (an idle server's balance and step gauges describe no traffic) or before a second
  scrape gives the rates. Without serving series (a ``vexpert node`` pod) the step-time rules above
  apply unchanged.
* No change until every pod reports the current k and Np (the previous decision has taken effect),
  at most one change per parameter per ``cooldown`` decisions, nothing while degraded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

MAX_METRICS_BYTES = 512 * 1024
MAX_SAMPLES = 5000

KNOWN_GAUGES = (
    "vexpert_balance_ratio",
    "vexpert_balance_ratio_after_allocation",
    "vexpert_balance_decay",
    "vexpert_tokens_per_second",
    "vexpert_allocator_seconds",
    "vexpert_step_seconds",
    "vexpert_allocation_interval",
    "vexpert_pooled_experts",
    "vexpert_degraded",
    "vexpert_pool_hit_ratio",
    "vexpert_pinned_memory_pressure",
)

GENERATED_TOKENS = "vexpert_serve_generated_tokens_total"
INTER_TOKEN_LATENCY = "vexpert_serve_inter_token_latency_seconds"
TIME_TO_FIRST_TOKEN = "vexpert_serve_time_to_first_token_seconds"
# Cumulative series of `vexpert serve`, summed over label sets (histograms as their _sum and _count).
SERVE_COUNTERS = (
    GENERATED_TOKENS,
    "vexpert_serve_prompt_tokens_total",
    "vexpert_serve_requests_total",
    f"{INTER_TOKEN_LATENCY}_sum", f"{INTER_TOKEN_LATENCY}_count",
    f"{TIME_TO_FIRST_TOKEN}_sum", f"{TIME_TO_FIRST_TOKEN}_count",
)
# Windows the runtime did not allocate (the plan would not change): an allocation that cost nothing, so
# vexpert_allocator_seconds is read as the allocator's time per window, these included.
ALLOCATIONS_SKIPPED = "vexpert_allocations_skipped_total"
SERVE_GAUGES = ("vexpert_serve_requests_running", "vexpert_serve_requests_waiting", "vexpert_serve_kv_cache_usage_ratio")

# Schema of the values (the pods are untrusted): a value outside its range is dropped, as if absent.
GAUGE_RANGES: dict[str, tuple[float, float]] = {
    "vexpert_balance_ratio": (0.0, 1.0),
    "vexpert_balance_ratio_after_allocation": (0.0, 1.0),
    "vexpert_balance_decay": (-1.0, 1.0),
    "vexpert_tokens_per_second": (0.0, 1e9),
    "vexpert_allocator_seconds": (0.0, 3600.0),
    "vexpert_step_seconds": (0.0, 3600.0),
    "vexpert_allocation_interval": (0.0, 1e6),
    "vexpert_pooled_experts": (0.0, 1e6),
    "vexpert_degraded": (0.0, 1.0),
    "vexpert_pool_hit_ratio": (0.0, 1.0),
    "vexpert_pinned_memory_pressure": (0.0, 100.0),
    **{name: (0.0, 1e18) for name in SERVE_COUNTERS},
    "vexpert_serve_requests_running": (0.0, 1e7),
    "vexpert_serve_requests_waiting": (0.0, 1e7),
    "vexpert_serve_kv_cache_usage_ratio": (0.0, 1.0),
}

# Derived per pod by serving_rates (not metric names): between the previous scrape and this one.
SERVE_TOKENS_PER_SECOND = "serve:generated_tokens_per_second"
SERVE_INTER_TOKEN_LATENCY = "serve:inter_token_latency_seconds"
SERVE_TIME_TO_FIRST_TOKEN = "serve:time_to_first_token_seconds"


class MetricsError(ValueError):
    pass


def parse_runtime_metrics(text: str | bytes, max_bytes: int = MAX_METRICS_BYTES) -> dict[str, float]:
    """Prometheus text → {name: value}: the known gauges (mean over label sets), the serving
    counters and histogram _sum/_count (summed over label sets, e.g. requests_total{status}); the
    allocator's mean time counts the windows it skipped (``ALLOCATIONS_SKIPPED``) as free.

    Bounded: bodies over ``max_bytes`` or with more than ``MAX_SAMPLES`` samples are refused.
    Non-finite values, and values outside ``GAUGE_RANGES`` (the schema), are dropped.
    """
    if isinstance(text, bytes):
        if len(text) > max_bytes:
            raise MetricsError(f"metrics body over {max_bytes} bytes")
        text = text.decode("utf-8", errors="replace")
    elif len(text.encode()) > max_bytes:
        raise MetricsError(f"metrics body over {max_bytes} bytes")
    values: dict[str, list[float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    totals: dict[str, float] = {}
    skipped = 0.0
    count = 0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                count += 1
                if count > MAX_SAMPLES:
                    raise MetricsError(f"more than {MAX_SAMPLES} samples")
                if not math.isfinite(sample.value):
                    continue
                if sample.name in KNOWN_GAUGES or sample.name in SERVE_GAUGES:
                    values.setdefault(sample.name, []).append(float(sample.value))
                elif sample.name in SERVE_COUNTERS:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
                elif sample.name == ALLOCATIONS_SKIPPED:
                    skipped += sample.value
                elif sample.name.endswith("_sum") and sample.name[:-4] in KNOWN_GAUGES:
                    sums[sample.name[:-4]] = sums.get(sample.name[:-4], 0.0) + sample.value
                elif sample.name.endswith("_count") and sample.name[:-6] in KNOWN_GAUGES:
                    counts[sample.name[:-6]] = counts.get(sample.name[:-6], 0.0) + sample.value
    except MetricsError:
        raise
    except Exception as exc:  # the parser raises ValueError/TypeError/IndexError on bad input
        raise MetricsError(f"unparsable metrics: {exc}") from None
    out = {name: sum(v) / len(v) for name, v in values.items()}
    for name, total in sums.items():  # histograms/summaries (the runtime's *_seconds): the mean
        observed = counts.get(name, 0) + (max(0.0, skipped) if name == "vexpert_allocator_seconds" else 0)
        if name not in out and observed > 0:
            out[name] = total / observed
    out.update(totals)
    return {name: value for name, value in out.items() if _in_range(name, value)}


def _in_range(name: str, value: float) -> bool:
    low, high = GAUGE_RANGES.get(name, (-math.inf, math.inf))
    return math.isfinite(value) and low <= value <= high


def serving_rates(current: Mapping[str, float], previous: Mapping[str, float] | None,
                  seconds: float) -> dict[str, float]:
    """What one pod served between two of its scrapes ``seconds`` apart: generated tokens/s and the
    mean inter-token latency and time to first token (Δ_sum/Δ_count of the histograms; absent
    without new observations). Empty without an earlier scrape; a series that went down (the
    container restarted) or is missing on either side gives nothing."""
    if previous is None or seconds <= 0:
        return {}

    def delta(name: str) -> float | None:
        if name not in current or name not in previous or current[name] < previous[name]:
            return None
        return current[name] - previous[name]

    out: dict[str, float] = {}
    tokens = delta(GENERATED_TOKENS)
    if tokens is not None:
        out[SERVE_TOKENS_PER_SECOND] = tokens / seconds
    for hist, key in ((INTER_TOKEN_LATENCY, SERVE_INTER_TOKEN_LATENCY), (TIME_TO_FIRST_TOKEN, SERVE_TIME_TO_FIRST_TOKEN)):
        total, count = delta(f"{hist}_sum"), delta(f"{hist}_count")
        if total is not None and count:
            out[key] = total / count
    return out


@dataclass(frozen=True)
class RuntimeSample:
    """All node pods' metrics folded into one view of the group."""

    pods: int
    balance_ratio: float | None = None
    balance_decay: float | None = None
    tokens_per_second: float | None = None
    allocator_share: float | None = None
    reported_k: set[int] = field(default_factory=set)
    reported_np: set[int] = field(default_factory=set)
    degraded_pods: int = 0
    pool_hit_ratio: float | None = None
    memory_pressure: float | None = None
    unscraped_pods: int = 0  # ready pods whose metrics could not be read
    share_basis: str = "step time"  # what allocator_share divides by: step time or inter-token latency
    serving: bool = False  # a pod exports the serving counters (`vexpert serve`)
    # serving (None: no pod reported it, or no earlier scrape to take a rate against)
    generated_tokens_per_second: float | None = None  # all pods
    inter_token_latency: float | None = None  # seconds, mean over pods
    time_to_first_token: float | None = None  # seconds, mean over pods
    requests_running: int | None = None  # all pods
    requests_waiting: int | None = None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate(per_pod: Iterable[Mapping[str, float]], unscraped: int = 0) -> RuntimeSample:
    pods = list(per_pod)
    balance = [p["vexpert_balance_ratio"] for p in pods if "vexpert_balance_ratio" in p]
    decays: list[float] = []
    shares: list[tuple[float, str]] = []
    for p in pods:
        if "vexpert_balance_decay" in p:
            decays.append(max(0.0, p["vexpert_balance_decay"]))
        elif p.get("vexpert_balance_ratio_after_allocation", 0) > 0 and "vexpert_balance_ratio" in p:
            after = p["vexpert_balance_ratio_after_allocation"]
            decays.append(max(0.0, (after - p["vexpert_balance_ratio"]) / after))
        k = p.get("vexpert_allocation_interval", 0)
        # per token, what a client waits (measured while serving), else one decode step
        per_token, basis = p.get(SERVE_INTER_TOKEN_LATENCY, 0.0), "inter-token latency"
        if per_token <= 0:
            per_token, basis = p.get("vexpert_step_seconds", 0.0), "step time"
        if per_token > 0 and k > 0 and "vexpert_allocator_seconds" in p:
            shares.append((p["vexpert_allocator_seconds"] / (k * per_token), basis))
    tokens = [p["vexpert_tokens_per_second"] for p in pods if "vexpert_tokens_per_second" in p]
    hits = [p["vexpert_pool_hit_ratio"] for p in pods if "vexpert_pool_hit_ratio" in p]
    pressure = [p["vexpert_pinned_memory_pressure"] for p in pods if "vexpert_pinned_memory_pressure" in p]
    share = max(shares) if shares else None

    def serve_sum(key: str) -> float | None:
        found = [p[key] for p in pods if key in p]
        return sum(found) if found else None

    running, waiting = serve_sum("vexpert_serve_requests_running"), serve_sum("vexpert_serve_requests_waiting")
    return RuntimeSample(
        pods=len(pods),
        balance_ratio=_mean(balance),
        balance_decay=max(decays) if decays else None,
        tokens_per_second=sum(tokens) if tokens else None,
        allocator_share=share[0] if share else None,
        reported_k={round(p["vexpert_allocation_interval"]) for p in pods if "vexpert_allocation_interval" in p},
        reported_np={round(p["vexpert_pooled_experts"]) for p in pods if "vexpert_pooled_experts" in p},
        degraded_pods=sum(1 for p in pods if p.get("vexpert_degraded", 0) > 0),
        pool_hit_ratio=min(hits) if hits else None,
        memory_pressure=max(pressure) if pressure else None,
        unscraped_pods=unscraped,
        share_basis=share[1] if share else "step time",
        serving=any(GENERATED_TOKENS in p for p in pods),
        generated_tokens_per_second=serve_sum(SERVE_TOKENS_PER_SECOND),
        inter_token_latency=_mean([p[SERVE_INTER_TOKEN_LATENCY] for p in pods if SERVE_INTER_TOKEN_LATENCY in p]),
        time_to_first_token=_mean([p[SERVE_TIME_TO_FIRST_TOKEN] for p in pods if SERVE_TIME_TO_FIRST_TOKEN in p]),
        requests_running=round(running) if running is not None else None,
        requests_waiting=round(waiting) if waiting is not None else None,
    )


@dataclass(frozen=True)
class TuningPolicy:
    decay_high: float = 0.10
    decay_low: float = 0.05
    share_high: float = 0.05
    share_low: float = 0.02
    k_step: float = 1.5
    # The operator sizes the pod so that the pinned pool at its cap nearly fills the runtime's
    # memory limit (pool/(pool + overhead) ≈ 0.97 for DeepSeek-V3), so "pressure" means less than
    # 1 % headroom left, not a high ratio by design.
    pressure_high: float = 0.99
    pressure_low: float = 0.95
    hit_low: float = 0.95
    np_shrink: float = 0.8
    np_grow: float = 1.25
    cooldown: int = 2  # decisions to wait after a change of the same parameter


@dataclass(frozen=True)
class TuningState:
    allocation_interval: int
    pooled_experts: int
    k_mode: str  # auto | fixed
    k_min: int
    k_max: int
    np_mode: str
    np_min: int
    np_cap: int
    decisions_since_k_change: int = 1_000
    decisions_since_np_change: int = 1_000


@dataclass(frozen=True)
class TuningDecision:
    allocation_interval: int
    pooled_experts: int
    reason: str
    k_changed: bool = False
    np_changed: bool = False

    @property
    def changed(self) -> bool:
        return self.k_changed or self.np_changed


def _decide_k(state: TuningState, sample: RuntimeSample, policy: TuningPolicy) -> tuple[int, str]:
    k = state.allocation_interval
    if state.k_mode == "fixed":
        return k, f"k fixed at {k}"
    if state.decisions_since_k_change < policy.cooldown:
        return k, f"k {k} held (cooldown after the last change)"
    if sample.serving and sample.generated_tokens_per_second is None:
        return k, f"k {k} held (serving: rates need a second scrape)"
    if sample.generated_tokens_per_second is not None and sample.generated_tokens_per_second <= 0:
        return k, f"k {k} held (idle: no tokens generated since the last scrape)"
    decay, share, basis = sample.balance_decay, sample.allocator_share, sample.share_basis
    if decay is None and share is None:
        return k, f"k {k} held (no balance-decay or allocator-time data)"
    if share is not None and share > policy.share_high and (decay is None or decay < policy.decay_low):
        new = min(state.k_max, max(k + 1, math.ceil(k * policy.k_step)))
        if decay is not None and decay > 0:  # not so long that the balance would then decay too much
            bound = k * policy.decay_high / decay
            if bound < new:
                new = max(k, math.floor(bound))
        if new > k:
            return new, f"k {k}→{new}: allocator is {share:.1%} of {basis} (> {policy.share_high:.0%})"
        if k >= state.k_max:
            return k, f"k {k} at its upper bound though the allocator is {share:.1%} of {basis}"
        return k, f"k {k} held: a longer k would let the balance decay over {policy.decay_high:.0%}"
    if decay is not None and decay > policy.decay_high and (share is None or share < policy.share_low):
        new = max(state.k_min, min(k - 1, math.floor(k / policy.k_step)))
        if share is not None and share > 0:  # not so short that the allocator would then cost too much
            bound = k * share / policy.share_high
            if bound > new:
                new = min(k, math.ceil(bound))
        if new < k:
            return new, f"k {k}→{new}: balance decays {decay:.1%} between allocations (> {policy.decay_high:.0%})"
        if k <= state.k_min:
            return k, f"k {k} at its lower bound though the balance decays {decay:.1%}"
        return k, f"k {k} held: a shorter k would make the allocator over {policy.share_high:.0%} of {basis}"
    parts = []
    if decay is not None:
        parts.append(f"decay {decay:.1%}")
    if share is not None:
        parts.append(f"allocator {share:.1%} of {'step' if basis == 'step time' else basis}")
    return k, f"k {k} held ({', '.join(parts)} within the dead band)"


def _decide_np(state: TuningState, sample: RuntimeSample, policy: TuningPolicy) -> tuple[int, str]:
    n = state.pooled_experts
    if state.np_mode == "fixed":
        return n, f"Np fixed at {n}"
    if n > state.np_cap:
        return state.np_cap, f"Np {n}→{state.np_cap}: above what node memory allows"
    if state.decisions_since_np_change < policy.cooldown:
        return n, f"Np {n} held (cooldown after the last change)"
    pressure, hits = sample.memory_pressure, sample.pool_hit_ratio
    if pressure is not None and pressure > policy.pressure_high:
        new = max(state.np_min, min(n - 1, math.floor(n * policy.np_shrink)))
        if new != n:
            return new, f"Np {n}→{new}: pinned memory pressure {pressure:.0%} (> {policy.pressure_high:.0%})"
        return n, f"Np {n} at its lower bound under memory pressure {pressure:.0%}"
    if n < state.np_cap and hits is not None and hits < policy.hit_low and (
            pressure is None or pressure < policy.pressure_low):
        new = min(state.np_cap, max(n + 1, math.ceil(n * policy.np_grow)))
        if pressure is not None and pressure > 0:  # not so far that the pool would then be under pressure
            bound = n * policy.pressure_high / pressure
            if bound < new:
                new = max(n, math.floor(bound))
        if new > n:
            return new, (f"Np {n}→{new}: pool hit ratio {hits:.0%} (< {policy.hit_low:.0%}), "
                         f"memory allows {state.np_cap}")
        return n, f"Np {n} held: growing would bring pinned memory pressure {pressure:.0%} over {policy.pressure_high:.0%}"
    if n == state.np_cap:
        return n, f"Np {n} = as many as node memory allows"
    return n, f"Np {n} held (cap {state.np_cap})"


def decide_tuning(state: TuningState, sample: RuntimeSample, policy: TuningPolicy | None = None) -> TuningDecision:
    policy = policy or TuningPolicy()
    k, n = state.allocation_interval, state.pooled_experts
    if sample.pods == 0:
        return TuningDecision(k, n, "no runtime metrics yet")
    if sample.degraded_pods:
        return TuningDecision(k, n, f"held: {sample.degraded_pods} pod(s) report degraded")
    if sample.unscraped_pods:  # every pod must report the current k and Np before a change
        return TuningDecision(k, n, f"held: {sample.unscraped_pods} ready pod(s) could not be scraped")
    if (sample.reported_k and sample.reported_k != {k}) or (sample.reported_np and sample.reported_np != {n}):
        return TuningDecision(k, n, f"held: waiting for the runtime to apply k={k}, Np={n} "
                                    f"(reports k={sorted(sample.reported_k)}, Np={sorted(sample.reported_np)})")
    new_k, why_k = _decide_k(state, sample, policy)
    new_n, why_n = _decide_np(state, sample, policy)
    return TuningDecision(new_k, new_n, f"{why_k}; {why_n}", k_changed=new_k != k, np_changed=new_n != n)
