"""Per-iteration replica dispatch (``ep_moe_layer(dispatch=plan|local|global)``): the water-filling
functions on one rank, outputs equal to the reference in every mode on 4 and 2 gloo ranks, measured
balance better than the plan's fixed shares on a batch the plan was not made for, the mode choice,
and a node run in each mode verified against the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from runtime_support import TINY_DEEPSEEK_SPEC, run_in_triton_interpreter
from test_runtime_ep_moe import (
    DS,
    SKEW,
    TOKENS,
    WORLD,
    _by_case,
    _check_exact,
    _random_plan,
    _run_rank,
    plan_for_skew,
)
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.model.dispatch import (
    _DRY,
    DISPATCH_MODES,
    choose_dispatch,
    cumulative_shares,
    dispatch_cum_share,
    gpu_loads,
    layer_counts,
    level_shares,
    plan_shares,
    water_fill,
)
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    choose_replicas,
    max_replicas,
    plan_from_slots,
    table_from_plan,
)
from vexpert_runtime.model.levelling import list_replica_copies
from vexpert_runtime.node import NodeOptions, resolve_setup, run_node
from vexpert_runtime.policy.placement import balance_ratio, static_placement
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload

# The plan is made for this skew; the batches route with SKEW (hot experts swapped around), so the
# plan's copies sit on the right experts but its shares are stale — per-iteration noise, enlarged.
REPO = Path(__file__).resolve().parents[1]
PLAN_SKEW = torch.tensor([1.5, 3.0, 2.0, 0, 0, 0, 2.5, 0, 0, 0, 0, 0, 0, 0, 0, 0])


# ------------------------------------------------------------------------------------------------
# One rank: the pure functions
# ------------------------------------------------------------------------------------------------


def test_water_fill_pours_to_one_level_and_keeps_dry_bins_dry() -> None:
    floor = torch.tensor([[1.0, 5.0, 3.0, _DRY], [0.0, 0.0, _DRY, _DRY]])
    fill = water_fill(floor, torch.tensor([4.0, 3.0]), 1.0 / torch.arange(1, 5, dtype=torch.float32))
    assert torch.allclose(fill, torch.tensor([[3.0, 0.0, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))


def test_level_shares_levels_gpus_from_the_counts() -> None:
    # GPU 0: expert 0 (10 tokens, copy on GPU 1) and expert 1 (2); GPU 1: expert 2 (6). Level = 9 each.
    gpu = torch.tensor([[0, 1, -1], [0, -1, -1], [1, -1, -1]])
    counts = torch.tensor([10, 2, 6])
    share = level_shares(counts, gpu, 2, sweeps=30)
    assert torch.allclose(share[0], torch.tensor([0.7, 0.3, 0.0]), atol=1e-3)
    assert torch.allclose(gpu_loads(counts, gpu, share, 2), torch.tensor([9.0, 9.0]), atol=1e-2)
    # a few sweeps from the plan's (stale) shares already get most of the way
    stale = torch.tensor([[0.2, 0.8, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    before = balance_ratio(gpu_loads(counts, gpu, stale, 2))
    after = balance_ratio(gpu_loads(counts, gpu, level_shares(counts, gpu, 2, start=stale), 2))
    assert after > before + 0.2 and after > 0.95  # momentum overshoots a little on a lone expert


def test_level_shares_without_tokens_gives_proper_splits() -> None:
    gpu = torch.tensor([[0, 1, 2], [1, -1, -1], [2, 0, -1]])
    share = level_shares(torch.zeros(3), gpu, 3)
    assert torch.isfinite(share).all()
    assert torch.allclose(share.sum(-1), torch.ones(3))
    assert (share[gpu < 0] == 0).all()
    cum = cumulative_shares(share, gpu)
    assert cum[0, 2] == 1.0 and cum[1, 1] == float("inf")


def test_plan_shares_invert_the_tables_cumulative_shares() -> None:
    plan = _random_plan(2, 16, 3, seed=5)
    table = table_from_plan(plan, 1)
    cum = torch.from_numpy(table.cum_share)
    share = plan_shares(cum)
    expected = plan.replica_share * (plan.replica_gpu >= 0)
    assert torch.allclose(share, expected.to(torch.float32), atol=1e-6)
    assert torch.equal(cumulative_shares(share, torch.from_numpy(table.gpu)).isinf(), cum.isinf())


def test_plan_mode_and_single_copy_tables_return_the_plans_table() -> None:
    gpu = torch.tensor([[0], [1]])
    cum = torch.ones(2, 1, dtype=torch.float64)
    ids = torch.tensor([[0, 1]])
    for mode in DISPATCH_MODES:
        assert dispatch_cum_share(mode, ids, gpu, cum, 2, None) is cum
    with pytest.raises(ValueError, match="not one of"):
        dispatch_cum_share("nearest", ids, torch.tensor([[0, 1], [1, -1]]), cum.expand(2, 2), 2, None)  # type: ignore[arg-type]


def test_an_eager_layer_without_replicas_skips_the_global_all_reduce() -> None:
    """A CPU (eager) layer whose table is wide (slots exist) but replicates nothing returns the plan's
    shares without touching the group — every rank reads the same table, so all skip together — while a
    layer with a replicated expert all-reduces (here: a group that cannot, so it raises)."""
    not_a_group = object()  # any collective on it fails
    cum = torch.tensor([[1.0, float("inf")], [1.0, float("inf")]], dtype=torch.float64)
    ids = torch.tensor([[0, 1]])
    unreplicated = torch.tensor([[0, -1], [1, -1]])
    assert dispatch_cum_share("global", ids, unreplicated, cum, 2, not_a_group) is cum  # type: ignore[arg-type]
    replicated = torch.tensor([[0, 1], [1, -1]])
    with pytest.raises(AttributeError, match="allreduce"):  # the collective reached the bogus group
        dispatch_cum_share("global", ids, replicated, torch.tensor([[0.5, 1.0], [1.0, float("inf")]],
                                                                    dtype=torch.float64), 2, not_a_group)  # type: ignore[arg-type]


def test_auto_picks_global_when_the_all_reduce_is_cheaper_than_the_balance_it_buys() -> None:
    assert choose_dispatch("auto", world=8, slots=0, nodes=1, device="cuda")[0] == "plan"
    assert choose_dispatch("auto", world=1, slots=2, nodes=1, device="cuda")[0] == "plan"
    assert choose_dispatch("auto", world=8, slots=2, nodes=1, device="cuda")[0] == "global"  # NVLink: ~10 µs
    assert choose_dispatch("auto", world=64, slots=2, nodes=8, device="cuda")[0] == "local"  # network: ~25 µs
    assert choose_dispatch("auto", world=4, slots=2, nodes=1, device="cpu")[0] == "global"
    mode, why = choose_dispatch("auto", world=8, slots=2, nodes=1, device="cuda", allreduce_us=50)
    assert mode == "local" and "50 µs" in why
    assert choose_dispatch("auto", world=64, slots=2, nodes=8, device="cuda", moe_layer_us=2000)[0] == "global"
    assert choose_dispatch("local", world=1, slots=0, nodes=1, device="cpu") == ("local", "configured")
    assert RuntimeConfig().vexpert.dispatch == "auto"


# ------------------------------------------------------------------------------------------------
# Gloo ranks: exact in every mode, and better balanced than the plan's shares
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dispatch_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dispatch")
    ckpt = str(root / "ds")
    write_tiny_checkpoint(ckpt, DS, seed=1)
    stale = table_from_plan(plan_for_skew(ckpt, PLAN_SKEW)[0], 1)  # made for PLAN_SKEW, the batches route SKEW
    wide = table_from_plan(_random_plan(2, 16, 3, seed=7), 2)  # random shares, an expert on every GPU
    cases = []
    for mode in DISPATCH_MODES:
        for layer in (0, 1):
            cases.append({"name": f"stale-l{layer}-{mode}", "spec": DS, "ckpt": ckpt, "layer": layer, "seed": 3,
                          "bias": SKEW, "table": stale, "dispatch": mode})
        cases.append({"name": f"random-{mode}", "spec": DS, "ckpt": ckpt, "layer": 0, "seed": 11, "bias": SKEW,
                      "table": wide, "dispatch": mode})
    mp.spawn(_run_rank, args=(free_port(), str(root), cases), nprocs=WORLD, join=True)
    return _by_case(root, WORLD)


def test_every_dispatch_mode_equals_the_reference(dispatch_results: dict[str, list[dict[str, Any]]]) -> None:
    _check_exact(dispatch_results, WORLD)
    for name, rows in dispatch_results.items():
        # every pair computed exactly once, by a copy of its own expert
        assert rows[0]["logical"] == rows[0]["reference_counts"], name
        assert [r["sent"] for r in rows] == [t * DS.top_k for t in TOKENS], name


def _balance(rows: list[dict[str, Any]]) -> float:
    return float(balance_ratio(torch.tensor(rows[0]["loads"], dtype=torch.float32)))


def test_per_iteration_dispatch_balances_better_than_the_plans_shares(
        dispatch_results: dict[str, list[dict[str, Any]]]) -> None:
    for case in ("stale-l0", "stale-l1", "random"):
        plan, local, global_ = (_balance(dispatch_results[f"{case}-{mode}"]) for mode in DISPATCH_MODES)
        assert local > plan, (case, plan, local)
        assert global_ > plan, (case, plan, global_)
        assert global_ >= local - 0.02, (case, local, global_)  # the group's counts level at least as well


def test_two_ranks_every_mode_equals_the_reference(tmp_path: Path) -> None:
    write_tiny_checkpoint(str(tmp_path / "ds"), DS, seed=1)
    ckpt = str(tmp_path / "ds")
    table = table_from_plan(_random_plan(2, 16, 3, 4, world=2), 3)
    cases = [{"name": f"random-{mode}", "spec": DS, "ckpt": ckpt, "layer": 1, "seed": 5, "bias": SKEW, "table": table,
              "dispatch": mode} for mode in DISPATCH_MODES]
    mp.spawn(_run_rank, args=(free_port(), str(tmp_path), cases, 2), nprocs=2, join=True)
    _check_exact(_by_case(tmp_path, 2), 2)


def test_one_rank_global_needs_no_group() -> None:
    # N = 1 with slots: R = 1, nothing to split; a wider table still runs without a group
    assert max_replicas(1, 2) == 1
    gpu = torch.tensor([[0, 1], [1, -1], [0, -1], [1, 0]])
    plan = plan_from_slots(static_placement(1, 4, 2), torch.tensor([[[3]], [[0]]]))
    cum = torch.from_numpy(table_from_plan(plan, 1).cum_share[0])
    out = dispatch_cum_share("global", torch.tensor([[0, 3], [0, 1]]), gpu, cum, 2, None)
    assert out.shape == (4, 2) and out.dtype == torch.float64


# ------------------------------------------------------------------------------------------------
# A node in each mode
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", DISPATCH_MODES)
def test_node_runs_each_dispatch_mode_and_verifies(tmp_path: Path, mode: str) -> None:
    write_tiny_checkpoint(tmp_path / "ckpt", TINY_DEEPSEEK_SPEC, seed=2)
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(tmp_path / "ckpt"), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95, "dispatch": mode},
        "tuning": {"allocation_interval": 3},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    })
    setup = resolve_setup(config, tmp_path / "ckpt")
    assert setup.dispatch == mode
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=16)
    report = run_node(setup, NodeOptions(workload=workload, iterations=12, verify=True))
    assert report.iterations == 12 and report.dispatch == mode
    assert report.max_rel_error is not None and report.max_rel_error < 1e-4
    assert f'vexpert_dispatch_mode{{mode="{mode}"}} 1.0' in report.metrics_text
    assert any((t.slot_expert >= 0).any() for t in report.tables.values())  # replicas were split


# ------------------------------------------------------------------------------------------------
# The GPU benchmark's CPU twin
# ------------------------------------------------------------------------------------------------


def test_the_dispatch_cost_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "dispatch_cost.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dispatch_cost.py"), "--cpu", "--reps", "2",
                           "--sweeps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["shape"]["replicas"] == max_replicas(64, 2) == 64 and summary["shape"]["replicated_experts"] > 0
    rows = {row["mode"]: row for row in summary["rows"]}
    assert sorted(rows) == sorted(DISPATCH_MODES)
    assert rows["plan"]["kernels_shares"] == 0  # the plan's table is read as it is
    # the batch's own counts level it better than the plan's stale shares
    assert rows["local"]["batch_balance"] > rows["plan"]["batch_balance"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("mode", ["local", "global"])
def test_dispatch_never_synchronises_and_replays_in_a_cuda_graph(mode: str, path: str) -> None:
    """The share computation and replica choice of one layer, through the fused kernel and through
    its torch twin: no host sync (sync debug mode raises on one), captured in a CUDA graph, replays
    equal eager runs for new routings copied in place, and for new plans loaded in place (the
    kernel finds its runs' lengths on the device: a plan with longer runs needs no new capture)."""
    slot_expert = torch.full((1, WORLD, 3), -1)
    slot_expert[0, 0, 0], slot_expert[0, 2, 1] = 5, 13  # two experts with two copies each: runs of 2
    plan = plan_from_slots(static_placement(1, 16, WORLD), slot_expert)
    table = DeviceRoutingTable.of(table_from_plan(plan, 1), "cuda", replicas=max_replicas(WORLD, 3))
    gpu, local, cum = table.gpu[0], table.local[0], table.cum_share[0]
    copies = table.copies(0) if path == "kernel" else None
    ids = torch.randint(0, 16, (64, 4), device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        shares = dispatch_cum_share(mode, ids, gpu, cum, WORLD, None, copies=copies)  # type: ignore[arg-type]
        return choose_replicas(ids, gpu, local, shares, 0, WORLD)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    runs = []
    for seed in range(5):
        ids.copy_(torch.randint(0, 16, (64, 4), generator=torch.Generator().manual_seed(seed)).cuda())
        if seed >= 3:  # a plan switch, to runs of up to 4 copies (an expert on every GPU)
            table.load(table_from_plan(_random_plan(1, 16, 3, seed=seed), 1))
        runs.append(int((table.gpu[0] >= 0).sum(-1).max()))
        graph.replay()
        expected = step()
        assert all(torch.equal(a, b) for a, b in zip(captured, expected, strict=True))
    assert runs == [2, 2, 2, 4, 4]


# ------------------------------------------------------------------------------------------------
# The fused kernel (dispatch_kernel) against its torch twin
# ------------------------------------------------------------------------------------------------


def _deepseek_table(device: str) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """The dispatch benchmark's layer: E = 256 over N = 64 GPUs, 2 slots each, R = 64, a plan made
    for a bundled DeepSeek-V3 load, a batch of 256 tokens routed with that load jittered."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import argparse

    from dispatch_cost import setup  # the benchmark's own setup: the kernel is tested as it is timed

    args = argparse.Namespace(experts=256, gpus=64, slots=2, tokens=256, topk=8, phase="decode_in1000out1000",
                              layer=10, seed=0)
    s = setup(args, torch.device(device))
    return layer_counts(s["ids"], 256), s["table"], s["table"].cum_share[0]


def _small_tables(device: str) -> list[tuple[torch.Tensor, Any, torch.Tensor, int]]:
    """Random valid plans (an expert on every GPU included) with E, R not powers of two."""
    out = []
    for seed, (experts, slots, world) in enumerate(((16, 3, WORLD), (12, 2, 3), (16, 1, 2))):
        table = DeviceRoutingTable.of(table_from_plan(_random_plan(1, experts, slots, seed, world=world), seed), device)
        counts = torch.randint(0, 40, (experts,), generator=torch.Generator().manual_seed(seed))
        counts[int(table.copy_expert[0, 0])] = 0  # a replicated expert without tokens keeps a proper split
        out.append((counts.to(device), table, table.cum_share[0], world))
    return out


def _assert_fused_equals_twin(counts: torch.Tensor, table: Any, cum: torch.Tensor, world: int) -> None:
    from vexpert_runtime.model.dispatch_kernel import fused_cum_shares

    gpu, copies = table.gpu[0], table.copies(0)
    assert int((copies.expert >= 0).sum()) > 2  # replicated experts to split
    for sweeps in (0, 1, 4):
        twin = cumulative_shares(level_shares(counts, gpu, world, sweeps, start=plan_shares(cum)), gpu)
        fused = fused_cum_shares(counts, copies, cum, world, sweeps)
        assert fused.dtype == torch.float64 and fused.shape == gpu.shape
        assert torch.equal(torch.isfinite(fused), gpu >= 0)  # padding inf, as the draw needs
        finite = gpu >= 0
        # float32 rounding (the kernel adds loads in fixed point, the twin in float)
        assert torch.allclose(fused[finite], twin[finite], atol=2e-6), (sweeps, (fused - twin)[finite].abs().max())


def check_fused_kernel_on_cpu() -> None:
    """Run in a subprocess with ``TRITON_INTERPRET=1`` set before Triton is imported (its
    interpreter patches ``tl.sort``/``tl.cumsum`` at import)."""
    for counts, table, cum, world in _small_tables("cpu"):
        _assert_fused_equals_twin(counts, table, cum, world)
    _assert_fused_equals_twin(*_deepseek_table("cpu"), 64)


def test_fused_kernel_equals_its_torch_twin_in_the_interpreter() -> None:
    """The kernel itself, run by Triton's interpreter on CPU tensors (CI has no GPU)."""
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_dispatch", "check_fused_kernel_on_cpu")


def test_replica_copies_list_the_replicated_rows() -> None:
    gpu = np.array([[[0, 1, -1], [1, -1, -1], [2, 0, 1], [2, -1, -1]]])
    expert, copy_gpu, col, step, single = list_replica_copies(gpu, 8)
    assert expert[0].tolist() == [0, 0, 2, 2, 2, -1, -1, -1]
    assert copy_gpu[0, :5].tolist() == [0, 1, 2, 0, 1] and col[0, :5].tolist() == [0, 1, 0, 1, 2]
    # GPUs 0 and 1 hold copies of both replicated experts: step 1 / (0.4 · 2) → 1 (at most a full step)
    assert step[0, :5].tolist() == [1.0] * 5 and step[0, 5:].tolist() == [0.0] * 3
    assert single[0].tolist() == [-1, 1, -1, 2]
    with pytest.raises(ValueError, match="room for 4"):
        list_replica_copies(gpu, 4)


def _replica_copies_by_definition(gpu: np.ndarray, capacity: int) -> tuple[np.ndarray, ...]:
    """list_replica_copies spelled out expert by expert (the damping as level_shares has it)."""
    from vexpert_runtime.model.levelling import DAMPING

    layers, experts, _ = gpu.shape
    expert = np.full((layers, capacity), -1, dtype=np.int32)
    copy_gpu, col = expert.copy(), expert.copy()
    step = np.zeros((layers, capacity), dtype=np.float32)
    single = np.full((layers, experts), -1, dtype=np.int32)
    for layer in range(layers):
        listed = [(e, int(g), c) for e in range(experts) for c, g in enumerate(gpu[layer, e])
                  if g >= 0 and (gpu[layer, e] >= 0).sum() > 1]
        degree: dict[int, int] = {}
        for _, g, _ in listed:
            degree[g] = degree.get(g, 0) + 1
        for i, (e, g, c) in enumerate(listed):
            most = max(degree[int(h)] for h in gpu[layer, e] if h >= 0)
            expert[layer, i], copy_gpu[layer, i], col[layer, i] = e, g, c
            step[layer, i] = 1.0 / max(DAMPING * most, 1.0)
        for e in range(experts):
            if (gpu[layer, e] >= 0).sum() <= 1:
                single[layer, e] = gpu[layer, e, 0]
    return expert, copy_gpu, col, step, single


@pytest.mark.parametrize("width", [1, 2, 4])
def test_replica_copies_equal_their_definition_on_random_tables(width: int) -> None:
    rng = np.random.default_rng(width)
    for gaps in (False, True):  # valid copies first (every table the allocator makes), or not
        gpu = np.where(rng.random((5, 12, width)) < 0.5, rng.integers(0, 4, (5, 12, width)), -1)
        gpu[..., 0] = rng.integers(0, 4, (5, 12))  # the resident copy
        if not gaps:
            gpu = -np.sort(-gpu, axis=-1)  # the valid GPUs first
        got = list_replica_copies(gpu, 64)
        for name, a, b in zip(("expert", "gpu", "col", "step", "single"), got, _replica_copies_by_definition(gpu, 64),
                              strict=True):
            assert np.array_equal(a, b), (width, gaps, name)


def test_fused_kernel_compiles_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel compiles to sm_90 machine code at DeepSeek-V3 shape (Triton ships ptxas:
    no GPU needed), so a kernel the interpreter runs but the compiler rejects fails here, not on the
    H200. The launch's arguments and constants as ``fused_cum_shares`` passes them."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vexpert_runtime.model import dispatch_kernel as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse
    pointers = {"counts_ptr": "*i64", "single_gpu_ptr": "*i32", "expert_ptr": "*i32", "gpu_ptr": "*i32",
                "col_ptr": "*i32", "step_ptr": "*fp32", "cum_ptr": "*fp64", "out_ptr": "*fp64",
                "iscratch_ptr": "*i64", "fscratch_ptr": "*fp32", "E": "i32", "R": "i32", "C": "i32", "TABLE": "i32"}
    common = {"SWEEPS": 4, "BLOCK_E": 256, "BLOCK_C": 256, "BLOCK_N": 128, "COPY_BLOCK": 1024, "TABLE_CHUNKS": 16,
              "MOMENTUM": 0.3, "FIXED": float(2**24)}
    source = ASTSource(fn=kernels.level_cum_shares, signature={**pointers, **dict.fromkeys(common, "constexpr")},
                       constexprs=common)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = compiled.asm["ptx"]
    # the loads' block-scope integer adds: ``atom`` (Triton 3.5) or ``red`` (later: result unused)
    adds = [line for line in ptx.splitlines() if ("atom." in line or "red." in line) and ".cta" in line and ".add" in line]
    assert len(compiled.asm["cubin"]) > 0 and adds and "bar.sync" in ptx


def test_fused_kernel_refuses_lists_past_its_block() -> None:
    pytest.importorskip("triton")
    from vexpert_runtime.model.dispatch_kernel import fused_cum_shares
    from vexpert_runtime.model.levelling import MAX_FUSED_COPIES, ReplicaCopies

    long = torch.zeros(MAX_FUSED_COPIES + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="listed copies"):
        fused_cum_shares(torch.zeros(4), ReplicaCopies(long, long, long, long.float(), torch.zeros(4, dtype=torch.int32)),
                         torch.zeros(4, 2, dtype=torch.float64), 2, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fused_kernel_equals_its_torch_twin_on_the_gpu() -> None:
    from vexpert_runtime.model.dispatch import fused_dispatch_runs

    counts, table, cum = _deepseek_table("cuda")
    assert fused_dispatch_runs(table.copies(0))  # the product path on a GPU at DeepSeek-V3 shape is the kernel
    _assert_fused_equals_twin(counts, table, cum, 64)
    for counts, table, cum, world in _small_tables("cuda"):
        _assert_fused_equals_twin(counts, table, cum, world)
