"""Trace simulator: policies, determinism, the DeepSeek-V3 acceptance run, CLI behaviour."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from vexpert_runtime.cli import main
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, static_placement
from vexpert_runtime.simulation.simulate import SimulationConfig, simulate, summarize
from vexpert_runtime.simulation.trace import Phase, build_trace, save_trace

PHASES = [
    Phase("bundled:decode_in1000out1000", 200),
    Phase("bundled:prefill_in4096", 200),
    Phase("bundled:decode_in500out1500", 200),
]


@pytest.fixture(scope="module")
def deepseek_trace():
    return build_trace(PHASES, gpus=64, tokens_per_gpu=256, top_k=8, seed=0)


@pytest.fixture(scope="module")
def deepseek_results(deepseek_trace):
    # vexpert-k1, b3-offload and bound have tests of their own on small traces
    cfg = SimulationConfig(num_gpus=64, num_nodes=8, compare_eplb_policies=True,
                           policies=("static", "eplb", "eplb-redundant", "vexpert", "vexpert-future"))
    results = simulate(deepseek_trace.counts, cfg)
    return results, summarize(results)


def test_acceptance_vexpert_beats_eplb_on_real_deepseek_loads(deepseek_results):
    _, summary = deepseek_results
    vexpert = summary["vexpert"]["balance_mean"]
    assert vexpert >= 0.85
    for name in ("eplb-redundant:hierarchical", "eplb-redundant:global", "eplb", "static"):
        assert vexpert > summary[name]["balance_mean"], name
    assert summary["vexpert"]["dispatch"] == "allreduce"  # the model's pick: the all-reduce costs < 2 ms/iteration
    assert summary["vexpert-future"]["balance_mean"] >= vexpert - 0.01
    assert summary["static"]["balance_mean"] < 0.4
    assert summary["vexpert"]["predicted_relative_throughput"] > 1.2
    assert summary["eplb"]["rebalance_stalls"] == 2  # at iterations 200 and 400


def test_static_policy_matches_direct_computation(deepseek_trace, deepseek_results):
    results, _ = deepseek_results
    counts = torch.as_tensor(deepseek_trace.counts[:20], dtype=torch.float32)
    direct = balance_ratio(base_gpu_loads(counts, static_placement(58, 256, 64), 64)).numpy()
    np.testing.assert_allclose(results["static"].balance[:20], direct, rtol=1e-5)


def test_vexpert_uses_only_the_past():
    # Two phases whose hot experts differ: the first k iterations of a phase cannot be fixed by a
    # policy that only sees the past, but vexpert-future can.
    rng = np.random.default_rng(0)
    counts = np.zeros((40, 2, 32), dtype=np.int64)
    for t in range(40):
        hot = 3 if t < 20 else 17
        p = np.full(32, 1.0)
        p[hot] = 40.0
        counts[t] = rng.multinomial(20_000, p / p.sum(), size=2)
    cfg = SimulationConfig(num_gpus=8, allocation_interval=10, policies=("static", "vexpert", "vexpert-future"), vmax=2)
    r = simulate(counts, cfg)
    vex, oracle = r["vexpert"].balance.mean(1), r["vexpert-future"].balance.mean(1)
    assert vex[:10].mean() == pytest.approx(r["static"].balance[:10].mean(1).mean())  # no history yet
    assert vex[20:30].mean() < vex[30:40].mean() - 0.1  # stale plan right after the switch
    assert oracle[20:30].mean() > vex[20:30].mean() + 0.1


def test_deterministic_per_seed(tmp_path):
    small = [Phase("bundled:decode_in1000out1000", 15), Phase("bundled:prefill_in4096", 15)]
    cfg = SimulationConfig(num_gpus=16, num_nodes=2, eplb_interval=10)
    a = summarize(simulate(build_trace(small, 16, 64, 8, seed=5).counts, cfg))
    b = summarize(simulate(build_trace(small, 16, 64, 8, seed=5).counts, cfg))
    # another seed changes the trace; two cheap policies are enough to see it
    few = SimulationConfig(num_gpus=16, num_nodes=2, eplb_interval=10, policies=("static", "eplb"))
    c = summarize(simulate(build_trace(small, 16, 64, 8, seed=6).counts, few))
    strip = lambda s: {p: {k: v for k, v in d.items() if k != "plan_ms_median"} for p, d in s.items()}  # noqa: E731
    assert strip(a) == strip(b)
    assert {p: strip(a)[p] for p in c} != strip(c)


def _trace_file(tmp_path, gpus=8, iterations=30):
    trace = build_trace([Phase("bundled:decode_in1000out1000", iterations)], gpus, 32, 8, seed=1)
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    return path


def test_cli_json_shape_and_plot(tmp_path, capsys):
    path = _trace_file(tmp_path)
    plot = tmp_path / "b.png"
    assert main(["simulate", str(path), "--gpus", "8", "--json", "--eplb-interval", "10", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"static", "eplb", "eplb-redundant", "b3-offload", "vexpert-k1", "vexpert",
                                    "vexpert-future", "bound"}
    for name, stats in out["policies"].items():
        for key in ("balance_mean", "balance_p10", "worst_layer", "vexperts_per_iteration", "predicted_relative_throughput",
                    "predicted_tokens_per_s_per_gpu", "batch_per_gpu", "dispatch"):
            assert key in stats
        assert (stats["predicted_tokens_per_s_per_gpu"] is None) == (name == "bound")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The CLI's exit code and stderr for ``args``, run in this process (a process per case cost ~3 s of
    torch import each; the first case runs the real ``python -m vexpert_runtime``)."""
    if args[:2] == ["simulate", "/nonexistent/trace.npz"]:
        proc = subprocess.run([sys.executable, "-m", "vexpert_runtime", *args], capture_output=True, text=True,
                              timeout=120)
        return proc.returncode, proc.stderr
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["simulate", "/nonexistent/trace.npz", "--gpus", "8"], "does not exist"),
        (["simulate", "{trace}", "--gpus", "7"], "cannot be split evenly over 7 GPUs"),
        (["simulate", "{trace}", "--gpus", "8", "--policies", "magic"], "unknown policy"),
        (["simulate", "{trace}", "--gpus", "8", "--policies", "oracle"], "renamed"),
        (["simulate", "{trace}", "--gpus", "8", "--warmup", "30"], "--warmup"),
        (["simulate", "{trace}", "--gpus", "8", "--eplb-sweep", "10,x"], "--eplb-sweep"),
        (["simulate", "{bad_shape}", "--gpus", "8"], "counts"),
        (["simulate", "{negative}", "--gpus", "8"], "negative"),
        (["trace", "build", "--phase", "nope.json:10", "--gpus", "8", "-o", "{out}"], "nope.json"),
        (["trace", "build", "--phase", "bundled:decode_in1000out1000:0", "--gpus", "8", "-o", "{out}"], "iterations"),
        (["bench", "allocator", "--experts", "256", "--gpus", "60"], "cannot be split evenly"),
        # output paths are checked before the work, not after it
        (["trace", "build", "--phase", "bundled:decode_in1000out1000:5", "--gpus", "8", "-o", "/nonexistent/t.npz"],
         "--output: directory /nonexistent does not exist"),
        (["simulate", "{trace}", "--gpus", "8", "--plot", "/nonexistent/p.png"], "--plot: directory /nonexistent"),
        (["calibrate", "model", "--trace", "{trace}", "--gpus", "8", "--output", "/nonexistent/m.json"],
         "--output: directory /nonexistent"),
        (["simulate", "{trace}", "--gpus", "8", "--profile", "{not_utf8}"], "is not UTF-8 text"),
    ],
)
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, args, needle):
    trace = _trace_file(tmp_path)
    bad_shape = tmp_path / "bad_shape.npz"
    np.savez(bad_shape, counts=np.ones((4, 32), dtype=np.int64))
    negative = tmp_path / "negative.npz"
    np.savez(negative, counts=-np.ones((4, 2, 32), dtype=np.int64))
    not_utf8 = tmp_path / "profile.json"
    not_utf8.write_bytes(b"\xff\xfe{}")
    subs = {"{trace}": str(trace), "{bad_shape}": str(bad_shape), "{negative}": str(negative),
            "{out}": str(tmp_path / "o.npz"), "{not_utf8}": str(not_utf8)}
    code, err = _cli_error([subs.get(a, a) for a in args], capsys)
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_copies_stream_layer_ahead_and_wait_for_overlapping_slots():
    from vexpert_runtime.policy.perf_model import InferenceConstants, h2d_time, layer_time
    from vexpert_runtime.policy.profile import PerformanceProfile
    from vexpert_runtime.simulation.simulate import PolicyResult, predicted_total_time

    consts, profile = InferenceConstants(), PerformanceProfile()
    eta = profile.hardware.contention_eta

    def total(v: list[list[int]], slots: int) -> float:
        balance = np.full((len(v), len(v[0])), 0.5)
        return predicted_total_time(PolicyResult("x", balance, np.array(v), slots=slots), consts, profile)

    compute = float(layer_time(torch.tensor(0.5), consts, profile.hardware)) + consts.other_time_per_layer_s
    one = float(h2d_time(torch.tensor(1.0), consts, profile.hardware))
    assert one < compute < 2 * one  # one copy hides behind one layer, two do not
    plain = total([[0, 0, 0, 0]], 2)
    assert plain == pytest.approx(4 * compute)
    # one vExpert per layer in S = 2 alternating slots: each hides behind the layer before it
    assert total([[1, 1, 1, 1]], 2) == pytest.approx(plain + 4 * one * eta)
    # two per layer in S = 4: longer than the layer they hide behind, the rest is exposed
    assert total([[2, 2, 2, 2]], 4) == pytest.approx(plain + 4 * (compute * eta + 2 * one - compute))
    # two per layer in S = 2 (adjacency broken): every layer's copies wait for the one before
    assert total([[2, 2, 2, 2]], 2) == pytest.approx(plain + 4 * 2 * one)
    # plan switch: the old plan's layer 3 and the new plan's layer 0 (2 + 2 > S) overlap
    switch = total([[0, 0, 0, 2], [2, 0, 0, 0]], 2)
    assert switch == pytest.approx(2 * plain + (compute * eta + 2 * one - compute) + 2 * one)
    assert total([[0, 0, 0, 1], [1, 0, 0, 0]], 2) == pytest.approx(2 * plain + 2 * one * eta)
    # L odd: layers 2 and 0 both fill from the bottom, so layer 0's copy waits for layer 2
    assert total([[1, 0, 1]], 2) == pytest.approx(3 * compute + one * eta + one)
    # slots = 0: no layout modelled, copies never wait
    assert total([[2, 2, 2, 2]], 0) == pytest.approx(total([[2, 2, 2, 2]], 4))


def test_simulated_vexpert_keeps_the_adjacency_bound_unless_turned_off():
    from vexpert_runtime.simulation.simulate import SimulationConfig, simulate

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(32, 0.15), size=6)
    counts = np.stack([rng.multinomial(4000, p) for p in probs for _ in range(1)]).reshape(1, 6, 32).repeat(20, 0)
    for bound in (True, False):
        cfg = SimulationConfig(num_gpus=8, allocation_interval=5, vmax=1, policies=("static", "vexpert"),
                               adjacency_bound=bound, balance_threshold=1.0)
        v = simulate(counts, cfg)["vexpert"].vexperts
        pairs = v + np.roll(v, -1, axis=1)  # (l, l+1) and the wrap (L = 6, even)
        if bound:
            assert (pairs <= 2).all()
        assert v.sum() > 0


def test_a_trace_simulated_on_other_gpus_keeps_its_tokens_per_iteration():
    from vexpert_runtime.commands.simulate import _trace_tokens_per_gpu

    assert _trace_tokens_per_gpu({"gpus": 32, "tokens_per_gpu": 512}, 32) == 512
    assert _trace_tokens_per_gpu({"gpus": 32, "tokens_per_gpu": 512}, 64) == 256
    assert _trace_tokens_per_gpu({}, 64) == 256


# --------------------------------------------------------------------------------------------
# Issue #14: per-iteration dispatch, fair baselines, bound, HBM
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jittered_small():
    from vexpert_runtime.simulation.trace import Variation

    phases = [Phase("bundled:decode_in1000out1000", 23), Phase("bundled:prefill_in4096", 17)]
    return build_trace(phases, 8, 64, 8, seed=2, variation=Variation(jitter=2048)).counts


def _plan_for(counts):
    from vexpert_runtime.policy.allocator import AllocatorConfig, allocate

    window = torch.as_tensor(counts[:10].sum(0), dtype=torch.float32)
    return allocate(window, static_placement(58, 256, 8), 8, AllocatorConfig(balance_threshold=1.0))


def test_dispatch_keeps_tokens_on_holders_and_all_reduced_counts_balance_best(jittered_small):
    from vexpert_runtime.simulation.simulate import dispatch_loads

    plan = _plan_for(jittered_small)
    counts = torch.as_tensor(jittered_small[10:20], dtype=torch.float32)
    share = plan.expert_gpu_share()
    got = {}
    for mode in ("plan", "local", "allreduce"):
        loads = dispatch_loads(counts, share, plan.replica_gpu, mode, 6, torch.Generator().manual_seed(0))
        torch.testing.assert_close(loads.sum(-1), counts.sum(-1))  # every token served once
        # a GPU never serves more than the experts it holds a copy of
        holds = torch.zeros(*plan.replica_gpu.shape[:2], 9).scatter_(-1, plan.replica_gpu.clamp(min=-1) % 9, 1.0)[..., :8]
        held = torch.einsum("tle,len->tln", counts, holds)
        assert bool((loads <= held + 1e-3).all())
        got[mode] = float(balance_ratio(loads).mean())
    assert got["allreduce"] > got["plan"]
    assert got["allreduce"] >= got["local"] - 0.005


def test_split_over_ranks_conserves_tokens():
    from vexpert_runtime.simulation.simulate import split_over_ranks

    counts = torch.tensor([[100.0, 0.0, 7.0], [64.0, 5.0, 1.0]])
    parts = split_over_ranks(counts, 4, torch.Generator().manual_seed(0))
    assert parts.shape == (4, 2, 3)
    torch.testing.assert_close(parts.sum(0), counts)
    assert bool((parts >= 0).all()) and float(parts[:, 0, 0].min()) > 5  # ~25 each, not all on one rank


def test_holders_from_share():
    from vexpert_runtime.simulation.simulate import holders_from_share

    share = torch.tensor([[[1.0, 0, 0], [0, 0.5, 0.5], [0.25, 0, 0.75]]])
    assert holders_from_share(share).tolist() == [[[0, -1], [1, 2], [0, 2]]]


def test_the_model_picks_local_dispatch_when_the_all_reduce_is_slow(jittered_small):
    from vexpert_runtime.policy.profile import HardwareParameters, PerformanceProfile
    from vexpert_runtime.simulation.simulate import choose_dispatch, dispatch_loads

    plan = _plan_for(jittered_small)
    past = torch.as_tensor(jittered_small[9:10], dtype=torch.float32)

    def pick(latency: float) -> str:
        profile = PerformanceProfile(hardware=HardwareParameters(allreduce_latency_s=latency))
        consts = InferenceConstants(tokens_per_gpu=64, experts_per_gpu=32)
        return choose_dispatch(past, plan.expert_gpu_share(), plan.replica_gpu, 6, consts, profile,
                               torch.Generator().manual_seed(0))

    def balance(mode: str) -> float:
        loads = dispatch_loads(past, plan.expert_gpu_share(), plan.replica_gpu, mode, 6, torch.Generator().manual_seed(0))
        return float(balance_ratio(loads).sum())

    # a free all-reduce: the better-balanced mode wins (rank-local costs nothing extra either way)
    assert pick(0.0) == ("allreduce" if balance("allreduce") > balance("local") + 1e-6 else "local")
    assert pick(5e-3) == "local"  # 5 ms per layer: never worth it


def test_eplb_sweep_stalls_warm_start_and_dispatch(jittered_small):
    cfg = SimulationConfig(num_gpus=8, num_nodes=1, policies=("static", "vexpert"), eplb_sweep=(10, 20),
                           eplb_policy="global", warmup=5)
    r = simulate(jittered_small, cfg)
    scored = jittered_small.shape[0] - 5
    assert all(res.balance.shape[0] == scored for res in r.values())
    # warm plan at 5 (no stall), then a rebalance every interval
    assert r["eplb-redundant:global@10"].stalls == len(range(15, 40, 10))
    assert r["eplb-redundant:global@20"].stalls == len(range(25, 40, 20))
    assert r["eplb-redundant:global@10+allreduce"].stalls == r["eplb-redundant:global@10"].stalls
    for interval in (10, 20):
        plain, fed = r[f"eplb-redundant:global@{interval}"], r[f"eplb-redundant:global@{interval}+allreduce"]
        assert fed.balance.mean() > plain.balance.mean()
    # the warm start gives vExpert a plan from the first scored iteration on
    assert r["vexpert"].balance[:5].mean() > r["static"].balance[:5].mean() + 0.05
    assert r["vexpert"].allocations == len(range(15, 40, 10))  # the warm plan is not charged


def test_bound_is_above_every_vexpert_policy_and_b3_keeps_static_balance(jittered_small):
    cfg = SimulationConfig(num_gpus=8, policies=("static", "b3-offload", "vexpert-k1", "vexpert", "vexpert-future", "bound"))
    r = simulate(jittered_small, cfg)
    bound = r["bound"].balance.mean(1)
    for name in ("vexpert-k1", "vexpert", "vexpert-future", "static"):
        assert (bound >= r[name].balance.mean(1) - 1e-4).all(), name
    np.testing.assert_allclose(r["b3-offload"].balance, r["static"].balance)
    assert (r["b3-offload"].vexperts == 1).all()
    from vexpert_runtime.simulation.simulate import slot_budget_bound

    counts = torch.as_tensor(jittered_small[:3], dtype=torch.float32)
    base = static_placement(58, 256, 8)
    torch.testing.assert_close(slot_budget_bound(counts, base, 8, 0), balance_ratio(base_gpu_loads(counts, base, 8)))


def test_hbm_decides_the_batch_and_the_throughput(jittered_small):
    from vexpert_runtime.policy.profile import HardwareParameters, PerformanceProfile

    cfg = SimulationConfig(num_gpus=8, policies=("static", "eplb-redundant", "b3-offload", "vexpert"))
    r = simulate(jittered_small, cfg)
    consts = InferenceConstants(tokens_per_gpu=64, experts_per_gpu=32)
    s = summarize(r, PerformanceProfile(), consts, 256, 8)
    assert s["static"]["batch_per_gpu"] == pytest.approx(64)
    # EPLB's redundant expert per GPU in each of 58 layers (5.1 GB) costs far more KV cache than vExpert's 2 slots
    assert s["eplb-redundant"]["batch_per_gpu"] < s["vexpert"]["batch_per_gpu"] < 64 < s["b3-offload"]["batch_per_gpu"]
    assert s["eplb-redundant"]["resident_expert_gb_per_gpu"] == pytest.approx(58 * consts.expert_bytes / 1e9)
    off = summarize(r, PerformanceProfile(hardware=HardwareParameters(hbm_gb=0)), consts, 256, 8)
    assert off["eplb-redundant"]["batch_per_gpu"] == pytest.approx(64)
    assert off["eplb-redundant"]["predicted_tokens_per_s_per_gpu"] > s["eplb-redundant"]["predicted_tokens_per_s_per_gpu"]


def test_allocation_cost_comes_from_the_profile():
    from vexpert_runtime.policy.perf_model import allocation_time, allreduce_time, dispatch_time
    from vexpert_runtime.policy.profile import HardwareParameters

    hw = HardwareParameters(allocator_time_s=1e-3, allreduce_latency_s=20e-6, allreduce_bandwidth_gb_per_s=10.0)
    expected = 1e-3 + 20e-6 + 4 * 58 * 256 / 10e9
    assert allocation_time(InferenceConstants(), hw, 58, 256) == pytest.approx(expected)
    assert allocation_time(InferenceConstants(allocation_time_s=0.011), hw, 58, 256) == 0.011
    assert dispatch_time("plan", 256, hw) == 0.0
    assert dispatch_time("allreduce", 256, hw) == pytest.approx(hw.dispatch_time_per_layer_s + allreduce_time(1024, hw))
