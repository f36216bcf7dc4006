"""One EP rank of ``vexpert serve``, inside a node worker process.

The worker (:mod:`vexpert_runtime.node.worker`) keeps what every node worker does — the slot
protocol with the coordinator, the plan agreement, the expert-count windows for the allocator — and
hands each iteration's model work to a :class:`ServingRank` (through its
:class:`~vexpert_runtime.node.runners.ServingRunner`): the Hugging Face model's non-expert
layers for this rank's own requests (data-parallel attention) and, for every sparse MoE block, the
vExpert EP layer (:class:`~.moe_executors.EPExperts`) over the worker's process group, computing with
the slots the coordinator filled (the hooks are the worker's flag waits and releases).

Requests arrive on the rank's queue from the API servers (:mod:`.multirank`); a request's events
go back on the queue of the API server that sent it (one queue per API server, shared by the node's
ranks), load reports to every API server.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.ep_moe import DeviceRoutingTable
from vexpert_runtime.serve.dispatcher import RankCapacity, RankRefused
from vexpert_runtime.serve.events import (
    AbortAll,
    CancelRequest,
    Event,
    GenerationRequest,
    RankEvent,
    RankLoad,
    ServeRefusal,
    StopAccepting,
)
from vexpert_runtime.serve.hf_model import DEFAULT_BLOCK_SIZE, HFStepModel
from vexpert_runtime.serve.kv_cache import blocks_for, num_blocks_for_memory
from vexpert_runtime.serve.moe_executors import EPExperts, SlotHooks, checkpoint_reader
from vexpert_runtime.serve.sampling import eos_token_ids
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

LOAD_REPORT_S = 0.05  # a rank whose load did not change reports it again after this long


# GPU memory kept free beside the KV cache for activations, CUDA graphs and the allocator (bytes).
GPU_HEADROOM_BYTES = 2 << 30


@dataclass
class ServeWorkerArgs:
    """What a node worker needs to serve (pickled at spawn). ``requests``: this rank's inbound
    queue; ``events``: the API servers' event queues (one per server; a single queue: one server).
    ``gpu_memory_utilization``: the share of the GPU's
    memory the rank may fill (vLLM's knob): the KV cache gets what weights, resident experts, slots
    and :data:`GPU_HEADROOM_BYTES` leave of it. On CPU the cache holds ``scheduler.kv_budget_tokens``."""

    model_dir: str
    scheduler: SchedulerConfig
    requests: Any
    events: Any
    gpu_memory_utilization: float = 0.9
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    ranks_per_gpu: int = 1  # workers sharing one GPU split its share evenly
    overlap_steps: bool | None = None  # launch step i+1 before reading step i; None: where CUDA graphs run
    compile: bool | None = None  # fuse the step's small pieces with torch.compile; None: where CUDA graphs run
    enforce_eager: bool = False  # no CUDA graphs (--enforce-eager, vLLM's): every step runs eagerly
    cpu_expert_kernel: str = "auto"  # a CPU rank's resident expert kernel (expert_layout.CPU_EXPERT_KERNELS)
    max_context: int | None = None  # the longest sequence served (--max-model-len); None: the checkpoint's
    kv_cache_dtype: str = "auto"  # the KV cache's dtype (--kv-cache-dtype: auto, fp8, fp8_e4m3, fp8_e5m2)
    # how resident expert rows are stored (model.expert_format: auto, dense, fp8_block) — the node's pool and
    # slots hold rows resolved by the same rule, so a rank's resident and slot rows are of one format
    expert_format: str = "auto"
    expert_compute: str = "w8a16"  # FP8 rows against activations of the compute dtype or FP8 ones (model.expert_compute)
    linear_format: str = "dense"  # a block-FP8 checkpoint's non-expert linears dequantised or kept (model.linear_format)


def kv_cache_blocks(args: ServeWorkerArgs, model: HFStepModel, device: torch.device) -> int:
    """Blocks of the rank's KV cache: on a GPU from the memory left under the utilisation target
    (capped by the configured token budget, if any), on CPU the configured budget."""
    budget = args.scheduler.kv_budget_tokens
    cap = None if budget is None else blocks_for(budget, args.kv_block_size) + 1
    if device.type != "cuda":
        if cap is None:
            raise VExpertInputError("kv_budget_tokens", "a CPU rank needs a KV budget in tokens", "pass --kv-cache-tokens")
        return cap
    free, total = torch.cuda.mem_get_info(device)
    available = free - (1.0 - args.gpu_memory_utilization) * total - GPU_HEADROOM_BYTES
    if args.ranks_per_gpu > 1:  # ranks sharing the GPU start one after another: each takes its own part
        share = args.gpu_memory_utilization * total / args.ranks_per_gpu
        available = min(available, share - torch.cuda.memory_reserved(device) - GPU_HEADROOM_BYTES / args.ranks_per_gpu)
    blocks = num_blocks_for_memory(int(available), model.layout, args.kv_block_size, model.kv_dtype)
    if blocks < 2:
        raise VExpertInputError("gpu_memory_utilization",
                                f"{args.gpu_memory_utilization} leaves no memory for the KV cache "
                                f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the weights)",
                                "raise it, or give the rank fewer experts or slots")
    return blocks if cap is None else min(blocks, cap)


class ServingRank:
    """A rank's model, EP experts and scheduler.

    Args:
        args: the serving arguments. rank, world, group: the EP rank, N and the process group.
        device, dtype: where the model computes. graph_stream: capture decode CUDA graphs on this
            stream (None: eager). table: the device routing table the EP layer reads
            (the worker's runner loads the iteration's table into it). slots: the worker's slot rows [S, D].
        wait, release: the worker's flag handshake for MoE layer l's slots.
        dispatch: the node's replica dispatch (plan | local | global), the same on every rank.
    """

    def __init__(self, args: ServeWorkerArgs, rank: int, world: int, group: Any, device: torch.device,
                 dtype: torch.dtype, table: DeviceRoutingTable, slots: torch.Tensor,
                 wait: Callable[[int], None], release: Callable[[int], None], dispatch: str = "plan",
                 graph_stream: Any = None) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.rank = rank
        # Rank-local loading: the non-expert weights, then this rank's resident experts from the shards.
        reader = checkpoint_reader(args.model_dir, args.expert_format, args.expert_compute)
        self.experts = EPExperts.from_checkpoint(reader, reader.spec.num_layers, dtype, rank, world, group, device,
                                                 table=table, slots=slots, hooks=SlotHooks(wait, release),
                                                 # fixed dispatch capacity where graphs need it; else agreed per layer
                                                 max_tokens=args.scheduler.max_batch_tokens if graph_stream is not None
                                                 else None, dispatch=dispatch,
                                                 cpu_expert_kernel=args.cpu_expert_kernel)
        del reader
        self.model = HFStepModel(args.model_dir, device=device, dtype=dtype, block_size=args.kv_block_size,
                                 load_experts=False, executor=self.experts, max_context=args.max_context,
                                 kv_cache_dtype=args.kv_cache_dtype, fp8_linears=args.linear_format == "fp8_block",
                                 fp8_activations=args.expert_compute == "w8a8")
        self.model.allocate_kv_cache(kv_cache_blocks(args, self.model, device))
        if args.compile or (args.compile is None and graph_stream is not None):
            self.model.compile_pieces()  # compiled at the first calls: the graphs' warm-up passes
        if graph_stream is not None:  # iterations replay CUDA graphs captured on the rank's stream
            self.model.enable_cuda_graphs(args.scheduler.max_batch_tokens, args.scheduler.max_running, graph_stream)
        if args.overlap_steps is not None:
            self.model.overlaps_steps = args.overlap_steps
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
        # The API process admits at most max_running + max_waiting requests to this rank (it counts
        # what it sent and has not seen finish); requests it sent wait here until an iteration admits
        # them, so the rank's own queue bound is that whole capacity: what the API admitted is never
        # refused here (a refusal would still reach the client as 429, see RankRefused).
        config = args.scheduler
        self.scheduler = Scheduler(self.model, tokenizer,
                                   replace(config, max_waiting=config.max_running + config.max_waiting),
                                   eos_token_ids(tokenizer), rank=rank)
        self.world = world
        self._init_outboxes(args.events)
        for events in self._queues:
            events.put(RankCapacity(rank, config.max_running, config.max_waiting))

    def _init_outboxes(self, events: Any) -> None:
        """One outbox per API server (``events``: their queues, or the one queue of a single server)."""
        self._queues: list[Any] = list(events) if isinstance(events, (list, tuple)) else [events]
        self._outboxes: list[list[Event]] = [[] for _ in self._queues]  # this iteration's events, by server
        self._accepted: list[list[str]] = [[] for _ in self._queues]  # queued since the last flush, by server
        self._reply_to: dict[str, int] = {}  # request → its API server (several servers only)
        self._reported: RankLoad | None = None
        self._reported_at = 0.0

    @property
    def num_moe_layers(self) -> int:
        return len(self.model.moe_layers)

    def take_requests(self, timeout_s: float = 0.0) -> None:
        """Move what arrived on the inbound queue into the scheduler (waiting up to ``timeout_s``
        for the first message)."""
        inbound = self.args.requests
        try:
            msg = inbound.get(timeout=timeout_s) if timeout_s > 0 else inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self._on_message(msg)
            try:
                msg = inbound.get_nowait()
            except queue.Empty:
                self.flush_events()  # refusals go out at once
                return

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, GenerationRequest):
            if len(self._queues) > 1:
                self._reply_to[msg.request_id] = msg.reply_to
            try:
                self.scheduler.submit(msg, self._sink)
            except ServeRefusal as refusal:  # full or draining: a typed refusal (429 / 503), not an error
                self._refuse(msg, refusal.status, refusal.message, refusal.retry_after_s, refusal.code)
            except VExpertInputError as exc:  # a request no rank can run: 400 naming the field
                self._refuse(msg, 400, exc.detail, code="invalid_value", field=exc.field)  # the API names the field
            except Exception:
                log.exception("rank %d: could not queue request %s", self.rank, msg.request_id)
                self._sink(Event(msg.request_id, finish_reason="error",
                                 error="the rank could not queue the request (details in the server log)"))
            else:
                self._accepted[msg.reply_to].append(msg.request_id)
        elif isinstance(msg, CancelRequest):
            self.scheduler.cancel(msg.request_id)
        elif isinstance(msg, StopAccepting):
            self.scheduler.stop_accepting()
        elif isinstance(msg, AbortAll):
            self.scheduler.abort_all(msg.message)

    def _refuse(self, request: GenerationRequest, status: int, message: str, retry_after_s: int = 1,
                code: str = "overloaded", field: str | None = None) -> None:
        self._reply_to.pop(request.request_id, None)
        self._queues[request.reply_to].put(
            RankRefused(self.rank, request.request_id, status, message, retry_after_s, code, field))

    def _sink(self, event: Event) -> None:
        server = 0
        if len(self._queues) > 1:
            server = (self._reply_to.pop if event.finished else self._reply_to.get)(event.request_id, 0)
        self._outboxes[server].append(clean_failure(event, self.rank, self.world))

    def flush_events(self, with_load: bool = False) -> None:
        """Send each API server the acceptances and the events gathered for it since the last flush
        — and with ``with_load`` the load if it changed (:meth:`report_load`'s rule; every server
        gets it) — as one :class:`RankEvent`, if any."""
        load = self._load_to_report() if with_load else None
        for server, events in enumerate(self._queues):
            outbox, accepted = self._outboxes[server], self._accepted[server]
            if outbox or accepted or load is not None:
                self._outboxes[server], self._accepted[server] = [], []
                events.put(RankEvent(self.rank, tuple(outbox), tuple(accepted), load))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run_iteration(self, counts: torch.Tensor, computed: torch.Tensor) -> bool:
        """One scheduler iteration (an empty step when idle: the MoE layers are collectives);
        this iteration's expert counts [L, E] and rows per local expert [L, E/N + S] land in
        ``counts`` / ``computed`` (device tensors every MoE layer overwrites its row of). Whether it replayed a CUDA graph."""
        self.experts.counts = counts
        self.experts.computed = computed
        graphs = self.model.graphs
        before = 0 if graphs is None else graphs.replays
        try:
            self.scheduler.run_iteration()
        finally:
            self.flush_events(with_load=True)  # events, acceptances and load: one message an iteration
        return graphs is not None and graphs.replays > before

    def report_load(self, force: bool = False) -> None:
        """Send the load if it changed or was last sent over ``LOAD_REPORT_S`` ago (an idle rank)."""
        load = self._load_to_report(force)
        if load is not None:
            for events in self._queues:
                events.put(RankEvent(self.rank, (), load=load))

    def _load_to_report(self, force: bool = False) -> RankLoad | None:
        """The load to send now (changed, stale or ``force``), marked as sent; else None."""
        load, now = self.scheduler.load(), time.monotonic()
        if force or load != self._reported or now - self._reported_at > LOAD_REPORT_S:
            self._reported, self._reported_at = load, now
            return load
        return None


STEP_FAILED = "model step failed"


def clean_failure(event: Event, rank: int, world: int) -> Event:
    """A failed model step's event without the exception's text (a dependency's message, internal
    paths: they go to the log). In a group of several ranks a step fails when a peer rank died (its
    collective broke), and the node is going down: the request ends ``abort`` (the API's 503, retry
    elsewhere) rather than ``error`` (500)."""
    if event.finish_reason != "error" or not (event.error or "").startswith(STEP_FAILED):
        return event
    log.error("rank %d: request %s: %s", rank, event.request_id, event.error)
    if world > 1:
        return replace(event, finish_reason="abort",
                       error=f"the node failed: a model step failed on rank {rank} (a rank of the group "
                             "is down); retry")
    return replace(event, error=f"{STEP_FAILED} (details in the server log)")
