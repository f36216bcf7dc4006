"""Model calibration: the Δ(L, V) regression, its inputs, and the sensitivity analysis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vexpert_runtime.calibration.model_fit import (
    BalanceSamples,
    calibrate_model,
    collect_balance_samples,
    fit_balance_model,
    termination_message,
)
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.profile import PerformanceProfile, parse_profile
from vexpert_runtime.simulation.simulate import SimulationConfig, perturbed, sensitivity
from vexpert_runtime.simulation.trace import Phase, build_trace


def test_regression_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    n = 2000
    L = rng.uniform(0.2, 0.8, n)
    V = rng.integers(1, 4, n).astype(float)
    delta = -0.75 * L + 0.53 * V + 0.1 + rng.normal(0, 0.01, n)
    fit = fit_balance_model(BalanceSamples(L, V, delta, rng.integers(0, 10, n)))
    assert fit.alpha == pytest.approx(-0.75, abs=0.01)
    assert fit.beta == pytest.approx(0.53, abs=0.01)
    assert fit.intercept == pytest.approx(0.1, abs=0.01)
    assert fit.r2 > 0.99
    assert len(fit.residual_rms_per_layer) == 10


def test_degenerate_samples_are_rejected():
    L = np.full(10, 0.4)
    with pytest.raises(VExpertInputError, match="vary"):
        fit_balance_model(BalanceSamples(L, np.ones(10), np.zeros(10), np.zeros(10, dtype=int)))
    with pytest.raises(VExpertInputError, match="at least 3"):
        fit_balance_model(BalanceSamples(L[:2], np.ones(2), np.zeros(2), np.zeros(2, dtype=int)))


@pytest.fixture(scope="module")
def small_trace():
    phases = [Phase("bundled:decode_in1000out1000", 30), Phase("bundled:prefill_in4096", 30)]
    return build_trace(phases, gpus=16, tokens_per_gpu=64, top_k=8, seed=0).counts[:, :12]


def test_calibration_on_real_loads_gives_a_usable_profile(small_trace):
    profile, fit = calibrate_model([small_trace], num_gpus=16, vmax=2, window=10)
    assert profile.provenance.source == "model-calibration"
    assert profile.provenance.fit_r2 == pytest.approx(fit.r2)
    # More imbalance leaves more to gain (α < 0); more vExperts gain more (β > 0).
    assert fit.alpha < 0 and fit.beta > 0
    assert fit.r2 > 0.5
    samples = collect_balance_samples(small_trace, 16, vmax=2, window=10)
    assert set(np.unique(samples.vexperts)) == {1.0, 2.0}
    assert (samples.balance_before + samples.delta <= 1.0 + 1e-6).all()
    message = termination_message(profile)
    assert len(message.encode()) <= 4096
    assert parse_profile(json.loads(message)).load_balance == profile.load_balance


@pytest.mark.parametrize(
    ("counts", "gpus", "kwargs", "field"),
    [
        (np.ones((20, 4)), 4, {}, "--trace"),
        (-np.ones((20, 2, 8)), 4, {}, "--trace"),
        (np.ones((20, 2, 8)), 3, {}, "--gpus"),
        (np.ones((5, 2, 8)), 4, {}, "--trace"),
        (np.ones((20, 2, 8)), 4, {"vmax": 0}, "--vmax"),
        (np.ones((20, 2, 8)), 4, {"evaluate": "later"}, "--evaluate"),
    ],
)
def test_bad_traces_are_rejected_clearly(counts, gpus, kwargs, field):
    with pytest.raises(VExpertInputError) as info:
        collect_balance_samples(counts, gpus, **kwargs)
    assert info.value.field == field


def test_perturbed_profile_changes_one_parameter():
    base = PerformanceProfile()
    p = perturbed(base, "eta", 1.2)
    assert p.hardware.contention_eta == pytest.approx(0.19 * 1.2)
    assert p.load_balance == base.load_balance
    assert perturbed(base, "alpha", 0.8).load_balance.alpha == pytest.approx(-0.6)


def test_sensitivity_table_shape(small_trace):
    table = sensitivity(small_trace, SimulationConfig(num_gpus=16, num_nodes=2), error=0.2)
    assert set(table) == {"alpha", "beta", "intercept", "h2d_bandwidth", "eta"}
    for row in table.values():
        assert set(row) == {"-20%", "+20%"}
        assert all(abs(v) < 0.5 for v in row.values())


def test_nearly_uniform_loads_are_refused_as_ill_conditioned_not_a_traceback():
    # balance barely varies: the design has full rank, but the coefficients come out huge
    rng = np.random.default_rng(0)
    counts = (100_000 + rng.integers(0, 3, (200, 4, 8))).astype(np.int64)
    with pytest.raises(VExpertInputError, match="ill-conditioned") as info:
        calibrate_model([counts], num_gpus=4)
    assert info.value.field == "--trace"


def test_windows_are_spread_over_the_whole_trace():
    # 47 windows of k = 2, 24 used: they must reach the end of the trace, not stop at window 24
    counts = np.ones((96, 2, 8))
    counts[:, :, 0] = 50  # skewed, so the samples vary
    samples = collect_balance_samples(counts, 4, vmax=1, window=2, max_windows=24)
    assert samples.delta.shape[0] == 24 * 2
    from vexpert_runtime.calibration import model_fit

    starts = []
    original = model_fit.allocate

    def spy(plan_counts, *args, **kwargs):
        starts.append(plan_counts)
        return original(plan_counts, *args, **kwargs)

    model_fit.allocate = spy
    try:
        ramp = np.ones((96, 2, 8)) * np.arange(96).reshape(-1, 1, 1)  # window i sums to a distinct value
        ramp[:, :, 0] += 500
        collect_balance_samples(ramp, 4, vmax=1, window=2, max_windows=24)
    finally:
        model_fit.allocate = original
    first_iterations = sorted({round(float(s[0, 1]) / 2 - 0.5) for s in starts})
    assert len(first_iterations) == 24 and first_iterations[0] == 0 and first_iterations[-1] == 46 * 2


def test_model_calibration_output_file_is_a_profile(tmp_path, small_trace):
    from vexpert_runtime.cli import main
    from vexpert_runtime.policy.profile import load_profile

    trace = tmp_path / "t.npz"
    np.savez(trace, counts=small_trace)
    out = tmp_path / "model.json"
    assert main(["calibrate", "model", "--trace", str(trace), "--gpus", "16", "--output", str(out)]) == 0
    profile = load_profile(out)  # what --profile / --model-profile read
    fit = profile.provenance.measurements["fit"]
    assert fit["alpha"] == pytest.approx(profile.load_balance.alpha) and fit["samples"] > 0


def test_profiles_refuse_infinite_or_nan_parameters():
    for field, value in (("compute_bound_tokens_per_expert", float("inf")), ("h2d_bandwidth_gb_per_s", float("nan"))):
        with pytest.raises(VExpertInputError, match=field):
            parse_profile({"hardware": {field: value}})
