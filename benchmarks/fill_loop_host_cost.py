"""The coordinator's fill loop per iteration, host time only, at a real model's size.

Every iteration the coordinator's fill thread walks every MoE layer of every local worker
(:meth:`~vexpert_runtime.node.protocol.SlotFiller.fill_layer`): wait until the layer's slots are free,
claim them, copy the planned experts a slot does not hold yet, mark the layer full. While a plan stands
nothing is copied, yet the walk runs — on a GPU as stream operations the thread enqueues — and an
iteration's fills must be enqueued faster than the workers run the iteration. This times the walk on
the CPU transport (its flag operations are polled host writes instead of stream operations through
ctypes; tiny expert rows, so the copies cost next to nothing), the workers' side of the flags (each
layer consumed and released) set between calls and not timed, at DeepSeek-V3's size on an 8-GPU node
(58 MoE layers, 256 experts, 2 slots per GPU, 64 EP ranks of which 8 local) and at the serving
benchmark's (3 × 8, one rank: no virtual experts), for two plans: every layer with a virtual expert in each slot (the
slots, shared by the layers, are refilled every layer) and none (every layer above τ: only flags).

    .venv/bin/python benchmarks/fill_loop_host_cost.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time

import torch

from vexpert_runtime.model.ep_moe import plan_from_slots, table_from_plan
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.gpu_sync import FREE, FULL
from vexpert_runtime.node.protocol import Assignment, SharedState, SlotFiller
from vexpert_runtime.node.transport import CpuSharedMemoryTransport
from vexpert_runtime.policy.placement import static_placement

NUMEL = 64  # an expert row here: nothing is copied in the steady state, so its size does not matter


def measure(name: str, layers: int, experts: int, world: int, local: int, slots: int, iterations: int,
            vexperts: bool) -> dict[str, object]:
    base = static_placement(layers, experts, world)
    slot_expert = torch.full((layers, world, slots), -1, dtype=torch.int64)
    for rank in range(world if vexperts else 0):  # each rank's slots: experts resident elsewhere
        others = [e for e in range(experts) if int(base[0, e]) != rank]
        slot_expert[:, rank] = torch.tensor(others[rank * slots % len(others):][:slots])
    table = table_from_plan(plan_from_slots(base, slot_expert), 1)
    pooled = torch.arange(experts).expand(layers, experts).contiguous()
    pool = ExpertPool.build(pooled, experts, NUMEL, lambda layer, ids: torch.zeros(len(ids), NUMEL),
                            lambda rows, numel: torch.empty(rows, numel))
    transport = CpuSharedMemoryTransport()
    shared = SharedState.create(local, slots, multiprocessing.get_context("spawn"))
    buffers = [transport.allocate(slots, NUMEL, torch.float32, layers=layers) for _ in range(local)]
    filler = SlotFiller(shared, buffers, list(range(local)), transport, layers, threading.Event(),
                        shared.attach_coordinator())
    assignment, filling = Assignment(table, pool), [True] * local

    def consumed(layer: int) -> None:  # the workers' side of one layer: consumed and released
        for b in buffers:
            b.flags[layer, FULL] = 0
            b.flags[layer, FREE] = 1

    for b in buffers:
        b.flags[:, FREE] = 1
    spent = 0.0
    for iteration in range(iterations + 1):  # iteration 0 untimed (every layer waited for once)
        for layer in range(layers):
            start = time.perf_counter()
            filler.fill_layer(iteration, layer, assignment, filling)
            spent += time.perf_counter() - start if iteration else 0.0
            consumed(layer)
    return {"model": name, "layers": layers, "local_workers": local, "slots": slots, "vexperts": vexperts,
            "copies_per_iteration": round(filler.stats.copies / (iterations + 1), 1),
            "ms_per_iteration": round(spent / iterations * 1e3, 3),
            "us_per_layer_and_worker": round(spent / iterations / (layers * local) * 1e6, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    for vexperts in (True, False):
        print(json.dumps(measure("deepseek-v3", 58, 256, 64, 8, 2, args.iterations, vexperts)), flush=True)
        if not vexperts:  # one rank: no expert lives elsewhere
            print(json.dumps(measure("bench-3x8", 3, 8, 1, 1, 2, args.iterations * 20, vexperts)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
