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
from vexpert_runtime.profile import PerformanceProfile, parse_profile
from vexpert_runtime.simulate import SimulationConfig, perturbed, sensitivity
from vexpert_runtime.trace import Phase, build_trace


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
