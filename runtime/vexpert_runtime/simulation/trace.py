"""Expert-load traces: per-iteration, per-layer token counts of every routed expert.

A trace is a sequence of *phases* (e.g. decode, then prefill, then decode again) that switch
abruptly. Each phase names a source and a number of iterations:

* ``bundled:NAME`` – a DeepSeek-V3 per-layer distribution shipped in
  ``vexpert_runtime/data/deepseek_v3_loads.json`` (see :func:`bundled_names`);
* ``FILE.json`` – SGLang expert statistics ``{"logical_count": [[E floats] x layers]}``, one
  total per benchmark run, i.e. a distribution per layer, not a time series;
* ``FILE.csv`` or ``FILE.csv#GROUP`` – per-iteration expert counts (columns
  ``,<group>,iteration,layer_idx,0..E-1``, e.g. Qwen1.5-MoE), optionally one group (dataset).

Every iteration routes ``gpus * tokens_per_gpu * top_k`` tokens through every layer. Distribution
phases draw each (iteration, layer) from ``Multinomial(n, p_layer)``; series phases replay the
file's iterations in order (cycling) and resample each to ``n`` tokens from that iteration's
normalised counts, so the batch size is set by the same arguments for both kinds. Layers whose
counts are all zero (dense layers: DeepSeek-V3 layers 0–2) are dropped.

Shapes: ``T`` iterations, ``L`` MoE layers, ``E`` experts per layer.
"""

from __future__ import annotations

import csv
import json
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from vexpert_runtime.errors import VExpertInputError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

BUNDLED_PREFIX = "bundled:"
BUNDLED_FILE = "deepseek_v3_loads.json"
TRACE_FORMAT = "vexpert-trace/1"
_CSV_FIXED_COLUMNS = 4  # index, group (dataset / router_skew / ...), iteration, layer_idx


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One phase of a trace: a load source and how many iterations it lasts.

    ``source`` is ``bundled:NAME``, a ``.json`` SGLang statistics file, or a ``.csv`` series
    (``FILE.csv#GROUP`` selects one dataset of it).
    """

    source: str
    iterations: int

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise VExpertInputError(
                "source", "phase source is empty", "name a bundled load, a .json or a .csv file"
            )
        if not _is_int(self.iterations) or self.iterations <= 0:
            raise VExpertInputError(
                "iterations",
                f"must be a positive integer, got {self.iterations!r}",
                "give each phase at least 1 iteration",
            )

    @property
    def name(self) -> str:
        """Short display name: the bundled name, or the file stem (plus ``#GROUP``)."""
        return phase_name(self.source)


def parse_phase(spec: str) -> Phase:
    """Parse ``SOURCE:ITERS`` (split on the last ``:``, so sources may contain ``:``).

    >>> parse_phase("bundled:prefill_in4096:50")
    Phase(source='bundled:prefill_in4096', iterations=50)
    """
    fix = "write SOURCE:ITERS, e.g. bundled:decode_in1000out1000:200 or loads.json:100"
    if not isinstance(spec, str) or ":" not in spec:
        raise VExpertInputError("phase", f"{spec!r} has no ':ITERS' suffix", fix)
    source, _, iters_text = spec.rpartition(":")
    source = source.strip()
    if not source:
        raise VExpertInputError("phase", f"{spec!r} has an empty source", fix)
    try:
        iterations = int(iters_text.strip())
    except ValueError:
        raise VExpertInputError(
            "phase", f"{spec!r}: iterations {iters_text!r} is not an integer", fix
        ) from None
    if iterations <= 0:
        raise VExpertInputError("phase", f"{spec!r}: iterations must be positive, got {iterations}", fix)
    return Phase(source=source, iterations=iterations)


def phase_name(source: str) -> str:
    """Display name of a phase source: ``bundled:X`` -> ``X``; ``dir/a.csv#wmt19`` -> ``a#wmt19``."""
    if source.startswith(BUNDLED_PREFIX):
        return source[len(BUNDLED_PREFIX) :]
    path, sep, group = _split_group(source)
    return Path(path).stem + (f"#{group}" if sep else "")


# ---------------------------------------------------------------------------------------------
# SGLang JSON statistics (distribution per layer)
# ---------------------------------------------------------------------------------------------


def read_logical_count(path: str | Path) -> FloatArray:
    """Read the raw ``logical_count`` of an SGLang expert-statistics JSON file.

    Returns float64 ``[L_all, E]`` (all layers, dense ones included), validated: rectangular,
    finite, non-negative.
    """
    text = _read_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VExpertInputError(
            "source",
            f"{path} is not JSON ({exc.msg} at line {exc.lineno})",
            "pass an SGLang expert-statistics .json file",
        ) from None
    if not isinstance(doc, dict) or "logical_count" not in doc:
        raise VExpertInputError(
            "logical_count",
            f"{path} has no 'logical_count' key",
            'pass SGLang expert statistics: {"logical_count": [[...] per layer]}',
        )
    rows = doc["logical_count"]
    if not isinstance(rows, list) or not rows or not all(
        isinstance(r, list) and not any(isinstance(v, list) for v in r) for r in rows
    ):
        raise VExpertInputError(
            "logical_count",
            f"{path}: must be a non-empty list of per-layer lists",
            "one list of expert counts per layer",
        )
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        bad = next(i for i, r in enumerate(rows) if len(r) != len(rows[0]))
        raise VExpertInputError(
            "logical_count",
            f"{path}: ragged shape, layer {bad} has {len(rows[bad])} experts but layer 0 has {len(rows[0])}",
            "every layer must list the same experts",
        )
    if 0 in widths:
        raise VExpertInputError("logical_count", f"{path}: layers list no experts", "one count per expert")
    try:
        counts = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError):
        raise VExpertInputError(
            "logical_count", f"{path}: entries must be numbers", "use plain JSON numbers"
        ) from None
    _check_counts(counts, "logical_count", str(path))
    return counts


def drop_dense_layers(
    counts: npt.NDArray[Any], field_name: str = "logical_count"
) -> tuple[npt.NDArray[Any], list[int]]:
    """Drop layers whose counts are all zero (dense FFN layers have no expert traffic).

    Args: counts ``[..., L_all, E]`` (any leading axes, e.g. iterations). Returns the kept
    ``[..., L, E]`` and the dropped layer indices. Raises if every layer is zero.
    """
    per_layer = counts.reshape(-1, counts.shape[-2], counts.shape[-1]).sum(axis=(0, 2))
    dropped = [int(i) for i in np.flatnonzero(per_layer == 0)]
    if len(dropped) == counts.shape[-2]:
        raise VExpertInputError(
            field_name,
            "all counts are zero, no MoE layer has any traffic",
            "use statistics recorded while the model served requests",
        )
    return np.delete(counts, dropped, axis=-2), dropped


def normalize_rows(counts: npt.NDArray[Any]) -> FloatArray:
    """Per-row probabilities ``counts / counts.sum(-1)``; shape unchanged, float64. Rows must be non-zero."""
    counts = np.asarray(counts, dtype=np.float64)
    return counts / counts.sum(axis=-1, keepdims=True)


def load_layer_distribution(path: str | Path) -> FloatArray:
    """SGLang statistics JSON -> float64 ``[L, E]`` per-layer probabilities (rows sum to 1), dense layers dropped."""
    kept, _ = drop_dense_layers(read_logical_count(path))
    return normalize_rows(kept)


# ---------------------------------------------------------------------------------------------
# Bundled DeepSeek-V3 distributions
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _bundled_doc() -> dict[str, Any]:
    """The parsed bundled file (read once)."""
    text = resources.files("vexpert_runtime").joinpath("data", BUNDLED_FILE).read_text(encoding="utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


def bundled_names() -> list[str]:
    """Names usable as ``bundled:NAME`` phase sources, sorted."""
    return sorted(_bundled_doc()["distributions"])


def load_bundled_distribution(name: str) -> FloatArray:
    """Bundled DeepSeek-V3 load -> float64 ``[L, E]`` per-layer probabilities (rows sum to 1).

    The file stores each layer's probabilities × ``value_scale`` rounded to 6 significant
    digits; they are re-normalised here.
    """
    doc = _bundled_doc()
    entry = doc["distributions"].get(name)
    if entry is None:
        raise VExpertInputError(
            "source",
            f"unknown bundled load {name!r}",
            "use one of: " + ", ".join(BUNDLED_PREFIX + n for n in bundled_names()),
        )
    return normalize_rows(np.asarray(entry["distribution"], dtype=np.float64))


# ---------------------------------------------------------------------------------------------
# Per-iteration CSV series
# ---------------------------------------------------------------------------------------------


def read_csv_groups(path: str | Path) -> dict[str, IntArray]:
    """Read a per-iteration expert-count CSV into one int64 ``[T_g, L_all, E]`` array per group.

    Columns: ``,<group>,iteration,layer_idx,0,1,..,E-1`` (the group column is e.g. ``dataset`` or
    ``router_skew``). Rows may come in any order; groups keep their first-appearance order,
    iterations are sorted. Every group must hold each (iteration, layer) exactly once, and all
    groups the same layers.
    """
    rows = list(csv.reader(_read_text(path).splitlines()))
    header = [h.strip() for h in rows[0]] if rows else []
    experts = header[_CSV_FIXED_COLUMNS:]
    if (
        len(header) <= _CSV_FIXED_COLUMNS
        or header[2:4] != ["iteration", "layer_idx"]
        or experts != [str(i) for i in range(len(experts))]
    ):
        raise VExpertInputError(
            "source",
            f"{path}: header must be ',<group>,iteration,layer_idx,0,1,...'",
            "pass a per-iteration expert-count CSV (e.g. the Qwen1.5-MoE traces)",
        )
    body = [r for r in rows[1:] if r]
    if not body:
        raise VExpertInputError(
            "counts", f"{path}: no data rows", "the CSV needs one row per (iteration, layer)"
        )
    bad = next((i for i, r in enumerate(body) if len(r) != len(header)), None)
    if bad is not None:
        raise VExpertInputError(
            "counts",
            f"{path}: data row {bad + 1} has {len(body[bad])} columns, header has {len(header)}",
            "every row needs one count per expert",
        )
    try:
        keys = np.asarray([[int(r[2]), int(r[3])] for r in body], dtype=np.int64)
        values = np.asarray([r[_CSV_FIXED_COLUMNS:] for r in body], dtype=np.float64)
    except ValueError:
        raise VExpertInputError(
            "counts", f"{path}: iteration, layer_idx and counts must be numbers", "fix the non-numeric cell"
        ) from None
    _check_counts(values, "counts", str(path))
    if not np.all(values == np.round(values)):
        raise VExpertInputError(
            "counts", f"{path}: counts must be whole numbers", "store token counts, not fractions"
        )
    groups = [r[1] for r in body]
    layer_ids = np.unique(keys[:, 1])
    out: dict[str, IntArray] = {}
    for group in dict.fromkeys(groups):
        sel = np.asarray([g == group for g in groups])
        out[group] = _assemble_group(keys[sel], values[sel], layer_ids, f"{path} group {group!r}")
    return out


def _assemble_group(keys: IntArray, values: FloatArray, layer_ids: IntArray, where: str) -> IntArray:
    """Place one group's rows (keys ``[R, 2]`` = iteration, layer; values ``[R, E]``) into ``[T, L, E]``."""
    iters = np.unique(keys[:, 0])
    t_idx = np.searchsorted(iters, keys[:, 0])
    l_idx = np.searchsorted(layer_ids, keys[:, 1])
    filled = np.zeros((len(iters), len(layer_ids)), dtype=np.int64)
    np.add.at(filled, (t_idx, l_idx), 1)
    if not np.all(filled == 1):
        t, layer = np.argwhere(filled != 1)[0]
        raise VExpertInputError(
            "counts",
            f"{where}: ragged, iteration {iters[t]} layer {layer_ids[layer]} appears "
            f"{filled[t, layer]} times",
            "give every iteration exactly one row per layer",
        )
    series = np.zeros((len(iters), len(layer_ids), values.shape[1]), dtype=np.int64)
    series[t_idx, l_idx] = values.astype(np.int64)
    return series


def load_csv_series(path: str | Path, dataset: str | None = None) -> IntArray:
    """Per-iteration CSV -> int64 ``[T, L, E]`` counts, all-zero layers dropped.

    ``dataset`` selects one group (value of the CSV's second column); ``None`` concatenates all
    groups in file order, which makes the dataset switches part of the time series.
    """
    groups = read_csv_groups(path)
    if dataset is None:
        series = np.concatenate(list(groups.values()), axis=0)
    elif dataset in groups:
        series = groups[dataset]
    else:
        raise VExpertInputError(
            "dataset", f"{path} has no group {dataset!r}", "use one of: " + ", ".join(groups)
        )
    kept, _ = drop_dense_layers(series, "counts")
    return kept


# ---------------------------------------------------------------------------------------------
# Sampling and trace assembly
# ---------------------------------------------------------------------------------------------


def load_source(source: str) -> npt.NDArray[Any]:
    """Load a phase source: float64 ``[L, E]`` distribution (bundled / JSON) or int64 ``[T, L, E]`` series (CSV)."""
    if source.startswith(BUNDLED_PREFIX):
        return load_bundled_distribution(source[len(BUNDLED_PREFIX) :])
    path, sep, group = _split_group(source)
    if path.lower().endswith(".csv"):
        return load_csv_series(path, group if sep else None)
    return load_layer_distribution(source)


def sample_distribution(
    probs: FloatArray, iterations: int, tokens_per_layer: int, rng: np.random.Generator
) -> IntArray:
    """Draw ``[iterations, L, E]`` counts, each (iteration, layer) ~ Multinomial(tokens_per_layer, probs[layer]).

    Args: probs ``[L, E]`` rows summing to 1.
    """
    counts: IntArray = rng.multinomial(tokens_per_layer, probs, size=(iterations, probs.shape[0]))
    return counts


def resample_series(
    series: IntArray, iterations: int, tokens_per_layer: int, rng: np.random.Generator
) -> IntArray:
    """Replay ``series`` ``[T, L, E]`` in order (cycling) for ``iterations`` steps, each iteration/layer
    resampled to ``tokens_per_layer`` tokens from its normalised counts. Returns ``[iterations, L, E]``.
    """
    totals = series.sum(axis=-1)
    if np.any(totals == 0):
        t, layer = np.argwhere(totals == 0)[0]
        raise VExpertInputError(
            "counts",
            f"iteration {t} layer {layer} routes no tokens, cannot resample it",
            "drop that iteration from the CSV",
        )
    probs = normalize_rows(series)[np.arange(iterations) % series.shape[0]]
    counts: IntArray = rng.multinomial(tokens_per_layer, probs)
    return counts


@dataclass
class Trace:
    """Expert loads over time.

    counts: int64 ``[T, L, E]`` tokens routed to each expert of each MoE layer per iteration.
    phase_starts: first iteration of each phase (``phase_starts[0] == 0``), ascending.
    phase_names: display name of each phase. meta: JSON-serialisable provenance.
    """

    counts: IntArray
    phase_starts: list[int]
    phase_names: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def iterations(self) -> int:
        """T."""
        return int(self.counts.shape[0])

    @property
    def layers(self) -> int:
        """L (MoE layers)."""
        return int(self.counts.shape[1])

    @property
    def experts(self) -> int:
        """E (routed experts per layer)."""
        return int(self.counts.shape[2])

    def phase_ids(self) -> IntArray:
        """int64 ``[T]``: index of the phase each iteration belongs to."""
        ids: IntArray = (
            np.searchsorted(np.asarray(self.phase_starts), np.arange(self.iterations), side="right") - 1
        )
        return ids


@dataclass(frozen=True)
class Variation:
    """How each iteration's routing departs from its phase's source (all off by default).

    ``jitter``: effective independent routings M per (iteration, layer). Each iteration's
        distribution is drawn from Dirichlet(M · p_phase) before the batch is sampled from it:
        the over-dispersion of small decode batches, whose tokens (and the sequences they come
        from) route together. Mean p_phase, per-expert variance ≈ p(1 − p) / M; 0 = off (the
        batch alone is multinomial).
    ``drift``: stationary standard deviation σ of every expert's log-popularity, wandering
        every iteration as an Ornstein–Uhlenbeck walk (correlation time ``drift_iterations``)
        that runs on across phase boundaries; 0 = off.
    ``raw_series``: CSV phases replay their recorded counts as they are (no resampling to the
        batch), so per-iteration noise is the recording's own.
    """

    jitter: float = 0.0
    drift: float = 0.0
    drift_iterations: float = 100.0
    raw_series: bool = False

    def validate(self) -> None:
        for name, value in (("jitter", self.jitter), ("drift", self.drift)):
            if not np.isfinite(value) or value < 0:
                raise VExpertInputError(name, f"must be ≥ 0, got {value!r}", f"pass --{name} 0 (off) or a positive number")
        if not np.isfinite(self.drift_iterations) or self.drift_iterations <= 0:
            raise VExpertInputError("drift_iterations", f"must be > 0, got {self.drift_iterations!r}", "pass e.g. --drift-iterations 100")

    @property
    def active(self) -> bool:
        return self.jitter > 0 or self.drift > 0 or self.raw_series


def drift_walk(iterations: int, layers: int, experts: int, sigma: float, tau: float, rng: np.random.Generator) -> FloatArray:
    """Log-popularity offsets ``[T, L, E]``: an Ornstein–Uhlenbeck walk per (layer, expert),
    stationary std ``sigma``, lag-1 correlation exp(−1/tau), starting in its stationary law so the
    trace's first iterations drift like the later ones."""
    rho = float(np.exp(-1.0 / tau))
    steps = rng.standard_normal((iterations, layers, experts)) * sigma * np.sqrt(1.0 - rho * rho)
    steps[0] = rng.standard_normal((layers, experts)) * sigma
    walk = np.empty_like(steps)
    walk[0] = steps[0]
    for t in range(1, iterations):  # sequential by nature; T steps over [L, E] arrays
        walk[t] = rho * walk[t - 1] + steps[t]
    return walk


def jitter_probs(probs: FloatArray, effective: float, rng: np.random.Generator) -> FloatArray:
    """Draw each row of ``probs`` ``[..., E]`` from Dirichlet(effective · row) (via normalised
    gammas; zero-probability experts stay at zero). Returns ``[..., E]`` rows summing to 1."""
    draw = rng.gamma(np.maximum(effective * probs, 1e-300))
    draw = np.where(probs > 0, draw, 0.0)
    total = draw.sum(axis=-1, keepdims=True)
    # a row whose gammas all underflow (tiny M) keeps its mean instead of dividing by zero
    out: FloatArray = np.where(total > 0, draw / np.where(total > 0, total, 1.0), probs)
    return out


def build_trace(
    phases: list[Phase], gpus: int, tokens_per_gpu: int, top_k: int, seed: int, variation: Variation | None = None
) -> Trace:
    """Concatenate phases into a trace of ``sum(p.iterations)`` iterations; every layer of every
    iteration routes exactly ``gpus * tokens_per_gpu * top_k`` tokens (except raw CSV replays).

    Each phase draws from its own stream ``SeedSequence(seed).spawn(len(phases))[i]``, so the same
    seed gives the same counts and a phase's counts do not depend on the other phases' lengths.
    ``variation`` (jitter, drift, raw CSV replay) draws its own randomness from two further
    streams, so without it the trace is the same as before it existed.
    """
    variation = variation or Variation()
    variation.validate()
    for name, value in (("gpus", gpus), ("tokens_per_gpu", tokens_per_gpu), ("top_k", top_k)):
        if not _is_int(value) or value <= 0:
            raise VExpertInputError(
                name, f"must be a positive integer, got {value!r}", f"pass --{name.replace('_', '-')} >= 1"
            )
    if not _is_int(seed) or seed < 0:
        raise VExpertInputError(
            "seed", f"must be a non-negative integer, got {seed!r}", "pass --seed 0 or larger"
        )
    if not phases or not all(isinstance(p, Phase) for p in phases):
        raise VExpertInputError(
            "phases", "need at least one phase", "pass e.g. bundled:decode_in1000out1000:200"
        )
    tokens_per_layer = gpus * tokens_per_gpu * top_k
    sources = {p.source: load_source(p.source) for p in phases}
    layers, experts = _common_shape(phases, sources)
    if top_k > experts:
        raise VExpertInputError(
            "top_k", f"{top_k} exceeds the {experts} experts per layer", f"use top_k <= {experts}"
        )

    starts = np.concatenate([[0], np.cumsum([p.iterations for p in phases])]).tolist()
    counts = np.empty((starts[-1], layers, experts), dtype=np.int64)
    seq = np.random.SeedSequence(seed)
    streams = seq.spawn(len(phases))
    drift_rng, jitter_rng = (np.random.default_rng(s) for s in seq.spawn(2))
    walk = (
        drift_walk(starts[-1], layers, experts, variation.drift, variation.drift_iterations, drift_rng)
        if variation.drift > 0 else None
    )
    for phase, stream, start, stop in zip(phases, streams, starts[:-1], starts[1:], strict=True):
        rng = np.random.default_rng(stream)
        data = sources[phase.source]
        if not variation.active:
            sample = sample_distribution if data.ndim == 2 else resample_series
            counts[start:stop] = sample(data, phase.iterations, tokens_per_layer, rng)
        elif data.ndim == 3 and variation.raw_series and walk is None and variation.jitter == 0:
            counts[start:stop] = data[np.arange(phase.iterations) % data.shape[0]]
        else:
            counts[start:stop] = _sample_varied(
                data, phase.iterations, tokens_per_layer, variation,
                None if walk is None else walk[start:stop], rng, jitter_rng,
            )
    meta = {  # plain ints: numpy integers are accepted above but JSON cannot hold them
        "format": TRACE_FORMAT,
        "gpus": int(gpus),
        "tokens_per_gpu": int(tokens_per_gpu),
        "top_k": int(top_k),
        "seed": int(seed),
        "tokens_per_layer": int(tokens_per_layer),
        "jitter": float(variation.jitter),
        "drift": float(variation.drift),
        "drift_iterations": float(variation.drift_iterations),
        "raw_series": bool(variation.raw_series),
        "phases": [
            {
                "name": p.name,
                "source": p.source,
                "iterations": int(p.iterations),
                "kind": "distribution" if sources[p.source].ndim == 2 else "series",
            }
            for p in phases
        ],
    }
    return Trace(counts=counts, phase_starts=starts[:-1], phase_names=[p.name for p in phases], meta=meta)


def _sample_varied(
    data: npt.NDArray[Any],
    iterations: int,
    tokens_per_layer: int,
    variation: Variation,
    walk: FloatArray | None,
    rng: np.random.Generator,
    jitter_rng: np.random.Generator,
) -> IntArray:
    """One phase's ``[iterations, L, E]`` counts with drift and/or jitter applied to its
    per-iteration probabilities before the batch is drawn (``walk``: this phase's slice)."""
    if data.ndim == 2:
        probs = np.broadcast_to(data, (iterations, *data.shape))
    else:
        probs = normalize_rows(data)[np.arange(iterations) % data.shape[0]]
    if walk is not None:
        probs = normalize_rows(probs * np.exp(walk))
    if variation.jitter > 0:
        probs = jitter_probs(probs, variation.jitter, jitter_rng)
    if data.ndim == 3 and variation.raw_series:
        # keep each recorded iteration's own token total
        totals = data.sum(axis=-1)[np.arange(iterations) % data.shape[0]]
        raw: IntArray = rng.multinomial(totals, probs)
        return raw
    sampled: IntArray = rng.multinomial(tokens_per_layer, probs)
    return sampled


def _common_shape(phases: list[Phase], sources: dict[str, npt.NDArray[Any]]) -> tuple[int, int]:
    """(L, E) shared by all phase sources; raises naming the first phase that differs."""
    ref = phases[0]
    shape = sources[ref.source].shape[-2:]
    for i, p in enumerate(phases):
        other = sources[p.source].shape[-2:]
        if other != shape:
            raise VExpertInputError(
                "phases",
                f"phase {i} ({p.source}) has {other[0]} layers x {other[1]} experts but phase 0 "
                f"({ref.source}) has {shape[0]} x {shape[1]}",
                "use load sources of the same model in one trace",
            )
    return int(shape[0]), int(shape[1])


# ---------------------------------------------------------------------------------------------
# Persistence
# ---------------------------------------------------------------------------------------------


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` to a ``.npz`` (keys ``counts`` [T, L, E] int32/int64, ``phase_starts`` [P],
    ``phase_names`` [P], ``meta`` JSON string), readable by ``np.load``. ``path`` is used as given.

    Deflate level 1: a 600 x 58 x 256 trace takes ~0.4 s and ~17 MB (level 6 is ~9x slower, 7% smaller).
    """
    counts = np.asarray(trace.counts)
    small = counts.size == 0 or int(counts.max()) < np.iinfo(np.int32).max
    try:
        meta = json.dumps(trace.meta, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise VExpertInputError(
            "meta", f"not JSON-serialisable: {exc}", "keep meta to str/int/float/list/dict"
        ) from None
    arrays = {
        "counts": counts.astype(np.int32 if small else np.int64),
        "phase_starts": np.asarray(trace.phase_starts, dtype=np.int64),
        "phase_names": np.asarray(trace.phase_names, dtype=np.str_),
        "meta": np.asarray(meta),
    }
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for key, array in arrays.items():
            with zf.open(f"{key}.npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, array, allow_pickle=False)


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :func:`save_trace` (counts come back as int64 ``[T, L, E]``)."""
    fix = "pass a .npz written by vexpert's trace builder"
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a bare .npy array
            raise VExpertInputError("trace", f"{path} is a single array, not an .npz with `counts`", fix)
        with loaded as npz:
            arrays = {k: npz[k] for k in npz.files}
    except VExpertInputError:
        raise
    except FileNotFoundError:
        raise VExpertInputError("trace", f"{path} does not exist", fix) from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise VExpertInputError("trace", f"{path} is not a readable .npz ({exc})", fix) from None
    if "counts" not in arrays:
        raise VExpertInputError("trace", f"{path} has no `counts` array", fix)
    counts = arrays["counts"]
    # A bare {counts} file (a user's own recording) is a valid one-phase trace.
    arrays.setdefault("phase_starts", np.zeros(1, dtype=np.int64))
    arrays.setdefault("phase_names", np.array([Path(path).stem]))
    arrays.setdefault("meta", np.array("{}"))
    starts = arrays["phase_starts"]
    if counts.ndim != 3:
        raise VExpertInputError("counts", f"{path}: must be [iterations, layers, experts], got shape {counts.shape}", fix)
    if not np.issubdtype(counts.dtype, np.integer):
        raise VExpertInputError("counts", f"{path}: must be integers, got {counts.dtype}", fix)
    if counts.size and counts.min() < 0:
        raise VExpertInputError("counts", f"{path}: negative expert counts", fix)
    if arrays["phase_names"].ndim != 1:
        raise VExpertInputError("trace", f"{path}: phase_names must be a list of names", fix)
    names = [str(n) for n in arrays["phase_names"]]
    if (
        starts.ndim != 1
        or len(starts) != len(names)
        or (len(starts) and starts[0] != 0)
        or np.any(np.diff(starts) <= 0)
        or np.any(starts >= max(counts.shape[0], 1))
    ):
        raise VExpertInputError("trace", f"{path}: phase_starts must ascend from 0, one per phase name", fix)
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError:
        raise VExpertInputError("trace", f"{path}: meta is not JSON", fix) from None
    if not isinstance(meta, dict):
        raise VExpertInputError("trace", f"{path}: meta must be a JSON object", fix)
    return Trace(
        counts=counts.astype(np.int64), phase_starts=[int(s) for s in starts], phase_names=names, meta=meta
    )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    """True for ints (numpy included), False for bools."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _split_group(source: str) -> tuple[str, str, str]:
    """``a.csv#wmt19`` -> (``a.csv``, ``#``, ``wmt19``); anything else -> (source, '', '')."""
    path, sep, group = source.rpartition("#")
    return (path, sep, group) if sep and path.lower().endswith(".csv") else (source, "", "")


def _read_text(path: str | Path) -> str:
    """File contents as text, with input errors for missing/unreadable files."""
    p = Path(path)
    if not p.is_file():
        raise VExpertInputError(
            "source",
            f"{path} does not exist or is not a file",
            "check the path, or use bundled:NAME (" + ", ".join(bundled_names()) + ")",
        )
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise VExpertInputError("source", f"cannot read {path}: {exc}", "pass a readable text file") from None


def _check_counts(counts: FloatArray, field_name: str, where: str) -> None:
    """Counts must be finite and non-negative."""
    if not np.all(np.isfinite(counts)):
        raise VExpertInputError(field_name, f"{where}: counts must be finite", "remove NaN/Infinity entries")
    if np.any(counts < 0):
        raise VExpertInputError(field_name, f"{where}: negative counts", "token counts cannot be negative")
