"""A worker process: one EP rank. It holds its base experts, routes its tokens and runs the EP MoE
forward with the other workers over torch.distributed, computing with the slots the coordinator
filled (layer by layer, under the :mod:`~vexpert_runtime.node.protocol`).

On CPU everything goes over gloo; on GPUs (one worker per GPU, ``cuda:<local rank>``) the rows and
counts are all-to-all'd over NCCL on device tensors and the tiny control collectives (plan agreement,
count windows) over gloo, through one process group with the ``cpu:gloo,cuda:nccl`` backend.
"""

from __future__ import annotations

import contextlib
import queue
import time
import traceback
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
    MoESpec,
)
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    RoutingTable,
    base_experts,
    ep_moe_layer,
    static_table,
)
from vexpert_runtime.model.moe_math import rms_norm, shared_forward
from vexpert_runtime.model.routing import route
from vexpert_runtime.node.coordinator import die_with_parent
from vexpert_runtime.node.messages import (
    Bye,
    CountsWindow,
    IterationDone,
    SlotsExported,
    WorkerDone,
    WorkerFailed,
    WorkerInputError,
    WorkerReady,
)
from vexpert_runtime.node.protocol import SharedState, WorkerSlots, agree
from vexpert_runtime.node.slots import sequence
from vexpert_runtime.node.transport import make_transport
from vexpert_runtime.simulation.workload import Workload

COLLECTIVE_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerArgs:
    """Everything a worker process needs (pickled at spawn)."""

    local_rank: int
    rank: int
    world: int
    master_addr: str
    master_port: int
    checkpoint: str
    spec: MoESpec
    dtype: str
    device: str
    slots: int
    group_size: int
    k: int
    timeout_s: float
    workload: Workload
    shared: SharedState
    results: Any
    control: Any
    parent_pid: int
    verify: bool
    record: bool




def _on_device(weights: Any, device: torch.device) -> Any:
    """A copy of a weights dataclass (router, shared expert) with every tensor on ``device``."""
    if weights is None or device.type == "cpu":
        return weights
    moved = {f.name: getattr(weights, f.name) for f in fields(weights)}
    return replace(weights, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a worker process."""
    die_with_parent(args.parent_pid)
    torch.set_num_threads(1)
    try:
        _Worker(args).run()
    except VExpertInputError as exc:
        args.results.put(WorkerInputError(args.rank, exc.field, exc.problem, exc.fix))
    except BaseException:
        args.results.put(WorkerFailed(args.rank, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class _Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        spec = args.spec
        self.spec = spec
        self.dtype: torch.dtype = getattr(torch, args.dtype)
        self.per_gpu = spec.num_experts // args.world
        self.tables: dict[int, RoutingTable] = {
            0: static_table(spec.num_layers, spec.num_experts, args.world, args.slots)
        }
        self.digests: dict[int, int] = {}
        self.device = torch.device("cuda", args.local_rank) if args.device == "cuda" else torch.device("cpu")

    def _digest(self, table: RoutingTable) -> int:
        if table.plan_id not in self.digests:
            self.digests[table.plan_id] = table.digest()
        return self.digests[table.plan_id]

    def _table(self, plan_id: int) -> RoutingTable:
        """The routing table of ``plan_id`` (the coordinator queues it before announcing it)."""
        while plan_id not in self.tables:
            msg = self.args.control.get(timeout=COLLECTIVE_TIMEOUT_S)
            if isinstance(msg, RoutingTable):
                self.tables[msg.plan_id] = msg
        for old in [p for p in self.tables if 0 < p < plan_id - 4]:
            del self.tables[old]
            self.digests.pop(old, None)
        return self.tables[plan_id]

    def run(self) -> None:
        import torch.distributed as dist

        args, spec = self.args, self.spec
        device = self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        transport = make_transport(args.device, args.local_rank)
        buffers = transport.allocate_slots(args.slots, spec.expert_numel, spec.row_dtype(self.dtype))
        args.results.put(SlotsExported(args.local_rank, transport.export(buffers)))
        reader = CheckpointReader(args.checkpoint, spec)
        layers = range(spec.num_layers)
        self.routers = [_on_device(reader.router(i), device) for i in layers]
        self.shared = [_on_device(reader.shared(i, self.dtype), device) for i in layers]
        mine = base_experts(spec.num_experts, args.world, args.rank)
        self.base = [reader.experts(i, mine, self.dtype).to(device) for i in layers]
        dist.init_process_group(
            "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl",
            init_method=f"tcp://{args.master_addr}:{args.master_port}",
            rank=args.rank,
            world_size=args.world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.group = dist.group.WORLD if args.world > 1 else None
        self.slots = WorkerSlots(args.shared, args.local_rank, buffers, args.timeout_s)
        args.results.put(WorkerReady(args.rank))
        self.slots.wait_for_coordinator(STARTUP_TIMEOUT_S)  # then degraded until one attaches
        self._loop()
        args.results.put(WorkerDone(args.rank))
        if device.type == "cuda":
            self._await_bye()

    def _await_bye(self) -> None:
        """Keep the IPC-exported slots alive until the coordinator has dropped its mappings."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                if isinstance(self.args.control.get(timeout=max(0.0, deadline - time.monotonic())), Bye):
                    return
            except queue.Empty:
                return

    def _loop(self) -> None:
        args, spec = self.args, self.spec
        num_local = self.per_gpu + args.slots
        k = args.k
        window: list[torch.Tensor] = []
        window_start = 0
        iteration = 0
        while True:
            start = time.perf_counter()
            h = args.workload.inputs(iteration, args.rank, spec.hidden_size, self.dtype).to(self.device)
            bias = args.workload.logit_bias(iteration)
            if bias is not None:
                bias = bias.to(self.device)
            counts = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.int64)
            computed = torch.zeros(spec.num_layers, num_local, dtype=torch.int64)
            waited = 0.0
            degraded = 0
            plan_ids: list[int] = []
            checksums: list[list[str]] = []
            stop = False
            for layer in range(spec.num_layers):
                seq = sequence(iteration, layer, spec.num_layers)
                ready, header, wait_s = self.slots.acquire(seq)
                waited += wait_s
                stop_flag = layer == 0 and self.slots.stop_requested(iteration)
                announced = self._table(header.plan_id) if header is not None and not header.stop else None
                digest = self._digest(announced) if announced is not None else -1
                agreement = agree(ready, header, digest, args.world, self.group, stop=stop_flag)
                if layer == 0:
                    if agreement.stop:
                        stop = True
                        self.slots.release(seq)
                        break
                    k = agreement.k or k
                if agreement.use_plan and announced is not None:
                    table = announced
                    self.slots.check_tags(seq, table, layer, args.rank)
                else:
                    table = self.tables[0]
                    degraded += 1
                plan_ids.append(table.plan_id)
                if args.record:
                    checksums.append(self._checksums())
                h = self._layer(h, layer, seq, table, bias, counts, computed)
            if stop:
                if window:
                    self._flush(window, window_start)
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step = time.perf_counter() - start
            loads = torch.zeros(spec.num_layers, args.world, dtype=torch.int64)
            loads[:, args.rank] = computed.sum(1)
            window.append(torch.cat([counts, loads], dim=1))
            args.results.put(
                IterationDone(
                    rank=args.rank,
                    iteration=iteration,
                    step_s=step,
                    wait_s=waited,
                    degraded_layers=degraded,
                    plan_ids=plan_ids,
                    output=h.to(torch.float32).cpu().numpy() if args.verify else None,
                    computed=computed.tolist() if args.record else None,
                    slot_checksums=checksums if args.record else None,
                )
            )
            iteration += 1
            if len(window) >= k:
                self._flush(window, window_start)
                window, window_start = [], iteration

    def _layer(
        self,
        h: torch.Tensor,
        layer: int,
        seq: int,
        table: RoutingTable,
        bias: torch.Tensor | None,
        counts: torch.Tensor,
        computed: torch.Tensor,
    ) -> torch.Tensor:
        args, spec = self.args, self.spec
        normed = rms_norm(h)
        ids, weights = route(normed, self.routers[layer], spec, None if bias is None else bias[layer])
        if layer == 0:
            # This iteration's statistics stay on the device and reach the host once, after the
            # last layer: a copy per layer would synchronise the host with every layer.
            self.device_counts = torch.zeros(counts.shape, dtype=torch.int64, device=self.device)
            self.device_computed = torch.zeros(computed.shape, dtype=torch.int64, device=self.device)
        flat = ids.reshape(-1)
        self.device_counts[layer].scatter_add_(0, flat, torch.ones_like(flat))
        if not hasattr(self, "device_tables"):
            # Fixed-shape device tables the layer reads: the static one (degraded layers) and the
            # current plan's, which a plan switch overwrites in place.
            self.device_tables = {
                static: DeviceRoutingTable.allocate(spec.num_layers, spec.num_experts, args.world, args.slots, self.device)
                for static in (True, False)
            }
        device_table = self.device_tables[table.plan_id == 0]
        if device_table.plan_id != table.plan_id:
            device_table.load(table)
        base, slots = self.base[layer], self.slots
        expert_format = spec.expert_format(self.dtype)
        y, stats = ep_moe_layer(
            normed,
            ids,
            weights,
            device_table,
            layer,
            # Grouped GEMMs on CUDA (bf16/fp16), the per-expert loop elsewhere; block-FP8 rows are
            # dequantised into the GEMM.
            ExpertStacks(base, slots.buffers, spec.intermediate_size, format=expert_format),
            shared_forward(normed, self.shared[layer]),
            args.rank,
            args.world,
            self.group,
            after_compute=lambda: slots.release(seq),
        )
        self.device_computed[layer] = stats.computed
        if layer == spec.num_layers - 1:
            counts.copy_(self.device_counts)
            computed.copy_(self.device_computed)
        return h + y

    def _checksums(self) -> list[str]:
        from vexpert_runtime.node.slots import row_checksum

        return [row_checksum(self.slots.slot(s)) for s in range(self.args.slots)]

    def _flush(self, window: list[torch.Tensor], start: int) -> None:
        """All-reduce the window's [n, L, E + N] counts/loads; local rank 0 hands them to its coordinator."""
        import torch.distributed as dist

        data = torch.stack(window)
        if self.group is not None:
            dist.all_reduce(data, group=self.group)
        if self.args.local_rank == 0:
            self.args.results.put(CountsWindow(start, data.numpy()))

