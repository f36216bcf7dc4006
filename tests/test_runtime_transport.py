"""The slot transport across real processes: a worker process allocates and exports its slot
buffers, the coordinator (this process) opens them and fills them through the protocol; the worker
checks every slot's checksum after its wait. Runs with the CPU shared-memory transport everywhere
and with CUDA IPC where a GPU is visible (the same code path the GPU node will use)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
import torch

from vexpert_runtime.model.ep_moe import plan_from_slots, table_from_plan
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.protocol import Assignment, SharedState, SlotFiller, WorkerSlots
from vexpert_runtime.node.slots import row_checksum
from vexpert_runtime.node.transport import make_transport
from vexpert_runtime.policy.placement import static_placement

NUM_EXPERTS, NUMEL, SLOTS, SEQS = 8, 4096, 2, 6
DELAYED_SEQ, DELAY_S = 3, 0.8


def _worker(device: str, shared: SharedState, results: Any, bye: Any) -> None:
    transport = make_transport(device, 0)
    buffers = transport.allocate_slots(SLOTS, NUMEL, torch.float32)
    results.put(("slots", transport.export(buffers)))
    slots = WorkerSlots(shared, 0, buffers, timeout_s=10.0)
    for seq in range(SEQS):
        ready, header, waited = slots.acquire(seq)
        sums = [row_checksum(slots.slot(s)) for s in range(SLOTS)]
        results.put(("seq", seq, ready, header.plan_id if header else -1, sums, waited))
        time.sleep(0.05)  # the layer's compute
        slots.release(seq)
    bye.get(timeout=30)  # keep the exported buffer alive until the coordinator is done with it


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_coordinator_fills_another_process_slots(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ctx = multiprocessing.get_context("spawn")
    transport = make_transport(device, 0)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2, NUM_EXPERTS, NUMEL, generator=gen)
    pool = ExpertPool.build(
        torch.arange(NUM_EXPERTS).expand(2, NUM_EXPERTS).contiguous(),
        NUM_EXPERTS,
        NUMEL,
        lambda layer, experts: rows[layer, experts],
        lambda n, numel: transport.host_buffer(n, numel, torch.float32),
    )
    if device == "cuda":
        assert pool.buffers[0].is_pinned()
    shared = SharedState.create(1, SLOTS, ctx)
    results, bye = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_worker, args=(device, shared, results, bye), daemon=True)
    proc.start()
    abort = threading.Event()
    try:
        kind, handle = results.get(timeout=120)
        assert kind == "slots"
        buffers = transport.open(handle)
        assert buffers.device.type == device
        # the worker is EP rank 1 of 2 (resident experts 4..7); sequence q fills layer q mod 2
        filler = SlotFiller(shared, [buffers], [1], transport, num_layers=2, abort=abort)
        base = static_placement(2, NUM_EXPERTS, 2)
        plans = [
            plan_from_slots(base, torch.tensor([[[-1, -1], [0, 1]], [[-1, -1], [2, 3]]])),
            plan_from_slots(base, torch.tensor([[[-1, -1], [3, 2]], [[-1, -1], [1, -1]]])),
        ]
        tables = [table_from_plan(p, i + 1) for i, p in enumerate(plans)]
        for seq in range(SEQS):
            if seq == DELAYED_SEQ:
                time.sleep(DELAY_S)
            filler.fill(seq, Assignment(tables[(seq // 2) % 2], pool), k=4, stop=False)
        seen = {}
        for _ in range(SEQS):
            _, seq, ready, plan_id, sums, waited = results.get(timeout=60)
            seen[seq] = (ready, plan_id, sums, waited)
    finally:
        bye.put("bye")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    for seq in range(SEQS):
        ready, plan_id, sums, waited = seen[seq]
        table = tables[(seq // 2) % 2]
        assert ready and plan_id == table.plan_id
        layer = seq % 2
        for slot, expert in enumerate(table.slot_expert[layer, 1].tolist()):
            if expert >= 0:
                assert sums[slot] == row_checksum(rows[layer, expert]), (seq, slot)
    assert seen[DELAYED_SEQ][3] >= DELAY_S / 2  # the worker waited for the late fill (less its own compute)
    # copies per sequence (one buffer, both layers of these plans use slot 0): 2, 2, 2 (plan B), 1 (B's
    # layer 1 has one slot), 2 (A again), 2 — every slot was rewritten by the layer in between
    assert filler.stats.copies == 11
