"""Tests of the load-trace builder (vexpert_runtime.simulation.trace) and its bundled DeepSeek-V3 loads.

Uses the shared benchmark data (``<repo>/../shared/data``) where present and the bundled copy
otherwise; tests that compare against the shared files skip without them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.simulation import trace as tr
from vexpert_runtime.simulation.trace import (
    Phase,
    Trace,
    build_trace,
    bundled_names,
    load_bundled_distribution,
    load_csv_series,
    load_layer_distribution,
    load_trace,
    parse_phase,
    save_trace,
)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared"
DEEPSEEK_DIR = SHARED / "data" / "deepseek-v3"
QWEN_DIR = SHARED / "data" / "qwen1.5-moe"
QWEN_DATASETS = QWEN_DIR / "expert_freq_qwen_policy_datasets.csv"
QWEN_SKEW = QWEN_DIR / "expert_freq_qwen_policy_skew.csv"
BUNDLED_JSON = REPO / "runtime" / "vexpert_runtime" / "data" / "deepseek_v3_loads.json"
DEMO_PHASES = ("decode_in1000out1000", "prefill_in4096", "decode_in500out1500")

needs_deepseek = pytest.mark.skipif(not DEEPSEEK_DIR.is_dir(), reason=f"{DEEPSEEK_DIR} absent")
needs_qwen = pytest.mark.skipif(not QWEN_DATASETS.is_file(), reason=f"{QWEN_DATASETS} absent")


def deepseek_source(name: str) -> str:
    """The shared SGLang file when present, the bundled copy otherwise."""
    path = DEEPSEEK_DIR / f"{name}.json"
    return str(path) if path.is_file() else f"bundled:{name}"


def write_json(path: Path, doc: Any) -> str:
    """Write ``doc`` as JSON; returns the path as str."""
    path.write_text(json.dumps(doc))
    return str(path)


def write_csv(path: Path, rows: list[tuple[str, int, int, list[int]]], group_col: str = "dataset") -> str:
    """Write a per-iteration CSV in the Qwen layout from (group, iteration, layer, counts) rows."""
    experts = len(rows[0][3])
    lines = [",".join(["", group_col, "iteration", "layer_idx", *map(str, range(experts))])]
    lines += [
        ",".join([str(i), g, str(it), str(layer), *map(str, c)]) for i, (g, it, layer, c) in enumerate(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def one_hot_sglang(path: Path, hot: int, layers: int = 4, experts: int = 8, dense: int = 1) -> str:
    """SGLang-style JSON whose ``dense`` first layers are zero and whose MoE layers send everything to ``hot``."""
    rows = [[0.0] * experts for _ in range(dense)]
    rows += [[100.0 if e == hot else 0.0 for e in range(experts)] for _ in range(layers)]
    return write_json(path, {"logical_count": rows})


# --------------------------------------------------------------------------------------------- phases


@pytest.mark.parametrize(
    ("spec", "source", "iters"),
    [
        ("bundled:decode_in1000out1000:200", "bundled:decode_in1000out1000", 200),
        ("loads.json:7", "loads.json", 7),
        ("C:\\data\\a:b.json: 12", "C:\\data\\a:b.json", 12),
        ("q.csv#wmt19:3", "q.csv#wmt19", 3),
    ],
)
def test_parse_phase_splits_on_last_colon(spec: str, source: str, iters: int) -> None:
    assert parse_phase(spec) == Phase(source, iters)


@pytest.mark.parametrize("spec", ["no-iterations", ":5", "a.json:x", "a.json:0", "a.json:-3", "a.json:"])
def test_parse_phase_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(VExpertInputError) as err:
        parse_phase(spec)
    assert err.value.field == "phase"


@pytest.mark.parametrize(
    ("source", "iters", "field"),
    [
        ("x.json", 0, "iterations"),
        ("x.json", -1, "iterations"),
        ("", 5, "source"),
        ("x.json", True, "iterations"),
    ],
)
def test_phase_validates_itself(source: str, iters: int, field: str) -> None:
    with pytest.raises(VExpertInputError) as err:
        Phase(source, iters)
    assert err.value.field == field


def test_phase_names() -> None:
    assert Phase("bundled:prefill_in4096", 1).name == "prefill_in4096"
    assert Phase("/d/decode_in500out1500.json", 1).name == "decode_in500out1500"
    assert Phase("/d/q.csv#wmt19", 1).name == "q#wmt19"


# --------------------------------------------------------------------------------------------- sources


@needs_deepseek
@pytest.mark.parametrize("name", DEMO_PHASES)
def test_json_distribution_drops_dense_layers(name: str) -> None:
    raw = np.asarray(json.loads((DEEPSEEK_DIR / f"{name}.json").read_text())["logical_count"], dtype=float)
    probs = load_layer_distribution(DEEPSEEK_DIR / f"{name}.json")
    assert raw.shape == (61, 256)
    assert probs.shape == (58, 256) and probs.dtype == np.float64
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(probs, raw[3:] / raw[3:].sum(axis=1, keepdims=True), rtol=1e-15)


def test_drop_dense_layers_anywhere(tmp_path: Path) -> None:
    rows = [[1.0, 3.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]]
    probs = load_layer_distribution(write_json(tmp_path / "s.json", {"logical_count": rows}))
    np.testing.assert_allclose(probs, [[0.25, 0.75], [0.5, 0.5]])


def test_bundled_names_and_shapes() -> None:
    assert set(DEMO_PHASES) <= set(bundled_names())
    for name in bundled_names():
        probs = load_bundled_distribution(name)
        assert probs.shape == (58, 256)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-12)
        assert np.all(probs >= 0)


def test_bundled_file_is_compact_and_documented() -> None:
    assert BUNDLED_JSON.stat().st_size < 400_000
    doc = json.loads(BUNDLED_JSON.read_text())
    for name, entry in doc["distributions"].items():
        assert (
            entry["source"] == f"SGLang expert statistics of DeepSeek-V3, shared/data/deepseek-v3/{name}.json"
        )
        assert entry["layers_dropped"] == [0, 1, 2]
        assert len(entry["distribution"]) == 58


@needs_deepseek
@pytest.mark.parametrize("name", DEMO_PHASES)
def test_bundled_matches_shared_source_within_rounding(name: str) -> None:
    bundled = load_bundled_distribution(name)
    shared = load_layer_distribution(DEEPSEEK_DIR / f"{name}.json")
    # 6 significant digits: relative rounding error <= 5e-6, plus the re-normalisation.
    np.testing.assert_allclose(bundled, shared, rtol=1e-5, atol=0)


@needs_deepseek
def test_bundled_file_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location(
        "make_bundled_loads", REPO / "benchmarks" / "make_bundled_loads.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render(DEEPSEEK_DIR.resolve()) == BUNDLED_JSON.read_text()


def _csv_rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as fh:
        return list(csv.reader(fh))[1:]


@needs_qwen
def test_csv_series_matches_file() -> None:
    series = load_csv_series(QWEN_DATASETS)
    assert series.shape == (80, 12, 60) and series.dtype == np.int64
    offsets = {"bookcorpus": 0, "random": 20, "wikitext": 40, "wmt19": 60}
    for row in _csv_rows(QWEN_DATASETS):
        t = offsets[row[1]] + int(row[2])
        np.testing.assert_array_equal(series[t, int(row[3])], [int(v) for v in row[4:]])
    wikitext = load_csv_series(QWEN_DATASETS, dataset="wikitext")
    np.testing.assert_array_equal(wikitext, series[40:60])
    assert np.all(series.sum(axis=-1) == 98304)


@needs_qwen
def test_csv_series_of_other_group_column() -> None:
    assert load_csv_series(QWEN_SKEW).shape == (90, 12, 60)
    skew = load_csv_series(QWEN_SKEW, dataset="0.9")
    assert skew.shape == (40, 12, 60)
    row = next(r for r in _csv_rows(QWEN_SKEW) if r[1] == "0.9" and r[2] == "7" and r[3] == "5")
    np.testing.assert_array_equal(skew[7, 5], [int(v) for v in row[4:]])


def test_csv_series_rows_in_any_order(tmp_path: Path) -> None:
    rows = [
        ("b", 1, 1, [0, 9]),
        ("a", 0, 1, [1, 2]),
        ("a", 0, 0, [3, 4]),
        ("b", 0, 0, [5, 6]),
        ("b", 0, 1, [7, 8]),
        ("b", 1, 0, [9, 0]),
    ]
    path = write_csv(tmp_path / "s.csv", rows)
    series = load_csv_series(path)
    np.testing.assert_array_equal(series, [[[5, 6], [7, 8]], [[9, 0], [0, 9]], [[3, 4], [1, 2]]])
    np.testing.assert_array_equal(load_csv_series(path, "a"), [[[3, 4], [1, 2]]])


# --------------------------------------------------------------------------------------------- traces


def demo_phases(iters: int = 20) -> list[Phase]:
    return [Phase(deepseek_source(n), iters) for n in DEMO_PHASES]


def test_build_is_deterministic_per_seed() -> None:
    a = build_trace(demo_phases(), gpus=8, tokens_per_gpu=64, top_k=8, seed=7)
    b = build_trace(demo_phases(), gpus=8, tokens_per_gpu=64, top_k=8, seed=7)
    c = build_trace(demo_phases(), gpus=8, tokens_per_gpu=64, top_k=8, seed=8)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert not np.array_equal(a.counts, c.counts)


def test_phase_streams_are_independent_of_other_phase_lengths() -> None:
    short = build_trace(
        [Phase("bundled:prefill_in4096", 3), Phase("bundled:decode_in500out1500", 4)], 2, 16, 8, 1
    )
    long = build_trace(
        [Phase("bundled:prefill_in4096", 9), Phase("bundled:decode_in500out1500", 4)], 2, 16, 8, 1
    )
    np.testing.assert_array_equal(short.counts[3:], long.counts[9:])


def test_every_layer_routes_the_whole_batch() -> None:
    trace = build_trace(demo_phases(), gpus=64, tokens_per_gpu=256, top_k=8, seed=0)
    assert trace.counts.dtype == np.int64
    assert trace.counts.shape == (60, 58, 256)
    assert np.all(trace.counts.sum(axis=-1) == 64 * 256 * 8)
    assert trace.meta["tokens_per_layer"] == 64 * 256 * 8


def test_phases_switch_abruptly_at_their_boundaries(tmp_path: Path) -> None:
    a = one_hot_sglang(tmp_path / "a.json", hot=0)
    b = one_hot_sglang(tmp_path / "b.json", hot=5)
    trace = build_trace([Phase(a, 3), Phase(b, 4), Phase(a, 2)], gpus=2, tokens_per_gpu=8, top_k=2, seed=0)
    assert trace.phase_starts == [0, 3, 7]
    assert trace.phase_names == ["a", "b", "a"]
    assert trace.counts.shape == (9, 4, 8)
    hot = trace.counts.argmax(axis=-1)
    np.testing.assert_array_equal(hot[:, 0], [0, 0, 0, 5, 5, 5, 5, 0, 0])
    assert np.all(trace.counts.max(axis=-1) == 32)
    np.testing.assert_array_equal(trace.phase_ids(), [0, 0, 0, 1, 1, 1, 1, 2, 2])
    assert [p["iterations"] for p in trace.meta["phases"]] == [3, 4, 2]


def test_long_phase_reproduces_source_distribution() -> None:
    source = deepseek_source("decode_in1000out1000")
    probs = tr.load_source(source)
    trace = build_trace([Phase(source, 400)], gpus=8, tokens_per_gpu=256, top_k=8, seed=3)
    empirical = trace.counts.sum(axis=0) / trace.counts.sum(axis=(0, 2))[:, None]
    # 400 x 16384 draws per layer: binomial std <= sqrt(0.05 / 6.5e6) ~ 9e-5
    assert np.abs(empirical - probs).max() < 6e-4
    assert 0.5 * np.abs(empirical - probs).sum(axis=1).max() < 0.01  # total-variation distance


def test_csv_phase_replays_iterations_in_order_and_cycles(tmp_path: Path) -> None:
    rows = [("d", 0, 0, [10, 0, 0]), ("d", 1, 0, [0, 3, 0]), ("d", 2, 0, [0, 0, 1]), ("e", 0, 0, [1, 1, 0])]
    path = write_csv(tmp_path / "s.csv", rows)
    trace = build_trace([Phase(path + "#d", 7)], gpus=4, tokens_per_gpu=5, top_k=2, seed=0)
    assert trace.counts.shape == (7, 1, 3)
    np.testing.assert_array_equal(trace.counts[:, 0].argmax(axis=-1), [0, 1, 2, 0, 1, 2, 0])
    assert np.all(trace.counts.sum(axis=-1) == 40)
    assert trace.meta["phases"][0]["kind"] == "series"
    assert trace.phase_names == ["s#d"]


@needs_qwen
def test_qwen_csv_phases_rescaled_to_batch() -> None:
    phases = [Phase(f"{QWEN_DATASETS}#wmt19", 30), Phase(str(QWEN_SKEW), 10)]
    trace = build_trace(phases, gpus=8, tokens_per_gpu=128, top_k=4, seed=0)
    assert trace.counts.shape == (40, 12, 60)
    assert np.all(trace.counts.sum(axis=-1) == 8 * 128 * 4)


def test_full_size_trace_shape() -> None:
    # Speed is a benchmark (benchmarks/README.md), not a timed test.
    trace = build_trace(demo_phases(200), gpus=64, tokens_per_gpu=256, top_k=8, seed=0)
    assert trace.counts.shape == (600, 58, 256)
    assert (trace.counts.sum(-1) == 64 * 256 * 8).all()


def test_save_load_round_trip(tmp_path: Path) -> None:
    trace = build_trace(demo_phases(5), gpus=4, tokens_per_gpu=32, top_k=8, seed=11)
    path = tmp_path / "trace.npz"
    save_trace(trace, path)
    back = load_trace(path)
    assert isinstance(back, Trace)
    assert back.counts.dtype == np.int64
    np.testing.assert_array_equal(back.counts, trace.counts)
    assert back.phase_starts == trace.phase_starts == [0, 5, 10]
    assert back.phase_names == trace.phase_names == list(DEMO_PHASES)
    assert back.meta == trace.meta
    with np.load(path) as raw:  # plain numpy can read it, no pickle
        assert raw["counts"].shape == (15, 58, 256)


# --------------------------------------------------------------------------------------------- bad input


def _field_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(VExpertInputError) as err:
        fn(*args, **kwargs)
    return err.value.field


def test_json_file_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    assert _field_of(load_layer_distribution, tmp_path / "missing.json") == "source"
    assert _field_of(load_layer_distribution, tmp_path / "bad.json") == "source"
    assert (
        _field_of(load_layer_distribution, write_json(tmp_path / "a.json", {"counts": []})) == "logical_count"
    )
    assert _field_of(load_layer_distribution, write_json(tmp_path / "b.json", [1, 2])) == "logical_count"


@pytest.mark.parametrize(
    "rows",
    [
        [[1.0, 2.0], [1.0]],  # ragged
        [[1.0, -2.0], [1.0, 1.0]],  # negative
        [[0.0, 0.0], [0.0, 0.0]],  # all zero
        [],  # empty
        [[]],  # no experts
        [[1.0, "x"]],  # not numbers
        [[1.0, None]],
    ],
)
def test_bad_logical_count(tmp_path: Path, rows: list[Any]) -> None:
    path = write_json(tmp_path / "s.json", {"logical_count": rows})
    assert _field_of(load_layer_distribution, path) == "logical_count"


def test_non_finite_logical_count(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text('{"logical_count": [[1.0, NaN]]}')
    assert _field_of(load_layer_distribution, tmp_path / "s.json") == "logical_count"


def test_unknown_bundled_name_lists_valid_ones() -> None:
    with pytest.raises(VExpertInputError) as err:
        build_trace([Phase("bundled:nope", 3)], 1, 1, 1, 0)
    assert err.value.field == "source"
    assert all(f"bundled:{n}" in err.value.fix for n in DEMO_PHASES)


def test_mismatched_layers_or_experts_between_phases(tmp_path: Path) -> None:
    other = one_hot_sglang(tmp_path / "small.json", hot=0)
    with pytest.raises(VExpertInputError) as err:
        build_trace([Phase("bundled:prefill_in4096", 2), Phase(other, 2)], 1, 1, 1, 0)
    assert err.value.field == "phases"
    assert "58" in err.value.problem and "256" in err.value.problem


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gpus": 0}, "gpus"),
        ({"tokens_per_gpu": -1}, "tokens_per_gpu"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 300}, "top_k"),
        ({"gpus": 2.5}, "gpus"),
        ({"seed": -1}, "seed"),
        ({"phases": []}, "phases"),
    ],
)
def test_bad_build_arguments(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {
        "phases": [Phase("bundled:prefill_in4096", 2)],
        "gpus": 1,
        "tokens_per_gpu": 1,
        "top_k": 1,
        "seed": 0,
    }
    args.update(kwargs)
    assert _field_of(build_trace, **args) == field


def test_csv_errors(tmp_path: Path) -> None:
    good = [("d", 0, 0, [1, 2]), ("d", 0, 1, [3, 4])]
    path = write_csv(tmp_path / "ok.csv", good)
    assert _field_of(load_csv_series, path, "nope") == "dataset"
    assert _field_of(load_csv_series, tmp_path / "missing.csv") == "source"
    (tmp_path / "hdr.csv").write_text("a,b,c\n1,2,3\n")
    assert _field_of(load_csv_series, tmp_path / "hdr.csv") == "source"
    negative = write_csv(tmp_path / "neg.csv", [("d", 0, 0, [1, -2])])
    assert _field_of(load_csv_series, negative) == "counts"
    duplicate = write_csv(tmp_path / "dup.csv", [*good, ("d", 0, 1, [3, 4])])
    assert _field_of(load_csv_series, duplicate) == "counts"
    missing_layer = write_csv(tmp_path / "gap.csv", [*good, ("d", 1, 0, [3, 4])])
    assert _field_of(load_csv_series, missing_layer) == "counts"
    zeros = write_csv(tmp_path / "zero.csv", [("d", 0, 0, [0, 0])])
    assert _field_of(load_csv_series, zeros) == "counts"
    empty_iteration = write_csv(tmp_path / "gapit.csv", [*good, ("d", 1, 0, [0, 0]), ("d", 1, 1, [1, 1])])
    assert _field_of(build_trace, [Phase(empty_iteration, 2)], 1, 1, 1, 0) == "counts"


def test_load_trace_errors(tmp_path: Path) -> None:
    assert _field_of(load_trace, tmp_path / "missing.npz") == "trace"
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert _field_of(load_trace, tmp_path / "junk.npz") == "trace"
    np.savez(tmp_path / "no_counts.npz", other=np.zeros((2, 1, 1), dtype=np.int64))
    assert _field_of(load_trace, tmp_path / "no_counts.npz") == "trace"
    # A bare counts file (a user's own recording) is a one-phase trace.
    np.savez(tmp_path / "bare.npz", counts=np.ones((2, 3, 4), dtype=np.int64))
    bare = load_trace(tmp_path / "bare.npz")
    assert bare.phase_starts == [0] and bare.counts.shape == (2, 3, 4)
    np.savez(tmp_path / "flat.npz", counts=np.ones((2, 3), dtype=np.int64))
    assert _field_of(load_trace, tmp_path / "flat.npz") == "counts"
    np.savez(tmp_path / "neg.npz", counts=-np.ones((2, 3, 4), dtype=np.int64))
    assert _field_of(load_trace, tmp_path / "neg.npz") == "counts"


def test_a_nested_logical_count_is_refused_not_read_as_a_series(tmp_path: Path) -> None:
    path = tmp_path / "nested.json"
    path.write_text(json.dumps({"logical_count": [[[1, 2], [3, 4]]]}))
    with pytest.raises(VExpertInputError) as info:
        load_layer_distribution(path)
    assert info.value.field == "logical_count"


@pytest.mark.parametrize(("arrays", "message"), [
    ("npy", "single array"),
    ({"counts": np.ones((2, 1, 4), dtype=np.int64), "phase_starts": np.zeros(1, dtype=np.int64),
      "phase_names": np.array("one")}, "phase_names must be a list"),
    ({"counts": np.ones((2, 1, 4), dtype=np.int64), "meta": np.array("[1, 2]")}, "meta must be a JSON object"),
])
def test_malformed_trace_files_are_input_errors(tmp_path: Path, arrays: Any, message: str) -> None:
    if arrays == "npy":
        path = tmp_path / "t.npy"
        np.save(path, np.ones((2, 1, 4), dtype=np.int64))
    else:
        path = tmp_path / "t.npz"
        np.savez(path, **arrays)
    with pytest.raises(VExpertInputError, match=message):
        load_trace(path)


def test_numpy_integer_arguments_give_a_trace_that_saves(tmp_path: Path) -> None:
    trace = build_trace([Phase("bundled:decode_in1000out1000", np.int64(3))], np.int64(4), np.int64(16),
                        np.int64(2), seed=np.int64(0))
    save_trace(trace, tmp_path / "t.npz")
    assert load_trace(tmp_path / "t.npz").meta["gpus"] == 4


# ---------------------------------------------------------------------------------------------
# Variation: jitter, drift, raw CSV replay (issue #14)
# ---------------------------------------------------------------------------------------------


def _per_iteration_spread(counts: np.ndarray) -> float:
    """Mean over (layer, expert) of the std over iterations of each expert's share."""
    shares = counts / counts.sum(axis=-1, keepdims=True)
    return float(shares.std(axis=0).mean())


def test_no_variation_gives_the_old_trace() -> None:
    plain = build_trace(demo_phases(5), 4, 32, 8, 2)
    off = build_trace(demo_phases(5), 4, 32, 8, 2, tr.Variation())
    np.testing.assert_array_equal(plain.counts, off.counts)


def test_jitter_widens_per_iteration_spread_around_the_phase_mean() -> None:
    source = deepseek_source("decode_in1000out1000")
    probs = tr.load_source(source)
    plain = build_trace([Phase(source, 200)], 8, 256, 8, 0)
    jittered = build_trace([Phase(source, 200)], 8, 256, 8, 0, tr.Variation(jitter=2048))
    assert np.all(jittered.counts.sum(axis=-1) == 8 * 256 * 8)  # the batch is unchanged
    assert _per_iteration_spread(jittered.counts) > 1.3 * _per_iteration_spread(plain.counts)
    # ...around the same distribution: the long-run mean still matches the source
    empirical = jittered.counts.sum(axis=0) / jittered.counts.sum(axis=(0, 2))[:, None]
    assert 0.5 * np.abs(empirical - probs).sum(axis=1).max() < 0.05


def test_drift_wanders_every_iteration_and_continues_across_phases() -> None:
    source = deepseek_source("decode_in1000out1000")
    variation = tr.Variation(drift=0.5, drift_iterations=20)
    trace = build_trace([Phase(source, 60), Phase(source, 60)], 8, 256, 8, 0, variation)
    shares = trace.counts / trace.counts.sum(axis=-1, keepdims=True)
    # neighbouring iterations stay close, distant ones differ: a wandering popularity, no switch
    near = np.abs(shares[1:] - shares[:-1]).sum(-1).mean()
    far = np.abs(shares[40:] - shares[:-40]).sum(-1).mean()
    assert far > 1.5 * near
    at_boundary = np.abs(shares[60] - shares[59]).sum(-1).mean()
    assert at_boundary < 2 * near  # same source on both sides: the walk does not restart
    walk = tr.drift_walk(4000, 1, 50, 0.5, 20.0, np.random.default_rng(0))
    assert abs(walk.std() - 0.5) < 0.05
    lag1 = np.corrcoef(walk[1:, 0].ravel(), walk[:-1, 0].ravel())[0, 1]
    assert abs(lag1 - np.exp(-1 / 20)) < 0.02


def test_raw_series_replays_recorded_counts(tmp_path: Path) -> None:
    rows = [("d", 0, 0, [10, 0, 0]), ("d", 1, 0, [0, 3, 1])]
    path = write_csv(tmp_path / "s.csv", rows)
    trace = build_trace([Phase(path, 5)], 4, 5, 2, 0, tr.Variation(raw_series=True))
    np.testing.assert_array_equal(trace.counts[:, 0], [[10, 0, 0], [0, 3, 1]] * 2 + [[10, 0, 0]])
    assert trace.meta["raw_series"] is True


@pytest.mark.parametrize(("kwargs", "field"), [({"jitter": -1.0}, "jitter"), ({"drift": float("nan")}, "drift"),
                                                ({"drift_iterations": 0.0}, "drift_iterations")])
def test_bad_variation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(VExpertInputError) as err:
        build_trace(demo_phases(2), 2, 8, 8, 0, tr.Variation(**kwargs))
    assert err.value.field == field
