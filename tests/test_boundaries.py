"""Tests at the boundaries that the rest of the suite leaves slack around (issue #24): each one fails
when the rule at its edge is broken, where a test with room to spare would still pass.

* slot agreement: a rank that is not ready vetoes the plan even when every digest matches;
* KV admission: a prompt whose prefill and first token take exactly the free blocks is admitted, one
  token more waits;
* top-p: a token whose higher-ranked mass equals ``top_p`` exactly is outside the nucleus;
* the model calibration Job's attempt bound (the hardware Job has its own test);
* the EPLB stall's time cost (not only how many stalls);
* the dispatch mode charged to ``static``, and ``auto`` on plans without copies;
* the dispatch twin's sweep count and normalisation, on the CPU, without Triton.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from vexpert_runtime.model.dispatch import (
    SWEEPS,
    cumulative_shares,
    dispatch_cum_share,
    level_shares,
    plan_shares,
)
from vexpert_runtime.model.levelling import DAMPING, MOMENTUM
from vexpert_runtime.node.protocol import Header, agree, decide
from vexpert_runtime.policy.perf_model import InferenceConstants, dispatch_time
from vexpert_runtime.policy.profile import PerformanceProfile
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.kv_cache import BlockPool, KVCacheFull
from vexpert_runtime.serve.sampling import sample_tokens, sampling_tensors
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.step import SamplingSpec, SynchronousSteps
from vexpert_runtime.simulation.simulate import (
    SimulationConfig,
    predicted_tokens_per_s,
    predicted_total_time,
    simulate,
)

# ------------------------------------------------------------------------------------------------
# a. Slot agreement: ready and digest are separate conditions
# ------------------------------------------------------------------------------------------------


def test_a_rank_not_ready_vetoes_the_plan_even_when_every_digest_matches() -> None:
    """A rank whose fill is not ready must not compute with the plan's slots, even if it holds the
    same table as everyone (equal digests): every rank runs degraded."""
    ready, not_ready = [1, 3, 77, 4, 0], [0, 3, 77, 4, 0]  # (ready, plan id, digest, k, stop)
    assert decide(torch.tensor([ready, ready])).use_plan  # the same rows, all ready: the plan runs
    for rows in ([ready, not_ready], [not_ready, ready], [ready, ready, not_ready], [not_ready, not_ready]):
        agreement = decide(torch.tensor(rows))
        assert not agreement.use_plan, rows
        assert (agreement.plan_id, agreement.k, agreement.stop) == (3, 4, False)  # the rest is still agreed
    # one rank, through agree() (no process group): its own readiness counts, not only its digest
    header = Header(iteration=5, plan_id=3, k=4, stop=False, generation=1)
    assert agree(True, header, 77, 1, None).use_plan
    assert not agree(False, header, 77, 1, None).use_plan


# ------------------------------------------------------------------------------------------------
# b. KV admission at exactly the budget
# ------------------------------------------------------------------------------------------------


def test_a_growth_to_exactly_the_free_blocks_fits_and_one_token_more_takes_nothing() -> None:
    pool = BlockPool(num_blocks=9, block_size=4)  # 8 usable blocks, 32 tokens
    pool.add(0)
    pool.grow(0, 12)  # 3 blocks
    pool.add(1)
    with pytest.raises(KVCacheFull):
        pool.grow(1, 21)  # 6 blocks, 5 free
    assert pool.table(1) == [] and pool.free_blocks == 5  # refused whole
    assert len(pool.grow(1, 20)) == 5  # exactly the 5 blocks left
    assert pool.used_blocks == pool.usable_blocks == 8
    pool.add(2)
    with pytest.raises(KVCacheFull):
        pool.grow(2, 1)
    pool.free(0)
    assert len(pool.grow(2, 12)) == 3  # exactly what was freed


class _Model(SynchronousSteps):
    """A StepModel that samples token 1 every time and checks it is given the blocks it needs."""

    vocab_size = 8
    kv_cache_bytes = 0

    def __init__(self, max_context: int, kv_block_size: int, kv_num_blocks: int) -> None:
        self.max_context, self.kv_block_size, self.kv_num_blocks = max_context, kv_block_size, kv_num_blocks
        self.steps: list[list[Any]] = []
        self.released: list[int] = []

    def kv_bytes_per_token(self) -> int:
        return 1

    def step(self, work: Any) -> torch.Tensor:
        self.steps.append(list(work))
        for item in work:
            assert len(item.blocks) * self.kv_block_size >= item.position + len(item.tokens)
        return torch.tensor([1 if item.sample is not None else -1 for item in work], dtype=torch.int64)

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


class _Tok:
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("second_prompt", [3, 4])
def test_a_prompt_is_admitted_when_its_prefill_fits_exactly_and_waits_one_token_more(
    block_size: int, second_prompt: int
) -> None:
    """kv_budget_tokens = 32 (one full context) with a model cache far larger. A 27-token prompt
    wants the blocks of 28 tokens (its prefill and first token); a second prompt of 3 tokens wants
    the 4 left — exactly the rest — and is admitted in the same iteration; one of 4 waits. Both finish:
    when the first grows past what the second leaves, the second (the newest) is preempted, and
    re-admitted once the first is done it prefills its prompt and produced tokens and goes on."""
    budget = 32
    model = _Model(max_context=budget, kv_block_size=block_size, kv_num_blocks=1000)
    config = SchedulerConfig(kv_budget_tokens=budget, max_batch_tokens=32, max_running=4)
    config.check(budget, budget)  # a budget of exactly one full context is a valid configuration
    scheduler = Scheduler(model, _Tok(), config)
    assert scheduler.pool.capacity_tokens() == budget
    events: list[Event] = []
    long = GenerationRequest("long", (2,) * 27, SamplingParams(max_tokens=budget - 27, temperature=0))
    scheduler.submit(long, events.append)
    second = GenerationRequest("second", (1,) * second_prompt, SamplingParams(max_tokens=8, temperature=0))
    scheduler.submit(second, events.append)
    scheduler.run_iteration()
    load = scheduler.load()
    fits = second_prompt == 3
    assert (load.running, load.waiting) == ((2, 0) if fits else (1, 1))
    for _ in range(200):
        if not scheduler.has_work():
            break
        scheduler.run_iteration()
    finished = {e.request_id: e for e in events if e.finished}
    assert finished["long"].finish_reason == "length" and finished["long"].completion_tokens == budget - 27
    assert finished["second"].finish_reason == "length" and finished["second"].completion_tokens == 8
    assert sum(e.new_tokens for e in events if e.request_id == "second") == 8  # each token sent once
    assert scheduler.load().preemptions == (1 if fits else 0)
    assert scheduler.pool.used_blocks == 0 and sorted(set(model.released)) == [0, 1]


# ------------------------------------------------------------------------------------------------
# c. Top-p: the mass above a token equal to top_p exactly
# ------------------------------------------------------------------------------------------------


def _drawable(logits: torch.Tensor, top_p: float, temperature: float = 1.0, draws: int = 300) -> list[set[int]]:
    """Per row of ``logits``, the tokens sample_tokens draws over ``draws`` seeded draws: every draw
    of every row in one batch with the same ``top_p``, a greedy row riding along."""
    rows = logits.shape[0]
    specs = [SamplingSpec(temperature, top_p, 7 + r, d) for d in range(draws) for r in range(rows)]
    batch = torch.cat([logits.repeat(draws, 1), logits[:1]])
    out = sample_tokens(batch, *sampling_tensors([*specs, SamplingSpec()], "cpu"))[:-1].view(draws, rows)
    return [set(out[:, r].tolist()) for r in range(rows)]


def test_a_token_whose_higher_ranked_mass_equals_top_p_exactly_is_outside_the_nucleus() -> None:
    """Exact float masses: four equal tokens (0.25 each, exp(0)/4 is exact) and −inf for the rest.
    The nucleus is the smallest most-likely set whose mass reaches top_p, so at top_p = 0.5 it holds
    two tokens — the third has mass 0.5 above it, equal to top_p, and is out; a hair above 0.5 it is in."""
    inf = float("inf")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -inf, -inf],
                           [-inf, 0.0, -inf, 0.0, 0.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    assert set(probs[probs > 0].tolist()) == {0.25}  # the masses are exact: the boundary is hit, not missed
    for top_p, size in ((0.25, 1), (0.5, 2), (0.75, 3)):
        for tokens in _drawable(logits, top_p):
            assert len(tokens) == size, (top_p, tokens)
        above = float(np.nextafter(np.float32(top_p), np.float32(1.0)))
        for tokens in _drawable(logits, above):
            assert len(tokens) == size + 1, (above, tokens)
    # equal logits stay equal under a temperature: the masses, and so the boundary, stay exact
    for tokens in _drawable(logits, 0.5, temperature=3.0):
        assert len(tokens) == 2


# ------------------------------------------------------------------------------------------------
# e, f. Simulator: what a stall costs, and which dispatch is charged
# ------------------------------------------------------------------------------------------------


def _counts(iterations: int = 30, layers: int = 3, experts: int = 16, seed: int = 0, skew: float = 1.5) -> np.ndarray:
    """A small skewed trace whose hot experts move every 10 iterations (EPLB replans, vExpert copies)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((iterations, layers, experts))
    for t in range(iterations):
        weights = np.arange(experts, 0, -1, dtype=np.float64) ** skew
        weights = np.roll(weights, 3 * (t // 10))
        for layer in range(layers):
            out[t, layer] = rng.multinomial(256, weights / weights.sum())
    return out


def test_each_eplb_stall_costs_eplb_stall_s_of_decode_time() -> None:
    cfg = SimulationConfig(num_gpus=4, num_nodes=1, policies=("static", "eplb"), eplb_interval=10, warmup=0)
    results = simulate(_counts(), cfg)
    eplb = results["eplb"]
    assert eplb.stalls == 2  # replans at 10 and 20 (none at 0: nothing to plan from)
    consts = InferenceConstants(experts_per_gpu=4)
    profile = PerformanceProfile()
    assert consts.eplb_stall_s > 0
    without = predicted_total_time(replace(eplb, stalls=0), consts, profile, 16)
    for stalls in (1, 2, 5):
        cost = predicted_total_time(replace(eplb, stalls=stalls), consts, profile, 16) - without
        assert cost == pytest.approx(stalls * consts.eplb_stall_s, rel=1e-9), stalls
    # and the simulator's own scoring charges them: a dearer stall lowers EPLB's throughput only
    dear = consts.model_copy(update={"eplb_stall_s": 10 * consts.eplb_stall_s})
    assert predicted_tokens_per_s(eplb, dear, profile, 16) < predicted_tokens_per_s(eplb, consts, profile, 16)
    static = results["static"]
    assert static.stalls == 0
    assert predicted_tokens_per_s(static, dear, profile, 16) == predicted_tokens_per_s(static, consts, profile, 16)


@pytest.mark.parametrize("mode", ["auto", "local", "allreduce"])
def test_static_is_charged_no_dispatch_whatever_vexperts_dispatch_is(mode: str) -> None:
    counts = _counts()
    cfg = SimulationConfig(num_gpus=4, num_nodes=1, policies=("static",), dispatch=mode, warmup=0)
    static = simulate(counts, cfg)["static"]
    assert static.dispatch == "plan"
    reference = simulate(counts, replace(cfg, dispatch="plan"))["static"]
    consts, profile = InferenceConstants(experts_per_gpu=4), PerformanceProfile()
    assert predicted_total_time(static, consts, profile, 16) == predicted_total_time(reference, consts, profile, 16)


def test_auto_dispatch_on_plans_without_copies_is_plan_and_costs_nothing() -> None:
    """Perfectly even counts: vExpert's plans make no copies, so there is nothing to split and ``auto``
    must resolve to ``plan`` (charged nothing); on a skewed trace the same config resolves to a mode
    that splits (so the check above can tell)."""
    even = np.full((30, 3, 16), 16.0)
    cfg = SimulationConfig(num_gpus=4, num_nodes=1, policies=("static", "vexpert"), dispatch="auto", warmup=0,
                           allocation_interval=10)
    flat = simulate(even, cfg)["vexpert"]
    assert int(flat.vexperts.sum()) == 0  # no copies
    assert flat.dispatch == "plan"
    consts, profile = InferenceConstants(experts_per_gpu=4), PerformanceProfile()
    assert dispatch_time("plan", 16, profile.hardware) == 0.0 < dispatch_time("local", 16, profile.hardware)
    skewed = simulate(_counts(skew=3.0), cfg)["vexpert"]
    assert int(skewed.vexperts.sum()) > 0 and skewed.dispatch in ("local", "allreduce")
    # the charge follows the resolved mode
    charged = predicted_total_time(skewed, consts, profile, 16) - predicted_total_time(
        replace(skewed, dispatch="plan"), consts, profile, 16)
    layers_iterations = skewed.balance.size
    assert charged == pytest.approx(layers_iterations * dispatch_time(skewed.dispatch, 16, profile.hardware))


# ------------------------------------------------------------------------------------------------
# g. The dispatch twin (torch) against a plain reference, on the CPU, no Triton
# ------------------------------------------------------------------------------------------------


def _reference_shares(counts: np.ndarray, gpu: np.ndarray, num_gpus: int, sweeps: int, start: np.ndarray) -> np.ndarray:
    """The levelling as its docstring states it, one expert at a time in float64: ``sweeps`` damped
    Jacobi sweeps with heavy-ball momentum, each expert's tokens water-filled over its copies' GPUs
    given every other expert's load, rows normalised once at the end (an expert without tokens or
    whose shares vanish: an even split)."""
    experts, width = gpu.shape
    valid = gpu >= 0
    copies = valid.sum(1)
    replicated = valid & (copies[:, None] > 1)
    degree = np.zeros(num_gpus)
    for e, r in zip(*np.nonzero(replicated), strict=True):
        degree[gpu[e, r]] += 1
    step = np.ones(experts)
    for e in range(experts):
        if copies[e] > 1:
            step[e] = 1.0 / max(1.0, DAMPING * max(degree[gpu[e, r]] for r in range(width) if valid[e, r]))
    share = np.where(valid, start, 0.0).astype(np.float64)
    previous = share.copy()
    if width >= 2:
        for _ in range(sweeps):
            load = np.zeros(num_gpus)
            for e in range(experts):
                for r in range(width):
                    if valid[e, r]:
                        load[gpu[e, r]] += share[e, r] * counts[e]
            target = np.zeros_like(share)
            for e in range(experts):
                rs = [r for r in range(width) if valid[e, r]]
                floors = np.array([load[gpu[e, r]] - share[e, r] * counts[e] for r in rs])
                level = min((counts[e] + np.sort(floors)[:k].sum()) / k for k in range(1, len(rs) + 1))
                for r, floor in zip(rs, floors, strict=True):
                    target[e, r] = max(0.0, level - floor) / max(counts[e], 1e-6)
            stepped = share + step[:, None] * (target - share) + MOMENTUM * (share - previous)
            previous, share = share, np.maximum(stepped, 0.0)
    total = share.sum(1, keepdims=True)
    even = valid / np.maximum(copies, 1)[:, None]
    return np.where(total > 1e-6, share / np.maximum(total, 1e-12), even)


def _layer(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One layer: 12 experts over 4 GPUs (3 resident each), 5 of them with 1–2 extra copies, a
    skewed batch, the plan's shares (normalised random), an expert with copies but no tokens."""
    rng = np.random.default_rng(seed)
    experts, num_gpus, width = 12, 4, 3
    gpu = np.full((experts, width), -1, dtype=np.int64)
    gpu[:, 0] = np.arange(experts) // 3
    for e in rng.choice(experts, 5, replace=False):
        others = [g for g in range(num_gpus) if g != gpu[e, 0]]
        extra = rng.choice(others, int(rng.integers(1, 3)), replace=False)
        gpu[e, 1 : 1 + len(extra)] = extra
    counts = rng.multinomial(400, rng.dirichlet(np.full(experts, 0.5))).astype(np.float64)
    counts[int(np.nonzero((gpu >= 0).sum(1) > 1)[0][0])] = 0.0
    start = np.where(gpu >= 0, rng.random(gpu.shape) + 0.1, 0.0)
    return counts, gpu, start / start.sum(1, keepdims=True), num_gpus


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_dispatch_twin_runs_exactly_the_sweeps_asked_and_normalises_rows(seed: int) -> None:
    counts, gpu, start, num_gpus = _layer(seed)
    gpu_t, start_t = torch.from_numpy(gpu), torch.from_numpy(start).to(torch.float32)
    references = {s: _reference_shares(counts, gpu, num_gpus, s, start) for s in range(SWEEPS + 2)}
    for s in range(1, SWEEPS + 2):  # one sweep more or less shows: the comparison below can tell
        assert np.abs(references[s] - references[s - 1]).max() > 1e-3, s
    for sweeps, expected in references.items():
        got = level_shares(torch.from_numpy(counts), gpu_t, num_gpus, sweeps, start=start_t)
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), expected, atol=2e-5, err_msg=f"{sweeps} sweeps")
        sums = got.sum(-1)[torch.from_numpy((gpu >= 0).any(1))]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
        assert bool((got[gpu_t < 0] == 0).all())
    # the node's entry point: SWEEPS sweeps from the plan's shares, as cumulative draw tables
    plan_cum = cumulative_shares(start_t, gpu_t)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.from_numpy(counts).to(torch.int64)).view(-1, 1)
    for mode in ("local", "global"):  # one rank: the global counts are its own
        cum = dispatch_cum_share(mode, ids, gpu_t, plan_cum, num_gpus, None)
        expected_cum = cumulative_shares(torch.from_numpy(references[SWEEPS]).to(torch.float32), gpu_t)
        valid = gpu_t >= 0
        assert torch.equal(torch.isinf(cum), ~valid)
        torch.testing.assert_close(cum[valid], expected_cum[valid], atol=2e-5, rtol=0)
    np.testing.assert_allclose(plan_shares(plan_cum).numpy(), start, atol=1e-6)


def test_the_dispatch_twin_splits_a_tokenless_expert_evenly() -> None:
    gpu = torch.tensor([[0, 1, 2], [1, -1, -1], [2, 0, -1], [0, -1, -1]])
    counts = torch.tensor([0.0, 5.0, 0.0, 7.0])
    start = torch.tensor([[0.6, 0.3, 0.1], [1.0, 0, 0], [0.9, 0.1, 0], [1.0, 0, 0]])
    for sweeps in (0, 1, SWEEPS):
        got = level_shares(counts, gpu, 3, sweeps, start=start)
        expected = _reference_shares(counts.double().numpy(), gpu.numpy(), 3, sweeps, start.double().numpy())
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)
        assert torch.allclose(got.sum(-1), torch.ones(4))


# ------------------------------------------------------------------------------------------------
# d. The model calibration Job's attempt bound (emulator, real operator)
# ------------------------------------------------------------------------------------------------


def test_model_calibration_gives_up_after_max_attempts(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from operator_support.harness import cluster_session, running_operator
    from test_operator_api import add_nodes, deployment, model_jobs
    from vexpert_operator import naming as nm

    with cluster_session(tmp_path, monkeypatch) as cluster:
        type_name = add_nodes(cluster, 2)
        cluster.add_node_profile(type_name)  # hardware is profiled: only the model calibrates
        with running_operator(cluster, monkeypatch, env={"VEXPERT_OPERATOR_CALIBRATION_MAX_ATTEMPTS": "2"}):
            cluster.create(deployment())
            for attempt in (1, 2):
                job = cluster.wait_for(lambda a=attempt: [j for j in model_jobs(cluster) if j["metadata"]["labels"][
                    nm.LABEL_ATTEMPT] == str(a)], timeout=15, what=f"model attempt {attempt}")[0]
                cluster.finish_job(job["metadata"]["name"], "trace not found", exit_code=3)
            cond = cluster.wait_for(lambda: (lambda c: c if "no more attempts" in c.get("message", "") else None)(
                cluster.condition("dsv3", "Calibrated")), what="the model calibration's final failure")
            assert cond["status"] == "False" and cond["reason"] == "ModelCalibrationFailed"
            assert "attempt 2 of 2" in cond["message"] and "trace not found" in cond["message"]
            time.sleep(2.5)  # past the retry delay (maxRetryBackoffSeconds 2): still no third attempt
            assert sorted(j["metadata"]["labels"][nm.LABEL_ATTEMPT] for j in model_jobs(cluster)) == ["1", "2"]
