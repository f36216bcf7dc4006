"""The slot transport across real processes: a worker process allocates and exports its slot
buffers and flags, the coordinator (this process) opens them, publishes iterations and fills each
layer through the protocol; the worker checks every slot's checksum once its wait for the layer is
over. Runs with the CPU shared-memory transport everywhere and with CUDA IPC where a GPU is visible:
there the worker's waits are enqueued on its stream (the GPU waits, not the CPU) and it reads the
checksums once the stream got past the wait."""

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

NUM_EXPERTS, NUMEL, SLOTS, LAYERS, ITERATIONS = 8, 4096, 2, 2, 3
DELAYED_SEQ, DELAY_S = 3, 0.8  # iteration 1, layer 1


def _worker(device: str, shared: SharedState, results: Any, bye: Any) -> None:
    transport = make_transport(device, 0)
    buffers = transport.allocate(SLOTS, NUMEL, torch.float32, LAYERS)
    results.put(("slots", transport.export(buffers)))
    stream = torch.cuda.Stream() if device == "cuda" else None
    if stream is not None:
        torch.cuda.set_stream(stream)
    stopping = threading.Event()
    slots = WorkerSlots(shared, 0, buffers, 30.0, transport.flag_ops(stopping.is_set), stream)
    for iteration in range(ITERATIONS):
        header, _ = slots.begin(iteration)
        for layer in range(LAYERS):
            start = time.perf_counter()
            slots.acquire(layer)
            if stream is not None:
                stream.synchronize()  # the test reads the slots on the host: wait for the GPU's wait
            waited = time.perf_counter() - start
            sums = [row_checksum(slots.slot(s)) for s in range(SLOTS)]
            results.put(("layer", iteration, layer, header.plan_id if header else -1, sums, waited))
            time.sleep(0.05)  # the layer's compute
            slots.release(layer)
        slots.finish(iteration)
    if stream is not None:
        stream.synchronize()
    bye.get(timeout=30)  # keep the exported buffers alive until the coordinator is done with them


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_coordinator_fills_another_process_slots(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ctx = multiprocessing.get_context("spawn")
    transport = make_transport(device, 0)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(LAYERS, NUM_EXPERTS, NUMEL, generator=gen)
    pool = ExpertPool.build(
        torch.arange(NUM_EXPERTS).expand(LAYERS, NUM_EXPERTS).contiguous(),
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
        assert buffers.slots.device.type == device and buffers.flags.device.type == device
        # the worker is EP rank 1 of 2 (resident experts 4..7); alternating layout: layer 0 in slot 0,
        # layer 1 in slot 1; plan B overlaps (layer 0 takes both slots), so its fills wait for releases
        filler = SlotFiller(shared, [buffers], [1], transport, LAYERS, abort, shared.attach_coordinator())
        base = static_placement(LAYERS, NUM_EXPERTS, 2)
        plans = [
            plan_from_slots(base, torch.tensor([[[-1, -1], [0, -1]], [[-1, -1], [-1, 3]]])),
            plan_from_slots(base, torch.tensor([[[-1, -1], [3, 2]], [[-1, -1], [-1, 1]]])),
        ]
        tables = [table_from_plan(p, i + 1) for i, p in enumerate(plans)]
        for iteration in range(ITERATIONS):
            assignment = Assignment(tables[iteration % 2], pool)
            filling = filler.publish(iteration, assignment.table.plan_id, 4, False)
            assert filling == [True]
            for layer in range(LAYERS):
                seq = iteration * LAYERS + layer
                if seq == DELAYED_SEQ:
                    time.sleep(DELAY_S)
                filler.fill_layer(iteration, layer, assignment, filling)  # GPU: enqueued, returns at once
        seen = {}
        for _ in range(ITERATIONS * LAYERS):
            _, iteration, layer, plan_id, sums, waited = results.get(timeout=60)
            seen[(iteration, layer)] = (plan_id, sums, waited)
        assert transport.drain(buffers, timeout_s=10.0)
    finally:
        bye.put("bye")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    for (iteration, layer), (plan_id, sums, _) in seen.items():
        table = tables[iteration % 2]
        assert plan_id == table.plan_id
        for slot, expert in enumerate(table.slot_expert[layer, 1].tolist()):
            if expert >= 0:
                assert sums[slot] == row_checksum(rows[layer, expert]), (iteration, layer, slot)
    assert seen[(1, 1)][2] >= DELAY_S / 2  # the worker waited for the late fill (less its own compute)
    # copies per layer: iteration 0 (A) 1 + 1, iteration 1 (B) 2 + 1, iteration 2 (A) 1 + 1 (B overwrote both)
    assert filler.stats.copies == 2 + 3 + 2
