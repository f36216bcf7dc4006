"""Performance model (Eq. 1–5, 8) and the PerformanceProfile API type."""

from __future__ import annotations

import json

import pytest
import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.perf_model import (
    DEEPSEEK_V3_EXPERT_BYTES,
    InferenceConstants,
    balance_gain,
    comm_gain,
    compute_gain,
    h2d_time,
    layer_time,
    max_vexperts_hidden,
    normalized_h2d_overhead,
    predicted_layer_time,
)
from vexpert_runtime.policy.profile import (
    HardwareParameters,
    LoadBalanceParameters,
    PerformanceProfile,
    load_profile,
    parse_profile,
)

PAPER = LoadBalanceParameters()


def test_paper_defaults():
    p = PerformanceProfile()
    assert (p.load_balance.alpha, p.load_balance.beta, p.load_balance.intercept) == (-0.75, 0.53, 0.1)
    assert p.hardware.h2d_bandwidth_gb_per_s == 26.0
    assert p.hardware.contention_eta == 0.19
    assert p.hardware.compute_bound_tokens_per_expert == 160.0


def test_balance_gain_is_eq4_clamped():
    L = torch.tensor([0.4, 0.4, 0.4, 0.8, 0.9])
    V = torch.tensor([0, 1, 2, 2, 1])
    delta = balance_gain(L, V, PAPER)
    assert delta[0] == 0  # no vExperts, no gain
    assert delta[1] == pytest.approx(-0.75 * 0.4 + 0.53 + 0.1)
    assert delta[2] == pytest.approx(0.6)  # capped at 1 − L
    assert delta[3] == pytest.approx(0.2)  # raw 0.56 > 1 − 0.8
    assert delta[4] == 0  # raw −0.045: the model never predicts a loss


def test_comm_gain_eq3():
    L, d = torch.tensor([0.4]), torch.tensor([0.36])
    assert comm_gain(L, d).item() == pytest.approx(0.36 / 0.76)


def test_compute_gain_regimes():
    hw = HardwareParameters()
    L, d = torch.tensor([0.4]), torch.tensor([0.3])
    compute_bound = InferenceConstants(tokens_per_gpu=256, top_k=8, experts_per_gpu=4)  # 512/L tokens/expert
    assert compute_gain(L, d, compute_bound, hw).item() == pytest.approx(comm_gain(L, d).item(), rel=1e-5)
    memory_bound = InferenceConstants(tokens_per_gpu=16, top_k=8, experts_per_gpu=8)  # 16/L ≪ 160
    assert compute_gain(L, d, memory_bound, hw).item() == pytest.approx(0.0, abs=1e-6)


def test_h2d_time_and_overhead():
    consts = InferenceConstants()
    hw = HardwareParameters(h2d_bandwidth_gb_per_s=26.0, contention_eta=0.19)
    t = h2d_time(torch.tensor([2]), consts, hw).item()
    assert t == pytest.approx(2 * DEEPSEEK_V3_EXPERT_BYTES / 26e9)
    o = normalized_h2d_overhead(torch.tensor([2]), torch.tensor([t]), consts, hw).item()
    assert o == pytest.approx(0.19)
    assert max_vexperts_hidden(2.5 * DEEPSEEK_V3_EXPERT_BYTES / 26e9, consts, hw) == 2


def test_predicted_time_equals_eq2_and_matches_paper_speedup():
    profile, consts = PerformanceProfile(), InferenceConstants()
    L = torch.tensor([0.43])
    t0 = predicted_layer_time(L, torch.tensor([0]), profile, consts)
    assert t0.item() == pytest.approx(layer_time(L, consts, profile.hardware).item())
    # Eq. 2 by hand for V = 1.
    delta = -0.75 * 0.43 + 0.53 + 0.1
    g1 = delta / (0.43 + delta)
    base_a2a, base_moe = 1e-3 / 0.43, 0.8e-3 / 0.43
    expected = base_a2a + base_moe - base_a2a * g1 - base_moe * g1 + DEEPSEEK_V3_EXPERT_BYTES / 26e9 * 0.19
    assert predicted_layer_time(L, torch.tensor([1]), profile, consts).item() == pytest.approx(expected, rel=1e-5)
    # The default inference constants reproduce the paper's ~1.28× from 0.43 → 0.76 at ~0.7 vExperts/layer.
    before = layer_time(torch.tensor([0.43]), consts, profile.hardware) + consts.other_time_per_layer_s
    after = (layer_time(torch.tensor([0.76]), consts, profile.hardware) + consts.other_time_per_layer_s
             + 0.7 * h2d_time(torch.tensor([1]), consts, profile.hardware) * 0.19)
    assert (before / after).item() == pytest.approx(1.28, abs=0.03)


def test_profile_round_trip(tmp_path):
    p = PerformanceProfile(hardware=HardwareParameters(h2d_bandwidth_gb_per_s=53.7, contention_eta=0.03))
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    back = load_profile(path)
    assert back.hardware.h2d_bandwidth_gb_per_s == 53.7
    assert back == p
    schema = PerformanceProfile.model_json_schema()
    assert "h2d_bandwidth_gb_per_s" in json.dumps(schema)


def test_profile_parameters_ignore_provenance() -> None:
    """The GPU node's allocator keys its compiled graph by the profile's parameters: two profiles
    with the same figures made at different times (a default profile is stamped to the second)
    must share it, or every allocation window would compile and capture again (seen on the H200:
    a second graph for the same shapes and knobs)."""
    from vexpert_runtime.policy.profile import Provenance

    early = PerformanceProfile(provenance=Provenance(created_at="2026-12-01T18:00:00+00:00"))
    late = PerformanceProfile(provenance=Provenance(created_at="2026-12-01T18:00:01+00:00", source="manual"))
    assert early != late and early.parameters_json() == late.parameters_json()
    other = early.with_hardware(HardwareParameters(contention_eta=0.03))
    assert other.parameters_json() != early.parameters_json()
    assert json.loads(early.parameters_json()).keys() == {"load_balance", "hardware"}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"hardware": {"h2d_bandwidth_gb_per_s": -1}}, "hardware.h2d_bandwidth_gb_per_s"),
        ({"hardware": {"bandwidth": 3}}, "hardware.bandwidth"),
        ({"load_balance": {"alpha": "x"}}, "load_balance.alpha"),
        ({"api_version": "v2"}, "api_version"),
    ],
)
def test_bad_profile_names_field(raw, field):
    with pytest.raises(VExpertInputError) as info:
        parse_profile(raw)
    assert field in info.value.field


def test_load_profile_errors(tmp_path):
    with pytest.raises(VExpertInputError, match="no such file"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(VExpertInputError, match="not JSON"):
        load_profile(bad)


def test_times_scale_with_the_batch_as_the_paper_says() -> None:
    # §3.2: communication and computation are bottlenecked by B_max = B / L; the constants are
    # given at B_ref = 256, so at B = 128 both halve (compute-bound), and the GEMM time floors at
    # the memory-bound threshold instead of shrinking further
    from vexpert_runtime.policy.perf_model import a2a_time, moe_time
    from vexpert_runtime.policy.profile import HardwareParameters

    hw = HardwareParameters()
    balance = torch.tensor([0.6])
    at = {b: InferenceConstants(tokens_per_gpu=b) for b in (256, 128, 16)}
    assert float(a2a_time(balance, at[128])) == pytest.approx(float(a2a_time(balance, at[256])) / 2)
    assert float(moe_time(balance, at[128], hw)) == pytest.approx(float(moe_time(balance, at[256], hw)) / 2)
    floor = at[256].moe_time_balanced_s * hw.compute_bound_tokens_per_expert / (256 * 8 / 4)
    assert float(moe_time(balance, at[16], hw)) == pytest.approx(floor)


def test_streamed_copy_cost_hides_overlaps_and_charges_waits() -> None:
    from vexpert_runtime.policy.perf_model import streamed_copy_cost

    copy = torch.tensor([1.0, 3.0, 1.0, 0.0])
    behind = torch.tensor([2.0, 2.0, 2.0, 2.0])
    waits = torch.tensor([False, False, True, True])
    cost = streamed_copy_cost(copy, behind, waits, 0.1)
    # hidden at η; 2 of 3 hidden, 1 exposed; waiting for slots: full; nothing copied: nothing
    assert cost.tolist() == pytest.approx([0.1, 0.2 + 1.0, 1.0, 0.0])
