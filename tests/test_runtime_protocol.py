"""The coordinator–worker slot protocol: in-process handshake rules (threads), then whole nodes
(coordinator + 2 worker processes): a delayed coordinator makes workers wait instead of reading
stale slots, scripted plan changes switch the computed experts at an iteration boundary, and a
slow allocator never stalls a step."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from node_faults import PacedWorkload, faulty_filler, slow_allocator
from runtime_support import TINY_DEEPSEEK_SPEC
from scripted_plans import scripted_plans
from slot_audit import SlotAudit, computed_rows, slot_checksums
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import CheckpointReader, write_tiny_checkpoint
from vexpert_runtime.model.ep_moe import plan_from_slots, table_from_plan
from vexpert_runtime.node import NodeOptions, NodeReport, NodeRuntime, resolve_setup, run_node
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.gpu_sync import CpuFlagOps
from vexpert_runtime.node.protocol import (
    AHEAD,
    HEADERS,
    PUBLISHED,
    Assignment,
    FillLoop,
    SharedState,
    SlotFiller,
    WorkerSlots,
    decide,
)
from vexpert_runtime.node.slots import row_checksum, sequence
from vexpert_runtime.node.transport import CpuSharedMemoryTransport, CudaIpcTransport
from vexpert_runtime.policy.placement import static_placement
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload
from vexpert_runtime.workload import Workload

SPEC = TINY_DEEPSEEK_SPEC



# ------------------------------------------------------------------------------------------------
# In-process handshake (the "worker" is the test thread)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def handshake(tmp_path: Path) -> dict[str, Any]:
    write_tiny_checkpoint(tmp_path, SPEC)
    reader = CheckpointReader(tmp_path, SPEC)
    transport = CpuSharedMemoryTransport()
    pool = ExpertPool.build(
        torch.arange(8).expand(2, 8).contiguous(),
        8,
        SPEC.expert_numel,
        lambda layer, experts: reader.experts(layer, experts, torch.float32),
        lambda rows, numel: torch.empty(rows, numel),
    )
    shared = SharedState.create(1, 2, multiprocessing.get_context("spawn"))
    buffers = transport.allocate(2, SPEC.expert_numel, torch.float32, layers=2)
    abort = threading.Event()
    generation = shared.attach_coordinator()
    # two MoE layers, one buffer of 2 slots; this process plays EP rank 1 of 2 (experts 4..7 resident)
    filler = SlotFiller(shared, [buffers], [1], transport, 2, abort, generation)
    stopping = threading.Event()
    worker = WorkerSlots(shared, 0, buffers, 3.0, CpuFlagOps(timeout_s=5.0, interrupted=stopping.is_set))
    base = static_placement(2, 8, 2)

    def assignment(plan_id: int, slots_rank1: list[list[int]]) -> Assignment:
        slot_expert = torch.full((2, 2, 2), -1)
        slot_expert[:, 1] = torch.tensor(slots_rank1)
        return Assignment(table_from_plan(plan_from_slots(base, slot_expert), plan_id), pool)

    def fill(iteration: int, plan: Assignment) -> None:
        filling = filler.publish(iteration, plan.table.plan_id, 4, False)
        assert filling is not None
        for layer in range(2):
            filler.fill_layer(iteration, layer, plan, filling)

    yield {"filler": filler, "worker": worker, "assignment": assignment, "pool": pool, "abort": abort,
           "fill": fill, "shared": shared}
    abort.set()
    stopping.set()


def _checksums(worker: WorkerSlots) -> list[str]:
    return [row_checksum(worker.slot(s)) for s in range(2)]


def _run_iteration(worker: WorkerSlots, iteration: int) -> None:
    header, _ = worker.begin(iteration)
    assert header is not None
    for layer in range(2):
        worker.acquire(layer)
        worker.release(layer)
    worker.finish(iteration)


def test_worker_waits_for_a_late_fill(handshake: dict[str, Any]) -> None:
    filler, worker, pool = handshake["filler"], handshake["worker"], handshake["pool"]
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    filling = filler.publish(0, 1, 5, False)
    assert filling == [True]
    header, _ = worker.begin(0)
    assert header is not None and (header.iteration, header.plan_id, header.k, header.stop) == (0, 1, 5, False)
    timer = threading.Timer(0.4, filler.fill_layer, args=(0, 0, plan, filling))
    timer.start()
    started = time.perf_counter()
    worker.acquire(0)  # layer 0's slots are not filled yet: the worker waits for its FULL flag
    timer.join()
    assert time.perf_counter() - started >= 0.35
    assert _checksums(worker)[0] == row_checksum(pool.row(0, 0))
    worker.check_tags(0, plan.table, 0, rank=1)


def test_coordinator_never_overwrites_a_slot_in_use(handshake: dict[str, Any]) -> None:
    filler, worker, pool, fill = handshake["filler"], handshake["worker"], handshake["pool"], handshake["fill"]
    # alternating layout: layer 0 in slot 0 (bottom), layer 1 in slot 1 (top) — adjacent layers disjoint
    first = handshake["assignment"](1, [[0, -1], [-1, 3]])
    second = handshake["assignment"](2, [[1, -1], [-1, 2]])
    fill(0, first)
    _run_iteration(worker, 0)
    fill(1, first)
    assert worker.begin(1)[0] is not None
    worker.acquire(0)  # computing layer 0 of iteration 1 with slot 0
    in_use = _checksums(worker)
    assert filler.publish(2, 2, 4, False) == [True]  # iteration 0 is finished: 2 may be published
    writer = threading.Thread(target=filler.fill_layer, args=(2, 0, second, [True]))  # slot 0 again
    writer.start()
    writer.join(timeout=0.4)
    assert writer.is_alive(), "the coordinator must wait until layer 0 of iteration 1 is released"
    assert _checksums(worker) == in_use
    worker.release(0)
    writer.join(timeout=3)
    assert not writer.is_alive()
    assert _checksums(worker)[0] == row_checksum(pool.row(0, 1))
    worker.acquire(1)  # layer 1 of iteration 1 still computes with its own slot, untouched
    assert _checksums(worker)[1] == in_use[1] == row_checksum(pool.row(1, 3))


def test_overlapping_adjacent_layers_wait_for_the_previous_layer(handshake: dict[str, Any]) -> None:
    """A plan whose adjacent layers share a slot (the allocator never makes one, a plan switch or a
    scripted plan can): layer 1's fill waits until layer 0 is released, never overwrites it."""
    filler, worker, pool = handshake["filler"], handshake["worker"], handshake["pool"]
    plan = handshake["assignment"](1, [[0, 2], [1, 3]])  # both layers use both slots
    filling = filler.publish(0, 1, 4, False)
    assert filling is not None
    filler.fill_layer(0, 0, plan, filling)
    worker.begin(0)
    worker.acquire(0)
    writer = threading.Thread(target=filler.fill_layer, args=(0, 1, plan, filling))
    writer.start()
    writer.join(timeout=0.4)
    assert writer.is_alive() and _checksums(worker) == [row_checksum(pool.row(0, 0)), row_checksum(pool.row(0, 2))]
    worker.release(0)
    writer.join(timeout=3)
    assert not writer.is_alive()
    worker.acquire(1)
    assert _checksums(worker) == [row_checksum(pool.row(1, 1)), row_checksum(pool.row(1, 3))]


def test_coordinator_publishes_at_most_ahead_iterations_past_the_last_finished(handshake: dict[str, Any]) -> None:
    filler, worker, fill = handshake["filler"], handshake["worker"], handshake["fill"]
    # a header is never overwritten before its worker read it; a GPU transport publishes further ahead
    assert filler.ahead == CpuSharedMemoryTransport.publish_ahead <= AHEAD < HEADERS
    assert CudaIpcTransport.publish_ahead == AHEAD
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    fill(0, plan)
    for iteration in range(1, filler.ahead):  # ahead of the (idle) worker, within its reach: fine
        assert filler.publish(iteration, 1, 4, False) == [True]
    publisher = threading.Thread(target=filler.publish, args=(filler.ahead, 1, 4, False))
    publisher.start()
    publisher.join(timeout=0.3)
    assert publisher.is_alive(), f"iteration {filler.ahead} is published only once iteration 0 is finished"
    _run_iteration(worker, 0)
    publisher.join(timeout=3)
    assert not publisher.is_alive()


@pytest.mark.parametrize("ahead", [2, 3])
def test_an_overlapped_worker_finds_its_iteration_published_when_the_coordinator_publishes_3_ahead(
        handshake: dict[str, Any], ahead: int) -> None:
    """A worker that overlaps iterations (CUDA graphs) reports t − 1 finished only after it started t
    and just before it starts t + 1. Publishing 3 ahead (the GPU transport), the coordinator puts
    t + 1 out while t − 1 is still unreported; publishing 2 ahead (CPU), it cannot."""
    filler, worker, shared = handshake["filler"], handshake["worker"], handshake["shared"]
    filler.ahead = ahead
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    iterations = 6
    loop = FillLoop(filler, take_plan=lambda _: plan, control=lambda i: (4, i >= iterations))
    loop.start()
    early = []  # per iteration t ≥ 1: t + 1 published before the worker reported t − 1
    for t in range(iterations):
        header, _ = worker.begin(t)
        assert header is not None and header.iteration == t
        for layer in range(2):
            worker.acquire(layer)
            worker.release(layer)
        if t >= 1:  # the device runs t; t − 1 is not reported yet
            # at reach 3 it comes (however loaded the machine: up to 10 s); at reach 2 it cannot
            deadline = time.monotonic() + (10.0 if ahead == 3 else 0.2)
            while int(shared.state[0][PUBLISHED]) < t + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            early.append(int(shared.state[0][PUBLISHED]) >= t + 1)
            worker.finish(t - 1)  # reported only now, right before t + 1 begins
    worker.finish(iterations - 1)
    loop.join(timeout=10)
    assert not loop.is_alive() and loop.error is None
    assert early == [ahead == 3] * (iterations - 1), early


def test_a_late_iteration_is_claimed_and_never_filled(handshake: dict[str, Any]) -> None:
    filler, worker = handshake["filler"], handshake["worker"]
    worker.timeout_s = 0.2
    header, waited = worker.begin(0)
    assert header is None and waited >= 0.15  # not published in time: the worker runs it alone
    for layer in range(2):  # its own FULL flags let it through
        worker.acquire(layer)
        worker.release(layer)
    worker.finish(0)
    assert filler.publish(0, 1, 4, False) == [False]  # the coordinator must not fill a claimed iteration
    assert filler.publish(1, 1, 4, False) == [True]


def test_the_iteration_after_a_claimed_one_is_published_once_the_claimed_one_is_finished(
        handshake: dict[str, Any]) -> None:
    """A worker that claims iteration t sets t's FULL flags itself and leaves its FREE flags free: a
    fill of t + 1 put out ahead (publish reach 2) would set FULL flags that are already set — t
    consumes them, t + 1 waits for them forever (the 120 s hang a slow worker met in
    test_timeout_runs_degraded_instead_of_hanging) — and would copy into slots t may still read."""
    filler, worker, fill = handshake["filler"], handshake["worker"], handshake["fill"]
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    fill(0, plan)
    _run_iteration(worker, 0)
    worker.timeout_s = 0.2
    header, _ = worker.begin(1)
    assert header is None  # claimed: its FULL flags are its own
    assert filler.publish(1, 1, 4, False) == [False]
    ahead = threading.Thread(target=fill, args=(2, plan))  # publish iteration 2 and fill its layers
    ahead.start()
    ahead.join(timeout=0.3)
    assert ahead.is_alive(), "iteration 2 must wait until the claimed iteration 1 is finished"
    for layer in range(2):
        worker.acquire(layer)
        worker.release(layer)
    worker.finish(1)
    ahead.join(timeout=3)
    assert not ahead.is_alive()
    _run_iteration(worker, 2)  # its FULL flags are there (a lost one: FlagTimeout after 5 s)


def test_an_overlapped_worker_reporting_a_claimed_iteration_at_once_gets_the_next_ones_published(
        handshake: dict[str, Any]) -> None:
    """The worker's side of the rule above (node/worker.py: a degraded iteration is reported before
    the next one starts). An overlapped worker (CUDA graphs) reports t − 1 only just before t + 1;
    after it claimed t, the coordinator waits for t to be finished before it publishes t + 1, so a
    claimed t reported late would make t + 1 late too, and so on. Reported at once, t + 1 is published
    in time and the plan is back from the next iteration on, at publish reach 3 (a GPU's)."""
    filler, worker = handshake["filler"], handshake["worker"]
    filler.ahead = 3
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    late = {2}

    def take_plan(iteration: int) -> Assignment:
        if iteration in late:  # iteration 2 is published 1.5 s late: the worker claims it after 1 s, and
            late.discard(iteration)  # 3 comes out mid-way through the worker's 1 s wait for it
            time.sleep(1.5)
        return plan

    iterations = 6
    loop = FillLoop(filler, take_plan=take_plan, control=lambda i: (4, i >= iterations))
    loop.start()
    worker.timeout_s = 1.0
    claimed: list[int] = []
    unreported: list[int] = []  # launched, not reported yet (the overlap)
    for t in range(iterations):
        header, _ = worker.begin(t)
        if header is None:
            claimed.append(t)
        for layer in range(2):
            worker.acquire(layer)
            worker.release(layer)
        for done in unreported:  # t − 1: reported once t is under way
            worker.finish(done)
        unreported = []
        if header is None:
            worker.finish(t)  # a claimed iteration: at once
        else:
            unreported.append(t)
    for done in unreported:
        worker.finish(done)
    loop.join(timeout=10)
    assert not loop.is_alive() and loop.error is None
    assert claimed == [2], claimed


def test_a_dead_publisher_is_rescued_by_the_worker(handshake: dict[str, Any]) -> None:
    filler, worker, pool, shared = handshake["filler"], handshake["worker"], handshake["pool"], handshake["shared"]
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    filling = filler.publish(0, 1, 4, False)
    assert filling is not None
    filler.fill_layer(0, 0, plan, filling)  # the coordinator dies before filling layer 1
    worker.ops = CpuFlagOps(timeout_s=5.0, interrupted=worker.publisher_gone)
    worker.begin(0)
    worker.acquire(0)
    worker.release(0)
    rescued: list[int] = []

    def rescue(layer: int) -> None:
        rescued.append(layer)
        worker.slot(1).copy_(pool.row(1, 3))
        worker.ops.write(None, worker.buffers.flags, layer, 1, 1)

    threading.Timer(0.2, shared.detach_coordinator).start()
    worker.acquire(1, rescue)
    assert rescued == [1] and _checksums(worker)[1] == row_checksum(pool.row(1, 3))
    assert shared.attach_coordinator() == 2 and not shared.publisher_alive(1)


def test_a_new_coordinator_waits_until_its_predecessors_iterations_are_finished(handshake: dict[str, Any]) -> None:
    """The dead coordinator published iteration 0 but never claimed layer 1's flags: FREE[1] is 1 while
    the worker will still rescue and read layer 1's slots. A successor must not write any slot
    before the worker finished iteration 0."""
    filler, worker, pool, shared = handshake["filler"], handshake["worker"], handshake["pool"], handshake["shared"]
    plan = handshake["assignment"](1, [[0, 2], [1, 3]])  # both layers use both slots
    filling = filler.publish(0, 1, 4, False)
    assert filling is not None
    filler.fill_layer(0, 0, plan, filling)
    shared.detach_coordinator()  # dies before layer 1
    successor = SlotFiller(shared, filler.buffers, [1], filler.transport, 2, handshake["abort"],
                           shared.attach_coordinator(), resume_iteration=shared.resume_iteration())
    assert successor.resume_iteration == 1
    publisher = threading.Thread(target=successor.publish, args=(1, 1, 4, False))
    publisher.start()
    publisher.join(timeout=0.3)
    assert publisher.is_alive(), "iteration 0 is not finished: the successor must not start filling"
    worker.ops = CpuFlagOps(timeout_s=5.0, interrupted=worker.publisher_gone)
    worker.begin(0)
    for layer in range(2):
        def rescue(layer: int) -> None:
            worker.slot(0).copy_(pool.row(layer, 1))
            worker.slot(1).copy_(pool.row(layer, 3))
            worker.ops.write(None, worker.buffers.flags, layer, 1, 1)
        worker.acquire(layer, rescue)
        worker.release(layer)
    worker.finish(0)
    publisher.join(timeout=3)
    assert not publisher.is_alive()


def test_unchanged_slots_are_not_copied_again(handshake: dict[str, Any]) -> None:
    filler, worker, fill = handshake["filler"], handshake["worker"], handshake["fill"]
    plan = handshake["assignment"](1, [[0, -1], [-1, 3]])
    for iteration in range(3):
        fill(iteration, plan)
        _run_iteration(worker, iteration)
    # layer 0 always in slot 0, layer 1 always in slot 1: only the first iteration copies
    assert filler.stats.copies == 2
    assert filler.stats.bytes_streamed == 2 * SPEC.expert_numel * 4


def test_agreement_rules() -> None:
    ok = decide(torch.tensor([[1, 3, 77, 4, 0], [1, 3, 77, 4, 0]]))
    assert ok.use_plan and ok.all_published and ok.plan_id == 3 and ok.k == 4 and not ok.stop
    late = decide(torch.tensor([[1, 3, 77, 4, 0], [0, -1, -1, 0, 0]]))
    assert not late.use_plan and late.k == 4  # one rank timed out without a header: all run degraded
    assert not late.all_published  # ... and report it before the next iteration (node/worker.py)
    mixed = decide(torch.tensor([[1, 3, 77, 4, 0], [1, 3, 78, 4, 0]]))
    assert not mixed.use_plan  # two coordinators hold different tables under one plan id
    assert mixed.all_published  # degraded, but nothing was claimed: overlapped reports go on
    assert decide(torch.tensor([[1, 3, 77, 4, 1], [1, 3, 77, 4, 0]])).stop


def test_table_digest_tells_tables_apart() -> None:
    base = static_placement(2, 8, 2)
    one = plan_from_slots(base, torch.tensor([[[4, 5], [0, 1]], [[6, -1], [2, -1]]]))
    other = plan_from_slots(base, torch.tensor([[[4, 5], [0, 1]], [[7, -1], [2, -1]]]))
    assert table_from_plan(one, 1).digest() == table_from_plan(one, 9).digest()  # content, not id
    assert table_from_plan(one, 1).digest() != table_from_plan(other, 1).digest()
    assert table_from_plan(one, 1).digest() >= 0


# ------------------------------------------------------------------------------------------------
# Whole nodes
# ------------------------------------------------------------------------------------------------


def _setup(checkpoint: Path, k: int = 3, vmax: int = 2, group_size: int = 1) -> Any:
    config = RuntimeConfig.model_validate(
        {
            "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
            "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
            "vexpert": {"group_size": group_size, "vmax": vmax, "balance_threshold": 0.95},
            "tuning": {"allocation_interval": k},
            "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0, "slot_fill_timeout_s": 5.0},
        }
    )
    return resolve_setup(config, checkpoint)


def _slot_experts_computed(report: NodeReport, iteration: int, per_gpu: int) -> set[tuple[int, int, int]]:
    """(rank, layer, logical expert) computed from a slot in ``iteration``."""
    record = report.records[iteration]
    table = report.tables[record.plan_ids[0]]
    out = set()
    for rank, computed in computed_rows(record.details).items():
        for layer, row in enumerate(computed):
            for slot, rows in enumerate(row[per_gpu:]):
                if rows:
                    out.add((rank, layer, int(table.slot_expert[layer, rank, slot])))
    return out


def test_delayed_coordinator_and_scripted_plan_change(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=4)
    setup = _setup(tmp_path)
    base = static_placement(2, 8, 2)
    # rank 0 holds experts 0-3, rank 1 holds 4-7; G=1, vmax=2: two slots per buffer
    plan_a = plan_from_slots(base, torch.tensor([[[4, 5], [0, 1]], [[6, -1], [2, -1]]]))
    plan_b = plan_from_slots(base, torch.tensor([[[6, 7], [2, 3]], [[4, 5], [0, 1]]]))
    delayed = sequence(3, 1, 2)  # iteration 3, group 1 (layer 1): the first fill under plan B there
    report = NodeRuntime(
        setup,
        NodeOptions(
            workload=Workload(tokens_per_worker=24, seed=1),
            iterations=6,
            verify=True,
            allocate=False,
            filler=faulty_filler(delays={delayed: 0.8}),
            probe=SlotAudit,
        ),
        balance=scripted_plans({0: plan_a, 3: plan_b}),
    ).run()
    assert report.iterations == 6
    assert report.plan_switches == [(0, 1), (3, 2)]
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-5
    assert report.degraded_groups == 0
    assert report.records[3].wait_s >= 0.6  # workers waited for the late fill...
    assert max(r.wait_s for i, r in enumerate(report.records) if i != 3) < 0.6
    # ...and every slot they computed with held exactly the expert its plan names (bitwise)
    reader = CheckpointReader(tmp_path, SPEC)
    for record in report.records:
        table = report.tables[record.plan_ids[0]]
        for rank, per_group in slot_checksums(record.details).items():
            for layer, sums in enumerate(per_group):
                for slot, expert in enumerate(table.slot_expert[layer, rank].tolist()):
                    if expert >= 0:
                        assert sums[slot] == row_checksum(reader.expert(layer, expert, torch.float32))
    before, after = _slot_experts_computed(report, 2, 4), _slot_experts_computed(report, 4, 4)
    assert before <= {(r, lay, e) for lay in range(2) for r in range(2) for e in plan_a.slot_expert[lay, r].tolist() if e >= 0}
    assert after <= {(r, lay, e) for lay in range(2) for r in range(2) for e in plan_b.slot_expert[lay, r].tolist() if e >= 0}
    assert before and after and before != after


def test_slow_allocator_never_stalls_a_step(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=5)
    setup = _setup(tmp_path, k=12, vmax=1, group_size=2)
    drifting = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=32)
    # Every iteration takes >= 20 ms so the 1 s allocator spans ~40 of them on any machine, and a stall (a step
    # that waits for it) stands out by a wide margin from a slow step on a loaded 2-core CI runner (0.3 s seen).
    workload = PacedWorkload(**{f.name: getattr(drifting, f.name) for f in dataclasses.fields(drifting)}, pace_s=0.02)
    report = run_node(setup, NodeOptions(workload=workload, iterations=120, allocator=slow_allocator(1.0)))
    assert report.iterations == 120
    assert [length for _, length in report.windows] == [12] * 10  # counts all-reduced every k iterations
    assert report.allocations >= 1 and len(report.plan_switches) >= 2
    first_plan_at = report.plan_switches[1][0]
    assert first_plan_at >= 12 + 5, "workers kept iterating while the allocator ran"
    assert max(r.step_s for r in report.records) < 0.6  # the 1 s allocator never shows in a step
    assert report.degraded_groups == 0
    assert report.static_balance < report.vexpert_balance
    stats = report.metrics_text
    assert "vexpert_allocator_seconds_count" in stats and "vexpert_bytes_streamed_total" in stats


def test_timeout_runs_degraded_instead_of_hanging(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=6)
    setup = dataclasses.replace(_setup(tmp_path), slot_fill_timeout_s=0.3)
    base = static_placement(2, 8, 2)
    plan = plan_from_slots(base, torch.tensor([[[4, 5], [0, 1]], [[6, -1], [2, -1]]]))
    report = NodeRuntime(
        setup,
        NodeOptions(
            workload=Workload(tokens_per_worker=16),
            iterations=4,
            verify=True,
            allocate=False,
            filler=faulty_filler(publish_delays={1: 0.5}),  # iteration 1 is published too late
        ),
        balance=scripted_plans({0: plan}),
    ).run()
    assert report.degraded_groups >= 1
    assert report.records[1].plan_ids[0] == 0  # the late group ran on the static placement
    assert report.records[3].plan_ids == [1, 1]  # and the plan came back afterwards
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-5
    assert "vexpert_degraded_groups_total" in report.metrics_text


@pytest.mark.parametrize("shape", [(4, 2), (1, 5)])
def test_a_flag_address_is_the_indexed_elements(shape: tuple[int, int]) -> None:
    """The GPU flag operations compute an element's address instead of indexing the tensor: the same
    address for every element, on a contiguous tensor and on strided views of a larger one."""
    from vexpert_runtime.node.gpu_sync import flag_address

    base = torch.zeros(3 * shape[0], 2 * shape[1] + 1, dtype=torch.int32)
    for flags in (torch.zeros(shape, dtype=torch.int32), base[::3, 1::2], base[1:shape[0] + 1, :shape[1]]):
        for buffer in range(flags.shape[0]):
            for which in range(flags.shape[1]):
                assert flag_address(flags, buffer, which) == flags[buffer, which].data_ptr()
