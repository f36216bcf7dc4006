"""EP MoE forward over gloo (4 processes; 1 and 2 as well) against the single-process reference, for the static
placement, allocator plans and arbitrary random plans (replicas, slots, uneven shares), DeepSeek-V3
and Qwen routing; plus the replica-choice bookkeeping on one rank."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from legacy_ep_moe import legacy_ep_moe_layer
from vexpert_runtime.model.checkpoint import CheckpointReader, MoESpec, write_tiny_checkpoint
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    RoutingTable,
    base_experts,
    choose_replicas,
    ep_moe_layer,
    plan_from_slots,
    static_table,
    table_from_plan,
)
from vexpert_runtime.model.families import DEEPSEEK, QWEN
from vexpert_runtime.model.levelling import list_replica_copies
from vexpert_runtime.model.moe_math import packed_ffn, relative_error, shared_forward
from vexpert_runtime.model.reference import ModelWeights, reference_moe_layer
from vexpert_runtime.model.routing import route
from vexpert_runtime.policy.allocator import AllocatorConfig, allocate
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, static_placement
from vexpert_runtime.ports import free_port

WORLD = 4
DS = MoESpec(
    architecture=DEEPSEEK,
    hidden_size=32,
    intermediate_size=16,
    num_experts=16,
    top_k=4,
    moe_layers=(1, 2),
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    correction_bias=True,
    shared_intermediate_size=16,
)
QW = MoESpec(
    architecture=QWEN,
    hidden_size=32,
    intermediate_size=16,
    num_experts=16,
    top_k=2,
    moe_layers=(0,),
    scoring="softmax",
    norm_topk_prob=False,
    shared_intermediate_size=24,
    shared_expert_gate=True,
)
TOKENS = [40, 7, 33, 0]  # uneven batches; one rank routes nothing at all
SKEW = torch.tensor([3.0, 2.5, 2.0, 0, 0, 0, 1.5, 0, 0, 0, 0, 0, 0, 0, 0, 0])


# ------------------------------------------------------------------------------------------------
# One rank: replica choice and plan translation
# ------------------------------------------------------------------------------------------------


def test_choose_replicas_follows_shares_and_skips_zero_share_copies() -> None:
    gpu = torch.tensor([[0, 1, 3], [2, 0, 1]])
    local = torch.tensor([[0, 4, 5], [1, 6, 4]])
    shares = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.0, 0.5]], dtype=torch.float64)
    cum = shares.cumsum(1)
    cum[:, -1] = 1.0
    total = torch.zeros(2, 3)
    for rank in range(WORLD):
        ids = torch.tensor([[0, 1]] * 10)  # 10 tokens to each expert per rank
        dest_gpu, dest_local = choose_replicas(ids, gpu, local, cum, rank, WORLD)
        for e in range(2):
            for c in range(3):
                hits = (dest_gpu[:, e] == gpu[e, c]) & (dest_local[:, e] == local[e, c])
                total[e, c] += hits.sum()
        # stratified per rank: a share of 1/4 of 10 tokens is 2 or 3
        assert 2 <= int((dest_gpu[:, 0] == 0).sum()) <= 3
    assert total[0].tolist() == [10.0, 30.0, 0.0]
    assert total[1].tolist() == [20.0, 0.0, 20.0]


def test_single_tokens_spread_over_copies_across_ranks() -> None:
    gpu = torch.tensor([[0, 1, 2, 3]])
    local = torch.tensor([[0, 4, 4, 4]])
    cum = torch.tensor([[0.25, 0.5, 0.75, 1.0]], dtype=torch.float64)
    picks = {int(choose_replicas(torch.tensor([[0]]), gpu, local, cum, r, WORLD)[0].item()) for r in range(WORLD)}
    assert picks == {0, 1, 2, 3}  # one token per rank: every copy gets one


def test_table_from_plan_matches_physical_ids() -> None:
    counts = torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) * 100 + SKEW.unsqueeze(0) * 300
    plan = allocate(counts, static_placement(2, 16, WORLD), WORLD, AllocatorConfig(2, 1, 0.99))
    table = table_from_plan(plan, 7)
    assert table.plan_id == 7 and (plan.slot_expert >= 0).any()
    phys = plan.physical_ids().numpy()
    stride = 16 // WORLD + plan.slots_per_gpu
    valid = table.gpu >= 0
    assert np.array_equal(np.where(valid, table.gpu * stride + table.local, -1), phys)
    assert np.all(table.local[..., 0] == np.arange(16) % 4)  # resident copies: rank among base experts
    slot = plan.replica_slot.numpy()
    assert np.all(np.where(slot >= 0, table.local == 4 + slot, True))
    assert np.allclose(np.where(valid, table.cum_share, 0).max(-1), 1.0)


def test_a_device_table_is_one_buffer_and_loads_every_field_through_it() -> None:
    """A plan switch is one host→device copy: every tensor of an allocated table views one byte
    buffer, and loading through it writes each tensor's definition — the routing table padded to
    the fixed replica width, the replicated copies listed — for a plan with replicas, then back to
    the static table (nothing of the plan left behind), to the same routing under a new plan id and
    back to the plan."""
    counts = torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) * 100 + SKEW.unsqueeze(0) * 300
    plan = table_from_plan(allocate(counts, static_placement(2, 16, WORLD), WORLD, AllocatorConfig(2, 1, 0.99)), 7)
    packed = DeviceRoutingTable.allocate(2, 16, WORLD, 2, "cpu")
    fields = ("gpu", "local", "cum_share", "copy_expert", "copy_gpu", "copy_col", "copy_step", "single_gpu")
    base = packed.storage.untyped_storage().data_ptr()
    assert all(getattr(packed, name).untyped_storage().data_ptr() == base for name in fields)
    static = static_table(2, 16, WORLD, 2)
    # a re-plan to the same routing only takes the new id; then a different one is loaded again
    for table in (plan, static, dataclasses.replace(static, plan_id=8), dataclasses.replace(plan, plan_id=9)):
        packed.load(table)
        assert packed.plan_id == table.plan_id
        pad = ((0, 0), (0, 0), (0, packed.replicas - table.gpu.shape[2]))
        want = (np.pad(table.gpu, pad, constant_values=-1), np.pad(table.local, pad, constant_values=-1),
                np.pad(table.cum_share, pad, constant_values=np.inf),
                *list_replica_copies(table.gpu, packed.copy_expert.shape[1]))
        for name, value in zip(fields, want, strict=True):
            assert np.array_equal(getattr(packed, name).numpy(), value), name
        assert torch.equal(packed.copies(1).expert, packed.copy_expert[1])  # cached per-layer views follow


def _random_plan(num_layers: int, num_experts: int, slots: int, seed: int, world: int = WORLD) -> Any:
    """Any valid plan: random slot contents (an expert may sit on every GPU), random shares."""
    gen = torch.Generator().manual_seed(seed)
    base = static_placement(num_layers, num_experts, world)
    slot_expert = torch.full((num_layers, world, slots), -1)
    for layer in range(num_layers):
        for g in range(world):
            everywhere = layer == 0 and g > 0  # layer 0: expert 0 gets a copy on every GPU
            candidates = [e for e in range(num_experts) if int(base[layer, e]) != g and not (everywhere and e == 0)]
            picks = torch.randperm(len(candidates), generator=gen)[:slots].tolist()
            for s, p in enumerate(picks):
                if torch.rand(1, generator=gen).item() < 0.85:
                    slot_expert[layer, g, s] = candidates[p]
            if everywhere:
                slot_expert[layer, g, 0] = 0
    share = torch.rand(num_layers, num_experts, world + 1, generator=gen)
    if world > 2:
        share[0, 0, 2] = 0.0  # a copy that gets no tokens
    return plan_from_slots(base, slot_expert, share)


def _all_reduce(t: torch.Tensor, world: int) -> None:
    if world > 1:
        dist.all_reduce(t)


def _run_rank(rank: int, port: int, root: str, cases: list[dict[str, Any]], world: int = WORLD) -> None:
    """Every case on this rank: the fixed-capacity layer (loop and grouped GEMMs) against the
    reference and the old host-synchronised layer. One device table per table shape, reloaded in
    place from case to case (plan switches)."""
    torch.set_num_threads(1)
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.group.WORLD
    out = []
    models: dict[str, ModelWeights] = {}
    device_tables: dict[tuple[int, ...], DeviceRoutingTable] = {}
    for case in cases:
        spec: MoESpec = case["spec"]
        table: RoutingTable = case["table"]
        layer = case["layer"]
        if case["ckpt"] not in models:
            models[case["ckpt"]] = ModelWeights.load(CheckpointReader(case["ckpt"], spec))
        weights = models[case["ckpt"]]
        gen = torch.Generator().manual_seed(1000 * case["seed"] + rank)
        x = torch.randn(TOKENS[rank], spec.hidden_size, generator=gen)
        bias = case["bias"]
        ids, topk_weights = route(x, weights.routers[layer], spec, bias)
        mine = base_experts(spec.num_experts, world, rank)
        slot_rows = [
            weights.experts[layer][e] if e >= 0 else torch.zeros(spec.expert_numel)
            for e in table.slot_expert[layer, rank].tolist()
        ]
        local_rows = [weights.experts[layer][e] for e in mine] + slot_rows
        key = (table.num_layers, table.num_experts, table.num_gpus, table.slots)
        if key not in device_tables:
            device_tables[key] = DeviceRoutingTable.allocate(*key, device="cpu")
        device_table = device_tables[key]
        pointers = [t.data_ptr() for t in (device_table.gpu, device_table.local, device_table.cum_share)]
        device_table.load(table)  # a plan switch: the same tensors, new contents
        assert [t.data_ptr() for t in (device_table.gpu, device_table.local, device_table.cum_share)] == pointers
        capacity = max(TOKENS[:world]) * spec.top_k  # uneven batches: every rank uses the largest B·K
        shared = shared_forward(x, weights.shared[layer])
        hooks: list[str] = []
        results = {}
        dispatch = case.get("dispatch", "plan")
        for grouped in (False, True):  # per-expert loop, and grouped GEMMs (torch._grouped_mm runs on the CPU too)
            stacks = ExpertStacks(torch.stack(local_rows[: len(mine)]), torch.stack(slot_rows) if slot_rows else None,
                                  spec.intermediate_size, grouped=grouped)
            results[grouped] = ep_moe_layer(
                x, ids, topk_weights, device_table, layer, stacks, shared, rank, world, group, capacity=capacity,
                slot_wait=lambda h=hooks: h.append("wait"), after_compute=lambda h=hooks: h.append("free"),
                dispatch=dispatch)
        assert hooks == ["wait", "free"] * 2  # one wait and one release per layer, slots used or not
        (y, stats), (y_grouped, stats_grouped) = results[False], results[True]
        assert torch.equal(stats_grouped.computed, stats.computed)
        assert int(stats.dropped) == 0
        y_legacy, computed_legacy = legacy_ep_moe_layer(
            x, ids, topk_weights, table, layer, local_rows.__getitem__,
            lambda rows, row, spec=spec: packed_ffn(rows, row, spec.intermediate_size, spec.hidden_size),
            shared, rank, world, group)
        if dispatch == "plan":  # the old layer splits by the plan's shares only
            assert torch.equal(stats.computed, computed_legacy)  # the same pairs reach the same experts
        ref, ref_counts = reference_moe_layer(x, weights, layer, bias)
        # logical expert of every local expert this rank computed
        logical = torch.zeros(spec.num_experts, dtype=torch.int64)
        for j, n in enumerate(stats.computed.tolist()):
            expert = mine[j] if j < len(mine) else int(table.slot_expert[layer, rank, j - len(mine)])
            if n:
                assert expert >= 0, "rows arrived for an empty slot"
                logical[expert] += n
        _all_reduce(logical, world)
        _all_reduce(ref_counts, world)
        loads = torch.zeros(world, dtype=torch.int64)
        loads[rank] = stats.computed.sum()
        _all_reduce(loads, world)
        out.append(
            {
                "name": case["name"],
                "error": relative_error(y, ref) if TOKENS[rank] else 0.0,
                "error_grouped": relative_error(y_grouped, ref) if TOKENS[rank] else 0.0,
                "error_legacy": relative_error(y, y_legacy) if TOKENS[rank] else 0.0,
                "finite": bool(torch.isfinite(y).all()),
                "sent": stats.sent,
                "logical": logical.tolist(),
                "reference_counts": ref_counts.tolist(),
                "loads": loads.tolist(),
            }
        )
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    if world > 1:
        dist.destroy_process_group()


def _by_case(root: Path, world: int) -> dict[str, list[dict[str, Any]]]:
    per_rank = [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]
    by_case: dict[str, list[dict[str, Any]]] = {}
    for rows in per_rank:
        for row in rows:
            by_case.setdefault(row["name"], []).append(row)
    return by_case


def _check_exact(by_case: dict[str, list[dict[str, Any]]], world: int) -> None:
    for name, rows in by_case.items():
        assert len(rows) == world
        worst = max(r["error"] for r in rows)
        assert worst <= 1e-5, f"{name}: max relative error {worst}"
        worst_grouped = max(r["error_grouped"] for r in rows)
        assert worst_grouped <= 1e-5, f"{name} (grouped GEMMs): max relative error {worst_grouped}"
        worst_legacy = max(r["error_legacy"] for r in rows)
        assert worst_legacy <= 1e-6, f"{name}: differs from the old layer by {worst_legacy}"
        assert all(r["finite"] for r in rows)


def plan_for_skew(ckpt: str, skew: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The allocator's plan for the counts [L, E] ``skew`` routes the cases' inputs (seed 3) to on DS,
    and those counts."""
    weights = ModelWeights.load(CheckpointReader(ckpt, DS))
    counts = torch.zeros(DS.num_layers, DS.num_experts)
    for layer in range(DS.num_layers):
        for rank in range(WORLD):
            x = torch.randn(TOKENS[rank], DS.hidden_size, generator=torch.Generator().manual_seed(1000 * 3 + rank))
            ids, _ = route(x, weights.routers[layer], DS, skew)
            counts[layer] += torch.bincount(ids.reshape(-1), minlength=DS.num_experts)
    consts = InferenceConstants(tokens_per_gpu=20, top_k=DS.top_k, experts_per_gpu=4, expert_bytes=DS.expert_bytes(torch.float32))
    return allocate(counts, static_placement(2, 16, WORLD), WORLD, AllocatorConfig(2, 1, 0.99), consts=consts), counts


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    root = tmp_path_factory.mktemp("ep")
    ds_dir, qw_dir = str(root / "ds"), str(root / "qw")
    write_tiny_checkpoint(ds_dir, DS, seed=1)
    write_tiny_checkpoint(qw_dir, QW, seed=2)
    # An allocator plan made from exactly the counts the skewed routing produces on these inputs.
    plan, counts = plan_for_skew(ds_dir, SKEW)
    cases = [
        {"name": "static", "spec": DS, "ckpt": ds_dir, "layer": 0, "seed": 1, "bias": None, "table": static_table(2, 16, WORLD, 2)},
        {"name": "allocator-l0", "spec": DS, "ckpt": ds_dir, "layer": 0, "seed": 3, "bias": SKEW, "table": table_from_plan(plan, 1)},
        {"name": "allocator-l1", "spec": DS, "ckpt": ds_dir, "layer": 1, "seed": 3, "bias": SKEW, "table": table_from_plan(plan, 1)},
        {"name": "static-skewed-l0", "spec": DS, "ckpt": ds_dir, "layer": 0, "seed": 3, "bias": SKEW, "table": static_table(2, 16, WORLD, 2)},
    ]
    for seed in range(4):
        table = table_from_plan(_random_plan(2, 16, 3, seed), 10 + seed)
        cases.append({"name": f"random-ds-{seed}", "spec": DS, "ckpt": ds_dir, "layer": seed % 2, "seed": 10 + seed, "bias": SKEW, "table": table})
    qw_table = table_from_plan(_random_plan(1, 16, 2, 99), 20)
    cases.append({"name": "random-qwen", "spec": QW, "ckpt": qw_dir, "layer": 0, "seed": 20, "bias": None, "table": qw_table})
    mp.spawn(_run_rank, args=(free_port(), str(root), cases), nprocs=WORLD, join=True)
    return _by_case(root, WORLD), {"plan": plan, "counts": counts}


def test_ep_forward_equals_reference_for_every_plan(ep_results: Any) -> None:
    by_case, _ = ep_results
    assert len(by_case) == 9
    _check_exact(by_case, WORLD)


@pytest.mark.parametrize("world", [1, 2])
def test_ep_forward_on_one_and_two_ranks_equals_reference_and_old_layer(tmp_path: Path, world: int) -> None:
    """Static and random plans (replicas in slots, uneven shares) switched in place in one device
    table, on one rank (no process group) and on two gloo processes."""
    write_tiny_checkpoint(str(tmp_path / "ds"), DS, seed=1)
    ckpt = str(tmp_path / "ds")
    cases = [{"name": "static", "spec": DS, "ckpt": ckpt, "layer": 0, "seed": 1, "bias": SKEW,
              "table": static_table(2, 16, world, 3)}]
    for seed in range(3):
        table = table_from_plan(_random_plan(2, 16, 3, seed, world), 10 + seed)
        cases.append({"name": f"random-{seed}", "spec": DS, "ckpt": ckpt, "layer": seed % 2, "seed": 10 + seed,
                      "bias": SKEW, "table": table})
    cases.append({"name": "static-again", "spec": DS, "ckpt": ckpt, "layer": 1, "seed": 2, "bias": None,
                  "table": static_table(2, 16, world, 3)})
    if world == 1:
        _run_rank(0, 0, str(tmp_path), cases, world)
    else:
        mp.spawn(_run_rank, args=(free_port(), str(tmp_path), cases, world), nprocs=world, join=True)
    by_case = _by_case(tmp_path, world)
    assert len(by_case) == len(cases)
    _check_exact(by_case, world)
    for rows in by_case.values():
        assert [r["sent"] for r in rows] == [t * DS.top_k for t in TOKENS[:world]]
        assert rows[0]["logical"] == rows[0]["reference_counts"]


def test_a_single_rank_lays_its_pairs_out_as_the_send_and_receive_path_does() -> None:
    """An EP group of one skips the send and return buffers (arrange_local / combine_local): its buffer rows name
    the tokens the send/receive path copies there (row_src), and the same group ends, counts and outputs, bit for
    bit, as pack_dispatch → arrange_received → combine_received at world 1, with and without (empty) slots, aligned
    groups and not; every row names a token, also rows no pair lands on."""
    from vexpert_runtime.model.ep_moe import (
        arrange_local,
        arrange_received,
        combine_local,
        combine_received,
        pack_dispatch,
    )

    experts, hidden, top_k = 16, 24, 4
    generator = torch.Generator().manual_seed(5)
    # (one GPU holds every expert, so a plan places none in its slots: plan_from_slots refuses a second copy there)
    for table in (static_table(2, experts, 1, 3), static_table(2, experts, 1, 0)):
        device_table = DeviceRoutingTable.of(table, "cpu")
        for batch, align in ((40, 16), (7, 1), (1, 16)):
            x = torch.randn(batch, hidden, generator=generator)
            ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(batch)])
            weights = torch.rand(batch, top_k, generator=generator)
            shared = torch.randn(batch, hidden, generator=generator)
            gpu, local, cum = device_table.gpu[1], device_table.local[1], device_table.cum_share[1]
            send_x, send_local, row_of_pair = pack_dispatch(x, ids, gpu, local, cum, 0, 1, batch * top_k)
            received, position, resident_offs, slot_offs, computed = arrange_received(send_local, experts,
                                                                                      table.slots, align)
            buf = send_x[received]  # the buffer the grouped GEMMs read (gathered as they read on a GPU)
            row_src, local_position, *local_rest = arrange_local(ids, gpu, local, cum, experts, table.slots, align)
            assert torch.equal(local_position, position[row_of_pair])  # each pair's buffer row
            assert all(torch.equal(a, b) for a, b in zip(local_rest, (resident_offs, slot_offs, computed), strict=True))
            assert torch.equal(x[row_src[local_position]], buf[position])  # the token each buffer row reads
            assert row_src.shape == (buf.shape[0],) and int(row_src.min()) >= 0 and int(row_src.max()) < batch
            out = torch.randn(buf.shape, generator=generator)  # any per-row "expert" output
            y, dropped = combine_received(out.index_select(0, position), row_of_pair, weights, shared)
            assert int(dropped) == 0
            assert torch.equal(combine_local(out, local_position, weights, shared), y)


def test_rows_named_in_an_empty_step_are_zeros_not_an_index_error() -> None:
    """A step with no tokens still has a buffer of alignment rows (16 per expert on a GPU), each naming row 0 of an
    empty x: where the rows are copied rather than read in place (a float32 GPU rank, the CPU kernels) that copy gives
    zero rows, and the experts' outputs are empty groups — no index error."""
    from vexpert_runtime.model.grouped_moe import gather_rows, grouped_swiglu, packed_views

    experts, intermediate, hidden = 4, 8, 12
    w13, w2 = packed_views(torch.randn(experts, 3 * intermediate * hidden), intermediate, hidden)
    row_src = torch.zeros(experts * 15, dtype=torch.int64)
    assert torch.equal(gather_rows(torch.randn(0, hidden), row_src), torch.zeros(experts * 15, hidden))
    offs = torch.zeros(experts, dtype=torch.int32)
    for grouped in (False, True):
        out = grouped_swiglu(torch.randn(0, hidden), w13, w2, offs, grouped=grouped, row_src=row_src)
        assert out.shape == (experts * 15, hidden)
    x = torch.randn(3, hidden)
    assert torch.equal(gather_rows(x, torch.tensor([2, 0, 2])), x[[2, 0, 2]])


@pytest.mark.parametrize("tokens, experts", [(24, 16), (1024, 256)])  # the one-hot sum; past 2^20 elements, the scatter
def test_a_layers_statistics_count_real_rows_only(tokens: int, experts: int) -> None:
    """record_layer_stats writes the layer's expert counts and computed rows in place: a padded graph batch's pad rows
    (mask_padding) are left out of the counts — every pair counted once otherwise — on both forms of group_counts."""
    from vexpert_runtime.serve.moe_executors import mask_padding, record_layer_stats

    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, experts, (tokens, 4), generator=generator)
    valid = torch.rand(tokens, generator=generator) < 0.7
    routed, _ = mask_padding(ids, torch.rand(tokens, 4, generator=generator), valid, experts)
    counts, computed = torch.full((experts,), -1), torch.full((3,), -1)
    record_layer_stats(counts, computed, routed, valid, torch.tensor([5, 0, 2]))
    assert torch.equal(counts, torch.bincount(ids[valid].reshape(-1), minlength=experts))
    assert torch.equal(computed, torch.tensor([5, 0, 2]))
    record_layer_stats(counts, computed, ids, None, torch.tensor([1, 1, 1]))
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=experts))


def test_masking_a_padded_batch_is_one_compiled_kernel() -> None:
    """mask_padding, compiled as the step compiles it, is one kernel (it made a third output, the pairs' count
    weights, in a second kernel every MoE layer until the statistics took the rows' validity themselves)."""
    import torch._inductor.metrics as inductor_metrics

    from vexpert_runtime.serve.moe_executors import mask_padding

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 5, (61, 3), generator=generator)  # shapes no other test compiles it at (no cache hit)
    valid = torch.rand(61, generator=generator) < 0.8
    inductor_metrics.reset()
    routed, weights = torch.compile(mask_padding, dynamic=False)(ids, torch.rand(61, 3, generator=generator), valid, 5)
    assert inductor_metrics.generated_kernel_count == 1
    assert torch.equal(routed[valid], ids[valid]) and bool((weights[~valid] == 0).all())


def test_no_token_dropped_or_duplicated(ep_results: Any) -> None:
    by_case, _ = ep_results
    for name, rows in by_case.items():
        top_k = QW.top_k if "qwen" in name else DS.top_k
        assert [r["sent"] for r in rows] == [t * top_k for t in TOKENS], name
        # every logical expert computed exactly as many (token, expert) pairs as the reference routed
        assert rows[0]["logical"] == rows[0]["reference_counts"], name
        assert sum(rows[0]["loads"]) == sum(TOKENS) * top_k


def test_replicas_split_tokens_so_gpus_balance(ep_results: Any) -> None:
    by_case, extra = ep_results
    plan = extra["plan"]
    static = balance_ratio(torch.tensor(by_case["static-skewed-l0"][0]["loads"], dtype=torch.float32)).item()
    balanced = balance_ratio(torch.tensor(by_case["allocator-l0"][0]["loads"], dtype=torch.float32)).item()
    assert int(plan.vexperts[0]) >= 1
    assert static < 0.7
    assert balanced >= static + 0.15
    assert balanced >= float(plan.balance_predicted[0]) - 0.1  # the split realises the plan's shares


def test_prepacked_cpu_experts_compute_the_packed_rows_experts() -> None:
    """oneDNN-prepacked experts (what a CPU rank keeps) give the expert loop's outputs over the packed
    rows (up to fp32 rounding), with empty groups and rows past the last group; a CPU EP rank's
    resident experts are prepacked, a GPU's rows stay rows."""
    from vexpert_runtime.model.grouped_moe import (
        PrepackedExperts,
        grouped_swiglu,
        packed_views,
        prepacking_runs,
    )

    if not prepacking_runs(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    experts, inter, hidden = 5, 6, 8
    rows = torch.randn(experts, 3 * inter * hidden)
    prepacked = PrepackedExperts.of(rows, inter, hidden)
    assert len(prepacked) == experts
    x = torch.randn(13, hidden)
    offs = torch.tensor([2, 2, 5, 9, 11], dtype=torch.int32)  # expert 1 empty; rows 11–12 past the groups
    got = prepacked.swiglu(x, offs)
    want = grouped_swiglu(x, *packed_views(rows, inter, hidden), offs, grouped=False)
    torch.testing.assert_close(got[:11], want[:11])
    assert not torch.equal(got[:11], torch.zeros_like(got[:11]))
    assert not prepacking_runs(torch.device("cpu"), torch.bfloat16)
    assert not prepacking_runs(torch.device("cuda"), torch.float32)
    from vexpert_runtime.serve.moe_executors import EPExperts

    executor = EPExperts([rows, rows.clone()], inter, experts, 0, 1, None, cpu_expert_kernel="prepacked")
    assert all(isinstance(layer, PrepackedExperts) and len(layer) == experts for layer in executor.resident)
    assert executor.cpu_expert_kernel == "prepacked"


def test_cpu_grouped_gemm_computes_the_loops_experts() -> None:
    """``torch._grouped_mm`` on CPU (fp32, any group starts, empty groups, rows past the last group)
    gives the per-expert loop's outputs exactly (the same GEMMs, one call); shapes whose strides are not
    16-byte multiples take the loop."""
    from vexpert_runtime.model.grouped_moe import (
        grouped_gemm_runs,
        grouped_swiglu,
        packed_views,
        uses_grouped_gemm,
    )

    if not grouped_gemm_runs(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU _grouped_mm")
    torch.manual_seed(0)
    experts, inter, hidden = 5, 8, 16
    rows = torch.randn(experts, 3 * inter * hidden)
    x = torch.randn(13, hidden)
    offs = torch.tensor([2, 2, 5, 9, 11], dtype=torch.int32)  # expert 1 empty; rows 11–12 past the groups
    grouped = grouped_swiglu(x, *packed_views(rows, inter, hidden), offs, grouped=True)
    loop = grouped_swiglu(x, *packed_views(rows, inter, hidden), offs, grouped=False)
    assert torch.equal(grouped[:11], loop[:11])
    assert uses_grouped_gemm(x)
    odd = torch.randn(experts, 3 * 6 * hidden)  # I = 6: 24-byte rows of w2
    want = grouped_swiglu(x, *packed_views(odd, 6, hidden), offs, grouped=False)
    torch.testing.assert_close(grouped_swiglu(x, *packed_views(odd, 6, hidden), offs)[:11], want[:11])


def test_cpu_rank_picks_its_expert_kernel() -> None:
    """A CPU rank's resident experts: rows for ``grouped``, prepacked for ``prepacked``, the faster of the
    two by a timed pass over layer 0 for ``auto`` (both timings kept); every choice computes the same
    layer; an unknown kernel is refused naming the option."""
    from vexpert_runtime.errors import VExpertInputError
    from vexpert_runtime.model.grouped_moe import PrepackedExperts, prepacking_runs
    from vexpert_runtime.serve.moe_executors import EPExperts

    if not prepacking_runs(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    experts, inter, hidden, top_k = 8, 16, 32, 2
    layers = [torch.randn(experts, 3 * inter * hidden) * 0.1 for _ in range(2)]
    x = torch.randn(11, hidden)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(11)])
    weights = torch.rand(11, top_k)
    outputs = {}
    for kernel in ("grouped", "prepacked", "auto"):
        executor = EPExperts.from_rows(lambda layer, mine: layers[layer][mine], 2, inter, experts, 0, 1, None, "cpu",
                                       cpu_expert_kernel=kernel)
        chosen = executor.cpu_expert_kernel
        assert chosen == kernel if kernel != "auto" else chosen in ("grouped", "prepacked")
        assert all(isinstance(r, PrepackedExperts) == (chosen == "prepacked") for r in executor.resident)
        if kernel == "auto":
            assert set(executor.cpu_expert_seconds) == {"grouped", "prepacked"}
            assert all(s > 0 for s in executor.cpu_expert_seconds.values())
            assert chosen == min(executor.cpu_expert_seconds, key=executor.cpu_expert_seconds.__getitem__)
        outputs[kernel] = executor.forward(1, x, ids, weights)
    torch.testing.assert_close(outputs["grouped"], outputs["prepacked"])
    torch.testing.assert_close(outputs["auto"], outputs["grouped"])
    with pytest.raises(VExpertInputError, match="cpu_expert_kernel"):
        EPExperts([layers[0]], inter, experts, 0, 1, None, cpu_expert_kernel="mkl")


@pytest.mark.parametrize(("pairs", "groups"), [(0, 4), (1, 1), (37, 3), (500, 9), (5000, 300)])
def test_rank_in_group_is_a_stable_sorts_rank(pairs: int, groups: int) -> None:
    """Sort-free ranks (one-hot prefix sums; the last case is past the limit, so it sorts) equal the
    ranks a stable sort by group gives, padding value ``groups`` included."""
    from vexpert_runtime.model.grouped_moe import _ONE_HOT_LIMIT, rank_in_group

    assert 500 * 10 <= _ONE_HOT_LIMIT < 5000 * 301
    generator = torch.Generator().manual_seed(pairs)
    group = torch.randint(0, groups + 1, (pairs,), generator=generator)
    want = torch.empty_like(group)
    for value in range(groups + 1):
        members = (group == value).nonzero().view(-1)
        want[members] = torch.arange(members.numel())
    assert torch.equal(rank_in_group(group, groups), want)
