"""Hugging Face transformers MoE models run one iteration at a time, the routed experts handed to an executor.

:class:`HFStepModel` implements :class:`~vexpert_runtime.serve.step.StepModel` over a model loaded with
``AutoModelForCausalLM.from_pretrained`` from a local directory: the model definition (attention, MLA,
norms, rotary embeddings, routers, shared experts) is transformers' own; this module only drives its
submodules in an order that lets a rank run its sequences' attention one by one (each with its own
``DynamicCache``) and every sparse MoE block once for the concatenated tokens of the whole iteration —
one EP collective per MoE layer per iteration, also with no sequences (lockstep across ranks).

Every sparse block (:mod:`.sparse_blocks`: router ``gate`` + fused ``experts``, transformers 5's layout
for DeepSeek-V3, Qwen3-MoE and Qwen2-MoE) has its ``experts`` replaced by a proxy that forwards to a
:class:`MoEExecutor`, so the block's own forward still runs the router and adds its shared expert(s)
(DeepSeek-V3 ``shared_experts``, Qwen2-MoE's sigmoid-gated ``shared_expert``) exactly as the model does.

Executors: :class:`LocalExperts` (one process, the model's own expert weights) and :class:`EPExperts`
(:func:`~vexpert_runtime.model.ep_moe.ep_moe_layer` over a torch.distributed group with this rank's
resident experts and optional vExpert slots). Expert rows use the packed layout of
:mod:`vexpert_runtime.model.weights` (``[gate (I·H) | up (I·H) | down (H·I)]``), which is
``cat(gate_up_proj[e], down_proj[e])`` of transformers' fused expert tensors.

Shapes: ``T`` tokens of an iteration (all sequences), ``H`` hidden, ``K`` top-k, ``E`` routed experts,
``I`` expert intermediate size, ``D = 3·I·H`` packed row, ``L`` MoE layers, ``N`` EP ranks, ``S`` slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model import fusion
from vexpert_runtime.model.checkpoint import CheckpointReader, MoESpec, read_model_spec
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
    prepacking_runs,
)
from vexpert_runtime.model.moe_math import combine
from vexpert_runtime.serve import attention_kernels
from vexpert_runtime.serve.attention import AttentionMetadata, build_metadata
from vexpert_runtime.serve.attention_layers import (
    AttentionKernel,
    AttentionStep,
    attention_forward,
    kv_layout,
    sliding_windows,
)
from vexpert_runtime.serve.cuda_graphs import GraphedSteps
from vexpert_runtime.serve.fused_projections import fuse_model_projections
from vexpert_runtime.serve.kv_cache import PagedKVCache, blocks_for
from vexpert_runtime.serve.model_loading import load_without_experts
from vexpert_runtime.serve.sampling import sample_tokens, sampling_tensors
from vexpert_runtime.serve.sparse_blocks import (
    ExecutorExperts,
    decoder_layers,
    is_sparse_block,
    sparse_layers,
)
from vexpert_runtime.serve.step import FinishedStep, PendingStep, SequenceWork, StepModel

EP_LAYER_RANGE = "vexpert.ep_layer"  # the profiler range around each EP MoE layer (eager steps)

# Expert activations the EP layer implements (its grouped GEMMs are SwiGLU).
_SWIGLU_ACTIVATIONS = ("silu", "swish")


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


def checkpoint_reader(path: str | Path) -> CheckpointReader:
    """A validated :class:`CheckpointReader` of a local checkpoint (what a coordinator builds its
    pool from: ``reader.experts(moe_layer, ids, dtype)`` gives packed rows [len(ids), D])."""
    reader = CheckpointReader(path, read_model_spec(path))
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
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded batch's routing with its pad rows made harmless: spread round-robin over the experts
    (a pad row costs a dispatch row, never a hot spot) with weight 0.

    Args: ids [T, K] int64, weights [T, K], valid [T] bool (False: pad row).
    Returns ids [T, K], weights [T, K], counted [T·K] int64 (1 for a real row's pairs: what statistics count).
    """
    valid_pairs = valid.unsqueeze(1).expand_as(ids)
    spread = torch.arange(ids.numel(), device=ids.device).view_as(ids) % num_experts
    return (torch.where(valid_pairs, ids, spread), torch.where(valid_pairs, weights, torch.zeros_like(weights)),
            valid_pairs.reshape(-1).to(torch.int64))


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
        counted: torch.Tensor | None = None
        if self.token_valid is not None:
            mask = fusion.maybe_compiled(mask_padding, self.compiled)
            ids, weights, counted = mask(ids, weights, self.token_valid, self.num_experts)
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
        self.computed[moe_layer].copy_(stats.computed)
        flat = ids.reshape(-1).to(torch.int64)
        row = self.counts[moe_layer]
        row.zero_()
        row.scatter_add_(0, flat, torch.ones_like(flat) if counted is None else counted)
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
        return cls.from_rows(lambda layer, ids: reader.experts(layer, ids, dtype), num_layers, spec.intermediate_size,
                             spec.num_experts, rank, world, group, device, **kwargs)

    @classmethod
    def for_model(cls, model: HFStepModel, rank: int, world: int, group: dist.ProcessGroup | None,
                  **kwargs: Any) -> EPExperts:
        """This rank's executor for a loaded :class:`HFStepModel`, resident rows from its weights
        (then ``model.executor = ep; model.drop_expert_weights()``); ``kwargs`` as in the constructor."""
        return cls.from_rows(model.expert_rows, len(model.moe_layers), model.intermediate_size, model.num_experts,
                             rank, world, group, model.device, **kwargs)


# ---------------------------------------------------------------------------------------------
# The step model
# ---------------------------------------------------------------------------------------------

DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block (vLLM's default)


def checked_max_context(requested: int | None, positions: int) -> int:
    """The context served: ``requested`` (``--max-model-len``) if given, else the checkpoint's
    ``positions`` (``max_position_embeddings``); refused beyond it (no RoPE scaling is applied here)."""
    if requested is None:
        return positions
    if not 2 <= requested <= positions:
        raise VExpertInputError("--max-model-len", f"{requested} is not in [2, {positions}] (the checkpoint's "
                                "max_position_embeddings)", f"pass at most {positions}, or leave it unset")
    return requested


class HFStepModel:
    """A transformers causal LM (DeepSeek-V3, Qwen3-MoE, Qwen2-MoE, …) as a :class:`StepModel`.

    Every iteration runs all of the rank's sequences as one flat batch of tokens: embeddings, then
    per decoder layer one batched attention call over the paged KV cache
    (:func:`~.attention_layers.attention_forward`) and one MLP call (the sparse block's router and
    shared experts, the routed experts through :attr:`executor`), then the final norm, the LM head on
    each sampled sequence's last token and sampling on the device (:func:`~.sampling.sample_tokens`).

    Args:
        path: a local checkpoint directory (config.json, safetensors); nothing is fetched from a hub.
        device, dtype: where and in what the model computes (float32 for bit-for-bit tests).
        executor: the routed experts; default :class:`LocalExperts` over the model's own weights.
            Assign ``self.executor`` later (e.g. an :class:`EPExperts` built from
            :meth:`expert_rows`), then :meth:`drop_expert_weights` to free the unused copies.
        kv_cache_tokens: size the KV cache for this many tokens now (else call
            :meth:`allocate_kv_cache` once the rank knows what memory is left).
        block_size: tokens per KV-cache block.
        max_context: the longest sequence (prompt + output) served, at most the checkpoint's
            ``max_position_embeddings`` (default: that; vLLM's ``--max-model-len``).
    """

    def __init__(self, path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 executor: MoEExecutor | None = None, kv_cache_tokens: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, load_experts: bool = True,
                 max_context: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if load_experts:
            model: Any = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
            model = model.to(device)
        else:  # rank-local: every non-expert tensor, no routed expert (an executor brings its own rows)
            model, self.load_report = load_without_experts(path, device, dtype)
        self.model: Any = model.eval()
        self.config = model.config
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = int(self.config.vocab_size)
        self.max_context = checked_max_context(max_context, int(self.config.max_position_embeddings))
        self.fused_projections = fuse_model_projections(model)  # before anything compiles or captures them
        self.moe_layers = sparse_layers(model)
        if not self.moe_layers:
            raise ValueError(f"{path}: no sparse MoE block (router gate + fused experts) in {type(model).__name__}")
        act = str(getattr(self.config, "hidden_act", "silu"))
        if act not in _SWIGLU_ACTIVATIONS:
            raise ValueError(f"{path}: expert activation {act!r}; the EP layer computes SwiGLU (silu) experts")
        layers = decoder_layers(model)
        # The model's own expert modules (LocalExperts and expert_rows read them), then the proxies.
        self.experts: list[Any] = [layers[i].mlp.experts for i in self.moe_layers]
        self.num_experts = int(self.experts[0].gate_up_proj.shape[0])  # E: routed experts per MoE layer
        for index, layer in enumerate(self.moe_layers):
            layers[layer].mlp.experts = ExecutorExperts(self._route_experts, index)
        if not load_experts:
            self.experts = [None] * len(self.experts)  # never materialised (meta)
        if executor is None and not load_experts:
            raise ValueError("a model loaded without its experts needs an executor (e.g. EPExperts.from_checkpoint)")
        self.executor: MoEExecutor = executor if executor is not None else LocalExperts(self.experts)
        self.top_k = int(self.config.num_experts_per_tok)
        self.layout = kv_layout(self.config)
        self.windows = sliding_windows(self.config)
        self.kv_block_size = block_size
        self.kv_cache: PagedKVCache | None = None
        self.graphs: GraphedSteps | None = None
        # Whether the scheduler launches step i+1 before reading step i (see serve/step.py): on with
        # CUDA graphs, where the launch returns at once; on CPU the step is done when launched.
        self.overlaps_steps = False
        # Whether the step's small pieces run compiled (:meth:`compile_pieces`).
        self.compiled = False
        self.last_sampled = torch.zeros(0, dtype=torch.int64, device=self.device)
        # On a GPU every iteration attends with the Triton kernels (sliding-window layers too: GQA's
        # kernel takes the window); the torch twin on CPU.
        self._attention_kernel: AttentionKernel | None = None
        if self.device.type == "cuda" and attention_kernels.available() and not (self.layout.mla and any(self.windows)):
            self._attention_kernel = attention_kernels.mla_decode if self.layout.mla else attention_kernels.gqa_decode
        self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 0
        if kv_cache_tokens is not None:
            self.allocate_kv_cache(blocks_for(kv_cache_tokens, block_size) + 1)

    def _route_experts(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """What each sparse block's :class:`ExecutorExperts` calls: the executor of the moment."""
        return self.executor.forward(moe_layer, x, ids, weights)

    # -- what a coordinator / worker needs ---------------------------------------------------

    @property
    def intermediate_size(self) -> int:
        """I: an expert's intermediate size."""
        return int(self.config.moe_intermediate_size)

    def expert_rows(self, moe_layer: int, ids: Sequence[int]) -> torch.Tensor:
        """Packed rows [len(ids), D] of MoE layer ``moe_layer``'s experts from the loaded weights
        (any layout transformers loads; :func:`checkpoint_reader` reads them without the model)."""
        experts = self.experts[moe_layer]
        if experts is None:
            raise RuntimeError("expert weights were dropped")
        return packed_rows(experts, ids)

    def check_spec(self, spec: MoESpec) -> None:
        """Raise if a :class:`MoESpec` (the coordinator's view) disagrees with the loaded model."""
        got = (tuple(self.moe_layers), self.num_experts, self.top_k, self.intermediate_size,
               int(self.config.hidden_size))
        want = (spec.moe_layers, spec.num_experts, spec.top_k, spec.intermediate_size, spec.hidden_size)
        if got != want:
            raise ValueError(f"model has (moe_layers, E, K, I, H) = {got}, the spec {want}")

    def drop_expert_weights(self) -> None:
        """Free the model's own routed-expert weights (after the executor took what it needs)."""
        if isinstance(self.executor, LocalExperts):
            raise RuntimeError("LocalExperts computes with the model's expert weights")
        self.experts = [None] * len(self.experts)

    # -- the KV cache ------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token, all layers, in the compute dtype: MLA caches the compressed
        latent and the rotary key (kv_lora_rank + qk_rope_head_dim per layer), GQA keys and values
        (2 · num_key_value_heads · head_dim per layer)."""
        return self.layout.token_bytes(self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Make the paged KV cache: ``num_blocks`` blocks (one of them scratch)."""
        self.kv_cache = None  # free the old one first
        self.kv_cache = PagedKVCache(self.layout, num_blocks, self.kv_block_size, self.device, self.dtype)
        # the last step's sampled ids, on the device (a step samples for at most one row per sequence,
        # and every sequence holds a block): what an overlapped step's ``fed`` decodes read
        self.last_sampled = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)

    @property
    def kv_num_blocks(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.bytes

    # -- one iteration -----------------------------------------------------------------------

    def release(self, seq_id: int) -> None:
        """Nothing to do: the scheduler's pool took the sequence's blocks back."""

    def compile_pieces(self) -> int:
        """Run the step's small pieces compiled by inductor (:mod:`~vexpert_runtime.model.fusion`), the
        GEMMs and attention kernels as they are: transformers' norms, routers, shared experts, dense
        MLPs and rotary embedding (their own ``forward``, compiled in place); the attention layers'
        projections + norms + rotary embedding (:func:`~.attention_layers.mla_inputs`,
        :func:`~.attention_layers.gqa_inputs`); the EP layer's dispatch bookkeeping; sampling.
        Compiles happen at the first calls (the graph warm-up passes). Returns the modules compiled."""
        modules: list[Any] = [self.model.model.norm, self.model.model.rotary_emb]
        for layer in decoder_layers(self.model):
            modules += [layer.input_layernorm, layer.post_attention_layernorm]
            if is_sparse_block(layer.mlp):
                modules += [layer.mlp.gate, getattr(layer.mlp, "shared_experts", None),
                            getattr(layer.mlp, "shared_expert", None), getattr(layer.mlp, "shared_expert_gate", None)]
            else:
                modules.append(layer.mlp)
        self.compiled = True
        if hasattr(self.executor, "compiled"):
            self.executor.compiled = True
        return fusion.compile_modules(modules)

    def enable_cuda_graphs(self, max_tokens: int, max_seqs: int, stream: Any) -> None:
        """Run iterations of up to ``max_tokens`` tokens of up to ``max_seqs`` sequences as CUDA graphs
        captured on ``stream`` (:mod:`.cuda_graphs`); needs the KV cache and the attention kernels."""
        if self.kv_cache is None:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        if self._attention_kernel is None:
            raise RuntimeError("CUDA graphs need the Triton attention kernels (a CUDA device and Triton)")
        width = blocks_for(self.max_context, self.kv_block_size)
        self.graphs = GraphedSteps(self._graph_forward, max_tokens, max_seqs, width, self.kv_block_size,
                                   self.device, stream, kv_splits=self.kv_splits)
        self.overlaps_steps = True  # the host forms step i+1 while the device runs step i

    @torch.inference_mode()
    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        """Run one iteration (see :class:`StepModel`): [len(work)] int64 sampled tokens on the CPU."""
        return self.launch(work).result()

    @torch.inference_mode()
    def launch(self, work: Sequence[SequenceWork]) -> PendingStep:
        """Enqueue one iteration (see :class:`StepModel`): a graph replay where one fits, without
        waiting for the device; else the eager step, done when this returns."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache: call allocate_kv_cache first")
        self._check(work)
        if self.graphs is not None and self.graphs.fits(work):
            return self.graphs.launch(work)
        tokens = torch.tensor([t for item in work for t in item.tokens], dtype=torch.int64).to(self.device)
        fed = None
        if any(item.fed is not None for item in work):
            fed = torch.tensor([-1 if item.fed is None else item.fed for item in work for _ in item.tokens],
                               dtype=torch.int64).to(self.device)
        meta = build_metadata(work, self.kv_block_size, self.windows, self.device,
                              padded_groups=self._attention_kernel is None, dtype=self.dtype)
        if self._attention_kernel is not None:
            longest = max((item.position + len(item.tokens) for item in work), default=0)
            meta = dataclasses.replace(meta, kv_splits=self.kv_splits(len(tokens), longest))
        sampled = [row for row, item in enumerate(work) if item.sample is not None]
        specs = [spec for spec in (item.sample for item in work) if spec is not None]
        ends = torch.cumsum(torch.tensor([len(item.tokens) for item in work], dtype=torch.int64), 0) - 1
        ids = self._forward(tokens, fed, meta, ends[sampled].to(self.device),
                            sampling_tensors(specs, self.device) if specs else None, None)
        out = torch.full((len(work),), -1, dtype=torch.int64)
        if ids is not None:
            out[sampled] = ids.cpu()
        return FinishedStep(out)

    def kv_splits(self, rows: int, longest: int) -> int:
        """Context splits of the attention kernel for ``rows`` queries whose longest context is
        ``longest`` tokens (:func:`~.attention_kernels.kv_splits`; 1 without the kernels)."""
        if self._attention_kernel is None:
            return 1
        per_row = attention_kernels.mla_programs_per_row(rows, int(self.config.num_attention_heads)) \
            if self.layout.mla else self.layout.kv_heads
        return attention_kernels.kv_splits(rows, per_row, longest, self._sm_count)

    def _forward(self, tokens: torch.Tensor, fed: torch.Tensor | None, meta: AttentionMetadata,
                 sample_rows: torch.Tensor, sampling: tuple[Any, ...] | None, valid: torch.Tensor | None,
                 publish: bool = True) -> torch.Tensor | None:
        """The model over tokens [T] (device work only, no host sync): the ids sampled at the rows
        ``sample_rows`` [S], or None without ``sampling``. ``fed`` [T]: where ≥ 0, the token is the
        previous step's sampled id at that row (:attr:`last_sampled`); ``publish``: keep this step's
        ids there for the next step."""
        cache = self.kv_cache
        assert cache is not None
        if fed is not None:
            tokens = torch.where(fed >= 0, self.last_sampled[fed.clamp(min=0)], tokens)
        hidden = self.model.model.embed_tokens(tokens)  # [T, H]
        cos, sin = self.model.model.rotary_emb(hidden, meta.positions.unsqueeze(0))
        attention = AttentionStep(cos[0], sin[0], meta, None if meta.groups else self._attention_kernel, self.compiled)
        self.executor.token_valid = valid
        try:
            for index, layer in enumerate(decoder_layers(self.model)):
                normed = layer.input_layernorm(hidden)
                hidden = hidden + attention_forward(layer.self_attn, normed, cache.layers[index], attention,
                                                    self.windows[index])
                hidden = hidden + self._mlp(layer, index, layer.post_attention_layernorm(hidden))
        finally:
            self.executor.token_valid = None
        if sampling is None:
            return None
        logits = self.model.lm_head(self.model.model.norm(hidden[sample_rows]))
        ids = fusion.maybe_compiled(sample_tokens, self.compiled)(logits, *sampling)
        if publish:
            self.last_sampled[: ids.shape[0]].copy_(ids)
        return ids

    def _graph_forward(self, tokens: torch.Tensor, fed: torch.Tensor, meta: AttentionMetadata,
                       sample_rows: torch.Tensor, sampling: tuple[Any, ...], valid: torch.Tensor,
                       warmup: bool) -> torch.Tensor:
        """A bucket's forward for :class:`GraphedSteps` (``warmup``: an eager pass over pad rows
        whose only lasting effect is compiled kernels — no slot handshake, statistics kept, the
        previous step's sampled ids untouched)."""
        quiet = getattr(self.executor, "quiet", contextlib.nullcontext) if warmup else contextlib.nullcontext
        with quiet():
            out = self._forward(tokens, fed, meta, sample_rows, sampling, valid, publish=not warmup)
        assert out is not None
        return out

    def _check(self, work: Sequence[SequenceWork]) -> None:
        """Reject work the cache cannot take (before anything is written)."""
        seen: set[int] = set()
        size = self.kv_block_size
        for item in work:
            if item.seq_id in seen:
                raise ValueError(f"sequence {item.seq_id} twice in one step")
            seen.add(item.seq_id)
            if not item.tokens:
                raise ValueError(f"sequence {item.seq_id}: no tokens")
            end = item.position + len(item.tokens)
            if end > self.max_context:
                raise ValueError(f"sequence {item.seq_id}: {end} tokens exceed the model's context of {self.max_context}")
            if len(item.blocks) * size < end:
                raise ValueError(f"sequence {item.seq_id}: {len(item.blocks)} blocks cannot hold {end} tokens")

    def _mlp(self, layer: Any, index: int, normed: torch.Tensor) -> torch.Tensor:
        """The layer's MLP over all tokens at once (one executor call for a sparse block, also
        with no tokens: the EP collective runs on every rank)."""
        if normed.shape[0] == 0:
            if is_sparse_block(layer.mlp):  # the router cannot take 0 rows; the collective must still run
                moe_layer = self.moe_layers.index(index)
                ids = torch.zeros(0, self.top_k, dtype=torch.int64, device=self.device)
                self.executor.forward(moe_layer, normed, ids, torch.zeros(0, self.top_k, device=self.device))
            return normed
        out: torch.Tensor = layer.mlp(normed.unsqueeze(0))
        return out.reshape(normed.shape)


if TYPE_CHECKING:  # mypy checks the classes against the protocols they implement

    def _step_model(model: HFStepModel) -> StepModel:
        return model

    def _executors(local: LocalExperts, ep: EPExperts) -> tuple[MoEExecutor, MoEExecutor]:
        return local, ep
