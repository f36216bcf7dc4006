"""The routed experts of a serving rank: what each sparse block's ``experts`` proxy calls.

Every sparse block (:mod:`.sparse_blocks`) has its ``experts`` replaced by a proxy that forwards to a
:class:`MoEExecutor`, so the block's own forward still runs the router and adds its shared expert(s)
exactly as the model does. Executors: :class:`LocalExperts` (one process, the model's own expert
weights: single-rank serving and the reference) and :class:`EPExperts`
(:func:`~vexpert_runtime.model.ep_moe.ep_moe_layer` over a torch.distributed group with this rank's
resident experts and optional vExpert slots, the statistics the node's allocator reads, CPU expert
kernels chosen at load). Expert rows use the packed layout of :mod:`vexpert_runtime.model.weights`
(``[gate (I·H) | up (I·H) | down (H·I)]``), which is ``cat(gate_up_proj[e], down_proj[e])`` of
transformers' fused expert tensors.

Shapes: ``T`` tokens of an iteration (all sequences), ``H`` hidden, ``K`` top-k, ``E`` routed experts,
``I`` expert intermediate size, ``D = 3·I·H`` packed row, ``L`` MoE layers, ``N`` EP ranks, ``S`` slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model import fusion
from vexpert_runtime.model.checkpoint import CheckpointReader, read_model_spec, resolve_expert_storage
from vexpert_runtime.model.dispatch import DISPATCH_MODES, DispatchMode
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    LayerStats,
    base_experts,
    ep_moe_layer,
    static_table,
)
from vexpert_runtime.model.expert_format import ExpertFormat
from vexpert_runtime.model.expert_layout import CPU_EXPERT_KERNELS
from vexpert_runtime.model.grouped_moe import (
    PrepackedExperts,
    cpu_expert_kernel_seconds,
    group_counts,
    prepacking_runs,
)
from vexpert_runtime.model.moe_math import combine

EP_LAYER_RANGE = "vexpert.ep_layer"  # the profiler range around each EP MoE layer (eager steps)

class ExpertSource(Protocol):
    """A loaded model whose routed experts an :class:`EPExperts` can take its rows from
    (:class:`~.hf_model.HFStepModel`)."""

    moe_layers: list[int]
    num_experts: int
    device: torch.device

    @property
    def intermediate_size(self) -> int: ...

    def expert_rows(self, moe_layer: int, ids: Sequence[int]) -> torch.Tensor: ...


class MoEExecutor(Protocol):
    """Computes the routed experts of one MoE layer for one iteration's tokens.

    ``token_valid`` ([T] bool or None): set by the step model for a padded CUDA-graph batch; rows
    marked False are padding (an executor with statistics must not count them)."""

    token_valid: torch.Tensor | None

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] (post-attention-normed tokens), ids [T, K] int64 logical experts, weights [T, K]
        (the router's, scaling included) → Σ_k weights·expert_k(x) [T, H] in x's dtype. Routed
        experts only: the model adds its shared experts itself. Called once per MoE layer per
        iteration on every rank, also with T = 0."""
        ...


# ---------------------------------------------------------------------------------------------
# The model's experts: finding sparse blocks, packed rows
# ---------------------------------------------------------------------------------------------


def packed_rows(experts: Any, ids: Sequence[int]) -> torch.Tensor:
    """Packed rows [len(ids), D] of a transformers fused experts module (gate_up_proj [E, 2I, H] with
    the gate rows first, down_proj [E, H, I]) — the layout :func:`~vexpert_runtime.model.weights.pack_expert` writes."""
    _check_dense(experts)
    index = torch.as_tensor(list(ids), dtype=torch.int64, device=experts.gate_up_proj.device)
    gate_up = experts.gate_up_proj.detach().index_select(0, index)
    down = experts.down_proj.detach().index_select(0, index)
    return torch.cat([gate_up.flatten(1), down.flatten(1)], dim=1)


def _check_dense(experts: Any) -> None:
    """Raise unless the fused expert weights are plain floating-point tensors: a quantised module
    (block FP8 keeps its scales elsewhere) must be read with :func:`checkpoint_reader` instead."""
    for weight in (experts.gate_up_proj, experts.down_proj):
        if not (weight.is_floating_point() and weight.element_size() >= 2):
            raise ValueError(f"expert weights are {weight.dtype}; read quantised experts with checkpoint_reader "
                             "(and pass EPExperts their ExpertFormat)")


def checkpoint_reader(path: str | Path, expert_format: str = "auto", expert_compute: str = "w8a16") -> CheckpointReader:
    """A validated :class:`CheckpointReader` of a local checkpoint (what a coordinator builds its
    pool from: ``reader.experts(moe_layer, ids, dtype)`` gives packed rows [len(ids), D]), its expert
    rows in ``expert_format`` (``model.expert_format``: auto — as stored —, dense, fp8_block), multiplied as
    ``expert_compute`` says (``model.expert_compute``: w8a16, w8a8)."""
    reader = CheckpointReader(path, resolve_expert_storage(read_model_spec(path), expert_format, expert_compute))
    reader.validate()
    return reader


# ---------------------------------------------------------------------------------------------
# Executors
# ---------------------------------------------------------------------------------------------


class LocalExperts:
    """Every expert in this process, with the model's own weights (single-rank serving, reference).

    Loops over the experts hit, then combines with :func:`moe_math.combine` like the EP layer does.
    """

    def __init__(self, experts: Sequence[Any]) -> None:
        self.experts = list(experts)  # per MoE layer: transformers fused experts module
        self.token_valid: torch.Tensor | None = None  # no statistics here: padding needs no care
        for module in self.experts:
            _check_dense(module)

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        module = self.experts[moe_layer]
        outputs = x.new_zeros(*ids.shape, x.shape[1])  # [T, K, H]
        for expert in torch.unique(ids).tolist():
            token, slot = torch.nonzero(ids == expert, as_tuple=True)
            gate_up = F.linear(x[token], module.gate_up_proj[expert])
            gate, up = gate_up.chunk(2, dim=-1)
            outputs[token, slot] = F.linear(F.silu(gate) * up, module.down_proj[expert])
        return combine(weights, outputs, None)


def mask_padding(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, num_experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch's routing with its pad rows made harmless: spread round-robin over the experts
    (a pad row costs a dispatch row, never a hot spot) with weight 0. (The statistics leave the pad rows out
    themselves, from ``valid``: :func:`record_layer_stats`; so this is one kernel compiled, not two.)

    Args: ids [T, K] int64, weights [T, K], valid [T] bool (False: pad row).
    Returns ids [T, K], weights [T, K].
    """
    valid_pairs = valid.unsqueeze(1).expand_as(ids)
    spread = torch.arange(ids.numel(), device=ids.device).view_as(ids) % num_experts
    return torch.where(valid_pairs, ids, spread), torch.where(valid_pairs, weights, torch.zeros_like(weights))


def record_layer_stats(counts: torch.Tensor, computed: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None,
                       layer_computed: torch.Tensor) -> None:
    """Write one layer's statistics in place: ``counts`` [E] int64 ← pairs per logical expert of ``ids`` [T, K]
    (only the rows ``valid`` [T] bool marks, where given: a padded batch's real rows), ``computed`` ←
    ``layer_computed``. Compiled with the step's pieces: the count is a one-hot sum written straight into the buffer —
    one fused kernel where a memset and a scatter were two launches each layer (:func:`~.grouped_moe.group_counts`)."""
    flat = ids.reshape(-1).to(torch.int64)
    counted = None if valid is None else valid.unsqueeze(1).expand_as(ids).reshape(-1).to(torch.int64)
    counts.copy_(group_counts(flat, counts.shape[0], counted))
    computed.copy_(layer_computed)


@dataclass
class SlotHooks:
    """How :class:`EPExperts` waits for and releases the slots a layer computes with (the node
    worker's ``WorkerSlots.acquire`` / ``release``); both get the MoE layer index."""

    wait: Callable[[int], None]
    release: Callable[[int], None]


def cpu_resident_kernel(resident: Sequence[torch.Tensor | PrepackedExperts], intermediate: int,
                        format: ExpertFormat | None, kernel: str) -> tuple[str | None, dict[str, float]]:
    """The CPU expert kernel a rank's resident experts run with (see ``expert_layout.CPU_EXPERT_KERNELS``):
    ``kernel`` itself, or for ``"auto"`` the faster one over the first layer's experts
    (:func:`cpu_expert_kernel_seconds`, returned too); None where the choice does not apply (GPU rows,
    FP8 rows, no oneDNN: their rows stay rows)."""
    if kernel not in CPU_EXPERT_KERNELS:
        raise VExpertInputError("cpu_expert_kernel", f"{kernel!r} is not one of {', '.join(CPU_EXPERT_KERNELS)}",
                                "pass auto (time both at load), grouped or prepacked")
    first = resident[0] if resident else None
    if isinstance(first, PrepackedExperts):
        return "prepacked", {}
    if first is None or format is not None or not prepacking_runs(first.device, first.dtype):
        return None, {}
    if kernel != "auto" or first.shape[0] == 0:
        return "grouped" if kernel == "auto" else kernel, {}
    seconds = cpu_expert_kernel_seconds(first, intermediate)
    return min(seconds, key=seconds.__getitem__), seconds


def _cpu_resident(rows: torch.Tensor | PrepackedExperts, intermediate: int,
                  kernel: str | None) -> torch.Tensor | PrepackedExperts:
    """A CPU rank's resident experts for ``kernel`` (from :func:`cpu_resident_kernel`): prepacked for
    oneDNN, or the packed rows (``torch._grouped_mm``'s). The slots the coordinator fills stay rows."""
    if kernel != "prepacked" or isinstance(rows, PrepackedExperts):
        return rows
    return PrepackedExperts.of(rows, intermediate, rows.shape[1] // (3 * intermediate))


class EPExperts:
    """Routed experts expert-parallel over ``group``: :func:`ep_moe_layer` with this rank's resident
    experts and, where the routing table puts copies in slots, the slot rows.

    Args:
        resident: per MoE layer, packed rows [E/N, D] of :func:`base_experts` (E, N, rank), in the
            compute dtype (or the format's row dtype), on the compute device.
        intermediate: I. num_experts: E. rank, world: this rank and N. group: the EP group (None: N = 1).
        table: the device routing table (default: the static one, no slots); a plan switch is
            ``table.load(new_table)`` between iterations.
        slots: the slot rows: one buffer [S, D] reused by every layer (with ``hooks`` to fill it
            layer by layer, as the node worker does), or one [S, D] per MoE layer; None without slots.
        max_tokens: the most tokens any rank runs in one iteration. With it the dispatch capacity
            of several ranks is fixed (K·max_tokens: nothing dropped, no host sync: what CUDA graphs
            need); without it each layer agrees on the capacity with one all-reduce of T (fine on
            CPU, a host sync on GPU). One rank sends exactly its T·K rows either way.
        format: the rows' format for block-FP8 rows (None: dense rows of the compute dtype).
        dispatch: how a replicated expert's tokens split over its copies every layer (``plan``,
            ``local`` or ``global``: see :mod:`vexpert_runtime.model.dispatch`); ``global`` adds one
            all-reduce per layer, so every rank of the group must use the same mode.
    """

    def __init__(self, resident: Sequence[torch.Tensor | PrepackedExperts], intermediate: int, num_experts: int,
                 rank: int, world: int,
                 group: dist.ProcessGroup | None, *, table: DeviceRoutingTable | None = None,
                 slots: torch.Tensor | Sequence[torch.Tensor] | None = None, hooks: SlotHooks | None = None,
                 max_tokens: int | None = None, format: ExpertFormat | None = None,
                 dispatch: str = "plan", cpu_expert_kernel: str = "auto",
                 cpu_expert_seconds: dict[str, float] | None = None) -> None:
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch {dispatch!r} is not one of {', '.join(DISPATCH_MODES)}")
        self.dispatch: DispatchMode = dispatch  # type: ignore[assignment]
        first = resident[0]
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        kernel, seconds = cpu_resident_kernel(resident, intermediate, format, cpu_expert_kernel)
        # The CPU expert kernel in use (None: not a CPU fp32 rank) and, where it was timed, each kernel's seconds.
        self.cpu_expert_kernel = kernel
        self.cpu_expert_seconds = cpu_expert_seconds if cpu_expert_seconds is not None else seconds
        self.resident = [_cpu_resident(r, intermediate, kernel) for r in resident]
        self.num_experts = num_experts
        # Padding rows of a graphed batch (False): routed round-robin over the experts with weight 0
        # (a pad row costs a dispatch row, never a hot spot) and left out of the counts.
        self.token_valid: torch.Tensor | None = None
        self.intermediate = intermediate
        self.rank, self.world, self.group = rank, world, group
        if table is None:
            table = DeviceRoutingTable.of(static_table(len(self.resident), num_experts, world, 0), device)
        self.table = table
        self.slots = slots
        self.hooks = hooks
        self.max_tokens = max_tokens
        self.format = format
        # Rows computed per local expert [L, E/N + S], of the last iteration, on the device (read when it suits).
        self.computed = torch.zeros(len(self.resident), table.experts_per_gpu + table.slots, dtype=torch.int64,
                                    device=device)
        # Tokens routed to each logical expert [L, E] in the last iteration (this rank's; the allocator's input once all-reduced).
        self.counts = torch.zeros(len(self.resident), num_experts, dtype=torch.int64, device=device)
        self.last_stats: LayerStats | None = None
        # Run the EP layer's bookkeeping compiled (:mod:`~vexpert_runtime.model.fusion`): set with CUDA graphs.
        self.compiled = False
        self._agreed_tokens: int | None = None  # the iteration's most tokens on any rank (see _capacity)

    def _slot_rows(self, moe_layer: int) -> torch.Tensor | None:
        if self.slots is None or isinstance(self.slots, torch.Tensor):
            return self.slots
        return self.slots[moe_layer]

    def _capacity(self, tokens: int, top_k: int, moe_layer: int) -> int:
        """C: dispatch rows per destination rank, equal on every rank and ≥ any rank's T·K. Without
        ``max_tokens`` the ranks agree on the most tokens once per iteration, at its first MoE layer
        (every layer of an iteration runs the same tokens, and every rank runs every layer)."""
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens in one iteration, EPExperts was built for at most {self.max_tokens}")
        if self.group is None:  # one rank: nothing to agree on (a graph's T is its bucket)
            return tokens * top_k
        if self.max_tokens is not None:
            return self.max_tokens * top_k
        if moe_layer == 0 or self._agreed_tokens is None:
            most = torch.tensor([tokens], dtype=torch.int64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            self._agreed_tokens = int(most)
        return self._agreed_tokens * top_k

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Run a warm-up pass: no slot handshake (the node's flags see only real iterations) and the
        statistics as they were before."""
        hooks, counts, computed = self.hooks, self.counts.clone(), self.computed.clone()
        self.hooks = None
        try:
            yield
        finally:
            self.hooks = hooks
            self.counts.copy_(counts)
            self.computed.copy_(computed)

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        hooks = self.hooks
        if self.token_valid is not None:
            mask = fusion.maybe_compiled(mask_padding, self.compiled)
            ids, weights = mask(ids, weights, self.token_valid, self.num_experts)
        stacks = ExpertStacks(self.resident[moe_layer], self._slot_rows(moe_layer), self.intermediate,
                              format=self.format)
        with torch.profiler.record_function(EP_LAYER_RANGE):  # a profiler trace's EP-layer share
            y, stats = ep_moe_layer(
                x, ids, weights, self.table, moe_layer, stacks, None, self.rank, self.world, self.group,
                capacity=self._capacity(x.shape[0], ids.shape[1], moe_layer),
                slot_wait=None if hooks is None else (lambda: hooks.wait(moe_layer)),
                after_compute=None if hooks is None else (lambda: hooks.release(moe_layer)),
                dispatch=self.dispatch, compiled=self.compiled,
            )
        # The iteration's statistics are written, not accumulated: every MoE layer runs exactly once
        # per iteration (also with no tokens), so no memset has to precede an iteration (on a GPU
        # these are kernels inside the step's graph, not one more launch).
        fusion.maybe_compiled(record_layer_stats, self.compiled)(self.counts[moe_layer], self.computed[moe_layer],
                                                                 ids, self.token_valid, stats.computed)
        self.last_stats = stats
        return y

    @classmethod
    def from_rows(cls, rows: Callable[[int, list[int]], torch.Tensor], num_layers: int, intermediate: int,
                  num_experts: int, rank: int, world: int, group: dist.ProcessGroup | None,
                  device: torch.device | str, **kwargs: Any) -> EPExperts:
        """Build with this rank's resident rows from ``rows(moe_layer, expert_ids) -> [n, D]``
        (e.g. ``lambda l, ids: reader.experts(l, ids, dtype)`` or :meth:`HFStepModel.expert_rows`)."""
        mine = base_experts(num_experts, world, rank)
        first = rows(0, mine).to(device) if num_layers else None
        kernel, seconds = cpu_resident_kernel([first] if first is not None else [], intermediate, kwargs.get("format"),
                                              kwargs.pop("cpu_expert_kernel", "auto"))
        resident: list[torch.Tensor | PrepackedExperts] = []
        for layer in range(num_layers):  # layer by layer: a rank never holds its rows twice
            stack = first if layer == 0 and first is not None else rows(layer, mine).to(device)
            first = None
            resident.append(_cpu_resident(stack, intermediate, kernel))
            del stack
        return cls(resident, intermediate, num_experts, rank, world, group, cpu_expert_kernel=kernel or "auto",
                   cpu_expert_seconds=seconds, **kwargs)

    @classmethod
    def from_checkpoint(cls, reader: CheckpointReader, num_layers: int, dtype: torch.dtype, rank: int, world: int,
                        group: dist.ProcessGroup | None, device: torch.device | str, **kwargs: Any) -> EPExperts:
        """This rank's executor with its resident rows read from the checkpoint (only those experts'
        tensors are read: rank-local loading, with :func:`load_without_experts` for the rest)."""
        spec = reader.spec
        fmt = spec.expert_format(dtype)  # block-FP8 rows stay FP8 (model.expert_format auto): say so
        if fmt.fp8_block is not None:
            kwargs.setdefault("format", fmt)
        return cls.from_rows(lambda layer, ids: reader.experts(layer, ids, dtype), num_layers, spec.intermediate_size,
                             spec.num_experts, rank, world, group, device, **kwargs)

    @classmethod
    def for_model(cls, model: ExpertSource, rank: int, world: int, group: dist.ProcessGroup | None,
                  **kwargs: Any) -> EPExperts:
        """This rank's executor for a loaded :class:`~.hf_model.HFStepModel`, resident rows from its weights
        (then ``model.executor = ep; model.drop_expert_weights()``); ``kwargs`` as in the constructor."""
        return cls.from_rows(model.expert_rows, len(model.moe_layers), model.intermediate_size, model.num_experts,
                             rank, world, group, model.device, **kwargs)
