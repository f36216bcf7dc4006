"""What a node worker computes each iteration: its :class:`ModelRunner`.

The worker (:mod:`.worker`) owns the process — the slots and the slot protocol, the plan agreement,
the count windows, the watchdog and rescue, profiling, the ``IterationDone`` messages — and hands the
model work of every iteration to one runner, chosen once at start (:func:`choose_runner`):

- :class:`SyntheticDecodeRunner` (``vexpert node`` / ``vexpert demo``): every MoE layer of the
  checkpoint over the workload's hidden states — routers, shared and base experts read from the
  checkpoint, the iteration one CUDA graph (:class:`~.step_graph.StepGraph`) where it can be.
- :class:`ServingRunner` (``vexpert serve``): a :class:`~vexpert_runtime.serve.rank.ServingRank` —
  the serving logic stays in :mod:`vexpert_runtime.serve`; this adapts it to the worker's loop.

Per iteration the worker calls :meth:`ModelRunner.await_work` (before the iteration is timed),
:meth:`ModelRunner.prepare` (timed, before the plan agreement, so it overlaps it) and
:meth:`ModelRunner.run` with the agreed routing table. A runner writes the iteration's statistics
into the worker's :class:`IterationStats` on the device; the worker copies them to the host.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import CheckpointReader, MoESpec, RouterWeights, SharedExpertWeights
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    RoutingTable,
    base_experts,
    ep_moe_layer,
)
from vexpert_runtime.model.moe_math import rms_norm, shared_forward
from vexpert_runtime.model.routing import route
from vexpert_runtime.node.protocol import Rescue, WorkerSlots
from vexpert_runtime.node.step_graph import StepGraph
from vexpert_runtime.workload import Workload

if TYPE_CHECKING:
    from vexpert_runtime.node.worker_args import WorkerArgs
    from vexpert_runtime.serve.rank import ServeWorkerArgs


@dataclass(frozen=True)
class IterationOutput:
    """What an iteration produced beyond its statistics.

    ``hidden``: the new hidden states [B, H] (the synthetic decode; None when serving) — on a GPU
    valid once the iteration's work is done, and a replayed graph's are overwritten by its next
    replay. ``graphed``: whether the iteration replayed a CUDA graph.
    """

    hidden: torch.Tensor | None
    graphed: bool


@dataclass(frozen=True)
class IterationStats:
    """An iteration's statistics: ``counts`` [L, E] (tokens routed to each expert) and ``computed``
    [L, E/N + S] (rows computed per resident expert and slot), column blocks of ``all`` — one
    memset and one copy per iteration."""

    all: torch.Tensor
    counts: torch.Tensor
    computed: torch.Tensor

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, num_local: int, device: torch.device | None = None,
              pin_memory: bool = False) -> IterationStats:
        stats = torch.zeros(num_layers, num_experts + num_local, dtype=torch.int64, device=device,
                            pin_memory=pin_memory)
        return cls(stats, stats[:, :num_experts], stats[:, num_experts:])


@dataclass(frozen=True)
class DeviceTables:
    """The fixed-shape device routing tables a worker's layers read: ``static`` (degraded
    iterations) and ``plan``, which a plan switch overwrites in place (same tensors, no new shapes)."""

    static: DeviceRoutingTable
    plan: DeviceRoutingTable

    @classmethod
    def allocate(cls, spec: MoESpec, world: int, slots: int, device: torch.device) -> DeviceTables:
        static = DeviceRoutingTable.allocate(spec.num_layers, spec.num_experts, world, slots, device)
        return cls(static=static, plan=DeviceRoutingTable.allocate(spec.num_layers, spec.num_experts, world, slots, device))


def _loaded(device_table: DeviceRoutingTable, table: RoutingTable) -> DeviceRoutingTable:
    """``device_table`` holding ``table`` (loaded in place unless it holds it already)."""
    if device_table.plan_id != table.plan_id:
        device_table.load(table)
    return device_table


@dataclass(frozen=True)
class RunnerContext:
    """What a worker hands its runner once the process group and the slots exist.

    ``group``: the EP process group (None with one rank). ``slots``: the worker's side of the slot
    protocol over its ``num_slots`` slots (S; the buffer holds at least one row). ``rescue``: on
    CPU, what fills a layer's slots when their coordinator died during the wait (None on a GPU: the
    worker's watchdog rescues). ``stats``: where the iteration's statistics go, on the device.
    ``graph_stream``: capture CUDA graphs on this stream (None: run eagerly).
    ``stop_requested(iteration)``: whether the node or the worker is stopping before ``iteration``;
    ``heartbeat()``: tells the supervisor an idle worker is alive.
    """

    spec: MoESpec
    rank: int
    world: int
    group: Any
    device: torch.device
    dtype: torch.dtype
    slots: WorkerSlots
    num_slots: int
    rescue: Rescue | None
    tables: DeviceTables
    stats: IterationStats
    graph_stream: Any
    dispatch: str
    stop_requested: Callable[[int], bool]
    heartbeat: Callable[[], None]


class ModelRunner(Protocol):
    """The model work of a worker's iterations.

    ``overlaps_iterations``: :meth:`run` returns with the iteration enqueued on the device, whose
    outputs (``hidden``) nobody reads, so the worker may start the next before reporting this one.
    """

    overlaps_iterations: bool

    def has_work(self) -> bool:
        """Whether another iteration would do anything (false: the worker may report and idle)."""

    def await_work(self, iteration: int) -> None:
        """Return once ``iteration`` is to run — or the node is stopping (not timed)."""

    def prepare(self, iteration: int) -> None:
        """The iteration's work that does not depend on its plan (timed, before the plan agreement)."""

    def run(self, iteration: int, table: RoutingTable, use_plan: bool) -> IterationOutput:
        """Enqueue (GPU) or run (CPU) the iteration with ``table`` (``use_plan``: the plan's table,
        its slots filled by the coordinator — checked on CPU — else the static one); its statistics
        land in the context's device stats."""


RunnerStart = Callable[[RunnerContext], ModelRunner]


def choose_runner(args: WorkerArgs, reader: CheckpointReader, device: torch.device,
                  dtype: torch.dtype) -> RunnerStart:
    """The worker's runner for its mode (serving when ``args.serve`` is set), chosen once: how to
    start it once the process group and the slots exist. The synthetic decode reads its weights now,
    before the process group forms; a server's model holds its own router, shared and resident
    experts and loads when started."""
    serve = args.serve
    if serve is None:
        weights = DecodeWeights.load(reader, args.spec, args.rank, args.world, dtype, device)
        workload = args.workload
        return lambda context: SyntheticDecodeRunner(context, weights, workload)
    return lambda context: ServingRunner(context, serve)


# ---------------------------------------------------------------------------------------------
# Synthetic decode (vexpert node)
# ---------------------------------------------------------------------------------------------


def _on_device(weights: Any, device: torch.device) -> Any:
    """A copy of a weights dataclass (router, shared expert) with every tensor on ``device``."""
    if weights is None or device.type == "cpu":
        return weights
    moved = {f.name: getattr(weights, f.name) for f in fields(weights)}
    return replace(weights, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})


@dataclass(frozen=True)
class DecodeWeights:
    """The synthetic decode's weights on the worker's device, per MoE layer: the router, the shared
    expert (None without one) and this rank's base experts [E/N, D]."""

    routers: list[RouterWeights]
    shared: list[SharedExpertWeights | None]
    base: list[torch.Tensor]

    @classmethod
    def load(cls, reader: CheckpointReader, spec: MoESpec, rank: int, world: int, dtype: torch.dtype,
             device: torch.device) -> DecodeWeights:
        layers = range(spec.num_layers)
        routers = [_on_device(reader.router(i), device) for i in layers]
        shared = [_on_device(reader.shared(i, dtype), device) for i in layers]
        mine = base_experts(spec.num_experts, world, rank)
        base = [reader.experts(i, mine, dtype).to(device) for i in layers]
        return cls(routers=routers, shared=shared, base=base)


@dataclass(frozen=True)
class _Inputs:
    """An iteration's hidden states [B, H] and router skew [L, E] (or None), on the device."""

    hidden: torch.Tensor
    bias: torch.Tensor | None


class SyntheticDecodeRunner:
    """Every MoE layer of the checkpoint over the workload's hidden states, EP over the group,
    computing with the slots the coordinator filled.

    Iterations of the agreed plan on a GPU replay the captured step (captured at the first one after
    two warm-up iterations, where ``graph_stream`` is set); degraded ones (static table) run eagerly."""

    def __init__(self, context: RunnerContext, weights: DecodeWeights, workload: Workload) -> None:
        self.context = context
        self.spec = context.spec
        self.weights = weights
        self.workload = workload
        self.expert_format = context.spec.expert_format(context.dtype)  # how slot and resident rows are stored
        self.graph_stream = context.graph_stream
        self.step_graph: StepGraph | None = None
        self._inputs: _Inputs | None = None

    overlaps_iterations = False  # verification and slot probes read each iteration's output

    def has_work(self) -> bool:
        return True

    def await_work(self, iteration: int) -> None:
        """The workload always has the next iteration."""

    def prepare(self, iteration: int) -> None:
        """The workload's inputs of ``iteration``, uploaded without waiting."""
        ctx = self.context
        hidden = self._upload(self.workload.inputs(iteration, ctx.rank, self.spec.hidden_size, ctx.dtype))
        bias = self.workload.logit_bias(iteration)
        self._inputs = _Inputs(hidden, None if bias is None else self._upload(bias))

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the worker's device; on a GPU through pinned memory, without waiting."""
        if self.context.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.context.device, non_blocking=True)

    def run(self, iteration: int, table: RoutingTable, use_plan: bool) -> IterationOutput:
        inputs = self._inputs
        assert inputs is not None, "prepare() before run()"
        self._inputs = None
        h, bias = inputs.hidden, inputs.bias
        # the static table for degraded iterations, the plan's (loaded in place) for every agreed plan —
        # the opening static plan too, which a node keeps while its allocations are skipped (one rank, a
        # balanced load): a captured step reads the next plan without re-capture
        tables = self.context.tables
        device_table = _loaded(tables.plan if use_plan else tables.static, table)
        graph = self.step_graph
        if self.graph_stream is not None and use_plan and iteration >= 2 and (graph is None or graph.fits(h, bias)):
            if graph is None:
                try:
                    graph = self.step_graph = StepGraph(
                        lambda x, b: self._layers(x, iteration, table, device_table, b, check=False),
                        self.graph_stream, h, bias)
                except Exception as exc:  # serve eagerly rather than not at all
                    self.graph_stream = None
                    print(f"vexpert-worker-{self.context.rank}: CUDA graph capture failed, running eagerly: {exc}",
                          file=sys.stderr, flush=True)
            if graph is not None:
                return IterationOutput(hidden=graph.replay(h, bias), graphed=True)
        h = self._layers(h, iteration, table, device_table, bias, use_plan)
        return IterationOutput(hidden=h, graphed=False)

    def _layers(self, h: torch.Tensor, iteration: int, table: RoutingTable, device_table: DeviceRoutingTable,
                bias: torch.Tensor | None, check: bool) -> torch.Tensor:
        self.context.stats.counts.zero_()
        for layer in range(self.spec.num_layers):
            h = self._layer(h, layer, iteration, table, device_table, bias, check)
        return h

    def _layer(
        self,
        h: torch.Tensor,
        layer: int,
        iteration: int,
        table: RoutingTable,
        device_table: DeviceRoutingTable,
        bias: torch.Tensor | None,
        check: bool,
    ) -> torch.Tensor:
        ctx, spec, weights = self.context, self.spec, self.weights
        normed = rms_norm(h)
        ids, topk_weights = route(normed, weights.routers[layer], spec, None if bias is None else bias[layer])
        flat = ids.reshape(-1)
        ctx.stats.counts[layer].scatter_add_(0, flat, torch.ones_like(flat))
        slots = ctx.slots

        def slot_wait() -> None:
            slots.acquire(layer, ctx.rescue)
            if check and ctx.device.type == "cpu":  # on a GPU the wait is only enqueued
                slots.check_tags(iteration, table, layer, ctx.rank)

        y, stats = ep_moe_layer(
            normed,
            ids,
            topk_weights,
            device_table,
            layer,
            # Grouped GEMMs on CUDA (bf16/fp16), the per-expert loop elsewhere; block-FP8 rows are
            # dequantised into the GEMM.
            ExpertStacks(weights.base[layer], slots.buffers.slots, spec.intermediate_size, format=self.expert_format),
            shared_forward(normed, weights.shared[layer]),
            ctx.rank,
            ctx.world,
            ctx.group,
            slot_wait=slot_wait,
            after_compute=lambda: slots.release(layer),
            dispatch=ctx.dispatch,  # type: ignore[arg-type]  # validated by the setup
        )
        ctx.stats.computed[layer] = stats.computed
        return h + y


# ---------------------------------------------------------------------------------------------
# Serving (vexpert serve)
# ---------------------------------------------------------------------------------------------


class ServingRunner:
    """A :class:`~vexpert_runtime.serve.rank.ServingRank` (model, EP experts, scheduler) in the
    worker's loop: its MoE layers read the plan device table and wait for / release the worker's
    slots; between iterations it takes requests, and an idle node runs none — but iteration 0,
    which every rank runs at start (graph capture and compiles happen there)."""

    def __init__(self, context: RunnerContext, serve: ServeWorkerArgs) -> None:
        from vexpert_runtime.serve.rank import ServingRank  # transformers: only where a worker serves

        self.context = context
        slots, rescue = context.slots, context.rescue
        self.serving = ServingRank(serve, context.rank, context.world, context.group, context.device, context.dtype,
                                   context.tables.plan, slots.buffers.slots,
                                   wait=lambda layer: slots.acquire(layer, rescue),
                                   release=slots.release, dispatch=context.dispatch,
                                   graph_stream=context.graph_stream)
        experts = self.serving.experts
        if experts.cpu_expert_kernel is not None:  # say which CPU expert kernel this machine got, and why
            timed = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in experts.cpu_expert_seconds.items())
            print(f"vexpert-worker-{context.rank}: CPU experts run {experts.cpu_expert_kernel}"
                  f" ({'one pass over layer 0: ' + timed if timed else 'as asked'})", file=sys.stderr, flush=True)
        if self.serving.num_moe_layers != context.spec.num_layers:
            raise VExpertInputError("model.checkpoint_path",
                                    f"the model has {self.serving.num_moe_layers} MoE layers, its spec {context.spec.num_layers}",
                                    "serve the checkpoint the node's config names")
        # No load report yet: the API counts a rank in once it reports, and a rank first reports at the
        # end of iteration 0, which it runs at once (see await_work) — so /health waits for the CUDA
        # graphs' capture and compiles there instead of a request waiting for them.
        # with CUDA graphs the scheduler launches iteration i+1 before reading i (serve/step.py)
        self.overlaps_iterations = self.serving.model.overlaps_steps

    def has_work(self) -> bool:
        return self.serving.has_work()

    def await_work(self, iteration: int) -> None:
        """Take new requests and wait until some rank has work or the node stops (one tiny
        all-reduce per wait; an idle server runs no iterations, so the coordinator streams nothing
        while nobody sends requests) — except before iteration 0, which every rank runs at start."""
        import torch.distributed as dist

        ctx, serving = self.context, self.serving
        if iteration == 0:
            # The first iteration runs at once on every rank (an empty lockstep step): on a GPU it
            # captures every CUDA graph bucket and compiles the fused pieces, which would otherwise
            # hold up the first request (≈ 40–60 s on an H200 the first time).
            return
        beat = time.monotonic()
        while True:
            serving.take_requests()
            busy = serving.has_work() or ctx.stop_requested(iteration)
            flag = torch.tensor([int(busy)])
            if ctx.group is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
            if int(flag):
                return
            serving.report_load()
            if time.monotonic() - beat > 5.0:
                ctx.heartbeat()
                beat = time.monotonic()
            serving.take_requests(timeout_s=0.02)

    def prepare(self, iteration: int) -> None:
        """Nothing: the scheduler forms the batch when the iteration runs."""

    def run(self, iteration: int, table: RoutingTable, use_plan: bool) -> IterationOutput:
        """One scheduler iteration: its batch through the model, the EP experts reading ``table``
        and the slots."""
        ctx = self.context
        # One device table for every serving iteration, static or plan, loaded in place: a captured
        # graph reads whatever it holds.
        self.serving.experts.table = _loaded(ctx.tables.plan, table)
        # no zeroing: every MoE layer writes its rows of the statistics each iteration (EPExperts.forward)
        graphed = self.serving.run_iteration(ctx.stats.counts, ctx.stats.computed)
        return IterationOutput(hidden=None, graphed=graphed)
