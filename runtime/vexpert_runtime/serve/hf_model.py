"""The model runner of a serving rank: one iteration of a transformers MoE model over a paged KV cache.

:class:`HFStepModel` implements :class:`~vexpert_runtime.serve.step.StepModel` over a checkpoint in a local
directory, loaded without its routed experts (:mod:`.model_loading`: rank-local): the model definition
(attention, MLA, norms, rotary embeddings, routers, shared experts) is transformers' own; this module
drives its submodules for all of an iteration's tokens at once — per layer one batched attention call over
the paged cache (:mod:`.attention_layers`: a Triton kernel on a GPU, the padded-SDPA torch twin on CPU) and
every sparse MoE block once, its routed experts handed to a :class:`~.moe_executors.MoEExecutor` (one EP
collective per MoE layer per iteration, also with no sequences: lockstep across ranks) — then the LM head
and sampling on the device. On a GPU the iterations replay CUDA graphs (:mod:`.cuda_graphs`).

Shapes: ``T`` tokens of an iteration (all sequences), ``H`` hidden, ``K`` top-k, ``E`` routed experts,
``I`` expert intermediate size, ``L`` MoE layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model import fusion
from vexpert_runtime.model.checkpoint import MoESpec
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
from vexpert_runtime.serve.events import MAX_LOGPROBS
from vexpert_runtime.serve.fp8_linear import Fp8Linear, cublas_block_scaling_runs
from vexpert_runtime.serve.fused_projections import fuse_model_projections
from vexpert_runtime.serve.fused_router import FusedRouter, fuse_model_routers
from vexpert_runtime.serve.kv_cache import PagedKVCache, blocks_for
from vexpert_runtime.serve.kv_cache import kv_cache_dtype as kv_cache_dtype_for
from vexpert_runtime.serve.model_loading import load_without_experts
from vexpert_runtime.serve.moe_executors import (
    EPExperts,
    ExpertSource,
    LocalExperts,
    MoEExecutor,
    packed_rows,
)
from vexpert_runtime.serve.penalties import PenaltyInputs, PenaltyState, penalized_logits, record_tokens
from vexpert_runtime.serve.sampling import sample_tokens, sampling_tensors, token_logprobs, token_ranks
from vexpert_runtime.serve.sparse_blocks import (
    ExecutorExperts,
    decoder_layers,
    is_sparse_block,
    sparse_block_parts,
    sparse_layers,
)
from vexpert_runtime.serve.step import (
    FinishedStep,
    PendingStep,
    PromptLogprobs,
    SequenceWork,
    StepLogprobs,
    StepModel,
)

_PROMPT_LOGITS_ROWS = 512  # prompt rows per LM-head slice when prompt log-probabilities are asked

# Expert activations the EP layer implements (its grouped GEMMs are SwiGLU).
_SWIGLU_ACTIVATIONS = ("silu", "swish")


# ---------------------------------------------------------------------------------------------
# The step model
# ---------------------------------------------------------------------------------------------

DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block (vLLM's default)


def add_and_norm(norm: Any, hidden: torch.Tensor, delta: torch.Tensor, shared: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after a block, ``hidden + delta``, and the next norm of it (transformers' own module):
    compiled, one kernel instead of an add and a norm (vLLM's ``fused_add_rms_norm``). ``shared``: a sparse block's
    shared-expert output, ``delta`` then its routed experts' — the block's own sum ``delta + shared`` taken in the
    same kernel, rounded as transformers rounds it."""
    if shared is not None:
        delta = delta + shared
    total = hidden + delta
    return total, norm(total)


def step_inputs(embed: Any, rotary: Any, tokens: torch.Tensor, fed: torch.Tensor | None, last_sampled: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first layer's input [T, H] — token ids [T], where ``fed`` [T] is ≥ 0 the previous step's sampled id at that
    row of ``last_sampled``, embedded by transformers' embedding ``embed`` — and the rotary embedding's cos / sin
    [T, r] at ``positions`` [T] (:func:`rotary_cos_sin`). Compiled, two kernels where eight ran at the head of every
    graphed step (the fed ids' compare, clamp, gather and select, the embedding's gather, the frequencies' cast,
    GEMM and cos / sin: ~30 µs on an H100, run 33b's Nsight Compute table)."""
    if fed is not None:
        tokens = torch.where(fed >= 0, last_sampled[fed.clamp(min=0)], tokens)
    hidden = embed(tokens)
    cos, sin = rotary_cos_sin(rotary, hidden, positions)
    return hidden, cos, sin


def rotary_cos_sin(rotary: Any, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding module ``rotary`` at positions [T]: (cos, sin) [T, r] in x's dtype. For the
    types whose inverse frequencies are fixed at load (default, linear, YaRN, Llama 3, …) computed as its ``forward``
    computes them, with the frequencies' K = 1 matrix product written as the elementwise product it is (one float32
    rounding either way), so that compiled it fuses with the cos and sin instead of running as a GEMM of its own; the
    types that change their frequencies with the context (dynamic NTK, LongRoPE) call the module."""
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope" \
            or not hasattr(rotary, "inv_freq") or not hasattr(rotary, "attention_scaling"):
        cos, sin = rotary(x, positions.unsqueeze(0))
        return cos[0], sin[0]
    freqs = positions.float()[:, None] * rotary.inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    scaling = rotary.attention_scaling
    return (angles.cos() * scaling).to(x.dtype), (angles.sin() * scaling).to(x.dtype)


def residual_sum(hidden: torch.Tensor, delta: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The last block's residual stream, ``hidden + delta`` (``shared``: as in :func:`add_and_norm`, summed with
    ``delta`` first, rounded as transformers rounds it) — compiled, one kernel where eagerly two adds ran."""
    if shared is not None:
        delta = delta + shared
    return hidden + delta


def norm_rows(norm: Any, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The model's final norm (transformers' own module) of ``hidden``'s ``rows``: compiled, the gather inside the
    norm's kernel instead of a kernel of its own."""
    return norm(hidden[rows])


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
        overlap_shared_experts: on a GPU, run each sparse block's shared expert on a side stream while
            its router and routed experts run (off: one stream, for A/B measurements).
        kv_cache_dtype: the KV cache's dtype (vLLM's ``--kv-cache-dtype``): "auto" (``dtype``), "fp8" /
            "fp8_e4m3" or "fp8_e5m2" (:mod:`.kv_cache`).
        fp8_linears: with ``load_experts=False``, a block-FP8 checkpoint's non-expert linears stay FP8
            (``model.linear_format: fp8_block``, :mod:`.fp8_linear`), against FP8 activations where
            ``fp8_activations`` (``model.expert_compute: w8a8``).
    """

    def __init__(self, path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 executor: MoEExecutor | None = None, kv_cache_tokens: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, load_experts: bool = True,
                 max_context: int | None = None, overlap_shared_experts: bool = True,
                 kv_cache_dtype: str = "auto", fp8_linears: bool = False, fp8_activations: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        if load_experts:
            model: Any = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
            model = model.to(device)
        else:  # rank-local: every non-expert tensor, no routed expert (an executor brings its own rows)
            model, self.load_report = load_without_experts(path, device, dtype, fp8_linears=fp8_linears,
                                                           fp8_activations=fp8_activations)
        self.model: Any = model.eval()
        self.config = model.config
        self.device = torch.device(device)
        if fp8_linears and fp8_activations:  # asked now, eagerly: never first inside a graph capture
            cublas_block_scaling_runs(self.device, dtype)
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype_for(kv_cache_dtype, dtype)
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
        self.penalties = PenaltyState(self.vocab_size, self.device)  # tables made at the first penalized step
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
        # On a GPU the routers select their experts in one kernel after the logits GEMM (DeepSeek-V3's GEMM
        # on tensor cores; :mod:`.fused_router`); transformers' routers on CPU, the kernel's reference.
        self.fused_routers = fuse_model_routers(model) if self.device.type == "cuda" else 0
        # On a GPU the shared experts run on a stream of their own beside the routed ones (:func:`~.sparse_blocks.sparse_block_parts`).
        self.shared_expert_stream = torch.cuda.Stream(self.device) \
            if self.device.type == "cuda" and overlap_shared_experts else None
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
        """KV-cache bytes per token, all layers, in the cache's dtype: MLA caches the compressed
        latent and the rotary key (kv_lora_rank + qk_rope_head_dim per layer), GQA keys and values
        (2 · num_key_value_heads · head_dim per layer)."""
        return self.layout.token_bytes(self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Make the paged KV cache: ``num_blocks`` blocks (one of them scratch)."""
        self.kv_cache = None  # free the old one first
        self.kv_cache = PagedKVCache(self.layout, num_blocks, self.kv_block_size, self.device, self.kv_dtype)
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
        """The scheduler's pool took the sequence's blocks back; its penalty row (if any) is free."""
        self.penalties.release(seq_id)

    def compile_pieces(self) -> int:
        """Run the step's small pieces compiled by inductor (:mod:`~vexpert_runtime.model.fusion`), the
        GEMMs and attention kernels as they are: transformers' norms, routers, shared experts and dense
        MLPs (their own ``forward``, compiled in place); the embedding with the rotary embedding
        (:func:`step_inputs`); the attention layers' projections + norms + rotary embedding (:func:`~.attention_layers.mla_inputs`,
        :func:`~.attention_layers.gqa_inputs`); the EP layer's dispatch bookkeeping; sampling.
        Compiles happen at the first calls (the graph warm-up passes). Returns the modules compiled."""
        # the norms after a residual add run inside the compiled add_and_norm (_hidden); the first layer's has no add;
        # the final norm inside the compiled norm_rows (with the gather of the rows it norms); the rotary embedding
        # inside the compiled step_inputs
        layers = decoder_layers(self.model)
        modules: list[Any] = [layers[0].input_layernorm]
        for layer in layers:
            if is_sparse_block(layer.mlp):
                gate = layer.mlp.gate  # a fused router is its own kernels already
                modules += [None if isinstance(gate, FusedRouter) else gate,
                            getattr(layer.mlp, "shared_experts", None),
                            getattr(layer.mlp, "shared_expert", None), getattr(layer.mlp, "shared_expert_gate", None)]
            else:
                modules.append(layer.mlp)
        self.compiled = True
        if hasattr(self.executor, "compiled"):
            self.executor.compiled = True
        for module in self.model.modules():  # FP8 linears are opaque ops: their W8A8 quantisation compiles on its own
            if isinstance(module, Fp8Linear):
                module.compiled = True
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
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(work) else None
        # a graphed step fixes the tables before a graph captures them: rows for the running sequences and the
        # finished ones of the step in flight
        penalty_rows = self.penalties.rows_for(work, None if graphs is None else 2 * graphs.max_seqs)
        if graphs is not None:
            return graphs.launch(work, penalty_rows)
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
        logprobs = any(spec.logprobs for spec in specs)
        penalties = None if penalty_rows is None else self.penalties.inputs(work, penalty_rows)
        hidden = self._hidden(tokens, fed, meta, None, penalties)
        prompt = self._prompt_logprobs(work, hidden) if any(item.prompt_targets for item in work) else None
        out = torch.full((len(work),), -1, dtype=torch.int64)
        if not specs:
            return FinishedStep(out, None, prompt)
        outputs = self._sampled(hidden, ends[sampled].to(self.device), sampling_tensors(specs, self.device), True,
                                logprobs, penalties)
        out[sampled] = outputs[0].cpu()
        if not logprobs:
            return FinishedStep(out, None, prompt)
        return FinishedStep(out, StepLogprobs.at_rows(len(work), sampled, *(t.cpu() for t in outputs[1:])), prompt)

    def _prompt_logprobs(self, work: Sequence[SequenceWork], hidden: torch.Tensor) -> PromptLogprobs:
        """The LM head at the token rows whose ``prompt_targets`` are ≥ 0 (in slices of
        :data:`_PROMPT_LOGITS_ROWS` rows: a long prompt chunk's logits over the vocabulary are large)."""
        rows, targets, owners = [], [], []
        at = 0
        for index, item in enumerate(work):
            for offset, target in enumerate(item.prompt_targets):
                if target >= 0:
                    rows.append(at + offset)
                    targets.append(target)
                    owners.append(index)
            at += len(item.tokens)
        if not rows:
            return PromptLogprobs({})
        parts = []
        for start in range(0, len(rows), _PROMPT_LOGITS_ROWS):
            chunk = torch.tensor(rows[start:start + _PROMPT_LOGITS_ROWS], dtype=torch.int64, device=self.device)
            logits = self.model.lm_head(fusion.maybe_compiled(norm_rows, self.compiled)(self.model.model.norm, hidden,
                                                                                        chunk))
            wanted = torch.tensor(targets[start:start + _PROMPT_LOGITS_ROWS], dtype=torch.int64, device=self.device)
            parts.append([t.cpu() for t in (*token_logprobs(logits, wanted, min(MAX_LOGPROBS, logits.shape[-1])),
                                            token_ranks(logits, wanted))])
        target_lp, top_ids, top_lp, ranks = (torch.cat(column) for column in zip(*parts, strict=True))
        owner = torch.tensor(owners)
        return PromptLogprobs({index: (target_lp[owner == index], top_ids[owner == index], top_lp[owner == index])
                               for index in dict.fromkeys(owners)},
                              {index: ranks[owner == index] for index in dict.fromkeys(owners)})

    def kv_splits(self, rows: int, longest: int) -> int:
        """Context splits of the attention kernel for ``rows`` queries whose longest context is
        ``longest`` tokens (:func:`~.attention_kernels.mla_kv_splits` / :func:`~.attention_kernels.kv_splits`;
        1 without the kernels)."""
        if self._attention_kernel is None:
            return 1
        if self.layout.mla:
            return attention_kernels.mla_kv_splits(rows, int(self.config.num_attention_heads), longest, self._sm_count)
        return attention_kernels.kv_splits(rows, self.layout.kv_heads, longest, self._sm_count)

    def _forward(self, tokens: torch.Tensor, fed: torch.Tensor | None, meta: AttentionMetadata,
                 sample_rows: torch.Tensor, sampling: tuple[Any, ...] | None, valid: torch.Tensor | None,
                 publish: bool = True, logprobs: bool = False, penalties: PenaltyInputs | None = None
                 ) -> tuple[torch.Tensor, ...] | None:
        """The model over tokens [T] (device work only, no host sync): (the ids sampled at the rows
        ``sample_rows`` [S],) — with ``logprobs`` also their :func:`~.sampling.token_logprobs` (sampled
        [S], top ids [S, K], top log-probabilities [S, K]) — or None without ``sampling``. ``fed`` [T]:
        where ≥ 0, the token is the previous step's sampled id at that row (:attr:`last_sampled`);
        ``publish``: keep this step's ids there for the next step. ``penalties``: track the penalized
        sequences' tokens and sample with their penalties (:mod:`.penalties`; log-probabilities stay the
        model's)."""
        hidden = self._hidden(tokens, fed, meta, valid, penalties)
        if sampling is None:
            return None
        return self._sampled(hidden, sample_rows, sampling, publish, logprobs, penalties)

    def _hidden(self, tokens: torch.Tensor, fed: torch.Tensor | None, meta: AttentionMetadata,
                valid: torch.Tensor | None, penalties: PenaltyInputs | None) -> torch.Tensor:
        """The decoder layers over tokens [T] (see :meth:`_forward`): the last hidden states [T, H]."""
        cache = self.kv_cache
        assert cache is not None
        if penalties is not None:  # the penalty tables count the ids the step feeds
            assert self.penalties.seen is not None and self.penalties.counts is not None
            if fed is not None:
                tokens = torch.where(fed >= 0, self.last_sampled[fed.clamp(min=0)], tokens)
                fed = None
            record_tokens(self.penalties.seen, self.penalties.counts, tokens, meta.positions, penalties)
        hidden, cos, sin = fusion.maybe_compiled(step_inputs, self.compiled)(
            self.model.model.embed_tokens, self.model.model.rotary_emb, tokens, fed, self.last_sampled, meta.positions)
        attention = AttentionStep(cos, sin, meta, None if meta.groups else self._attention_kernel, self.compiled)
        self.executor.token_valid = valid
        residual_norm = fusion.maybe_compiled(add_and_norm, self.compiled)
        layers = decoder_layers(self.model)
        try:
            normed = layers[0].input_layernorm(hidden)
            for index, layer in enumerate(layers):
                delta = attention_forward(layer.self_attn, normed, cache.layers[index], attention, self.windows[index])
                hidden, normed = residual_norm(layer.post_attention_layernorm, hidden, delta)
                delta, shared = self._mlp(layer, index, normed)
                if index + 1 < len(layers):
                    hidden, normed = residual_norm(layers[index + 1].input_layernorm, hidden, delta, shared)
                else:
                    hidden = fusion.maybe_compiled(residual_sum, self.compiled)(hidden, delta, shared)
        finally:
            self.executor.token_valid = None
        return hidden

    def _sampled(self, hidden: torch.Tensor, sample_rows: torch.Tensor, sampling: tuple[Any, ...], publish: bool,
                 logprobs: bool, penalties: PenaltyInputs | None) -> tuple[torch.Tensor, ...]:
        """The LM head at ``sample_rows`` and the sampled ids (see :meth:`_forward`)."""
        logits = self.model.lm_head(fusion.maybe_compiled(norm_rows, self.compiled)(self.model.model.norm, hidden,
                                                                                    sample_rows))
        sampled_from = logits
        if penalties is not None:
            assert self.penalties.seen is not None and self.penalties.counts is not None
            sampled_from = penalized_logits(logits.float(), self.penalties.seen, self.penalties.counts, penalties,
                                            self.penalties.bias)
        ids = fusion.maybe_compiled(sample_tokens, self.compiled)(sampled_from, *sampling)
        if publish:
            self.last_sampled[: ids.shape[0]].copy_(ids)
        if not logprobs:
            return (ids,)
        return (ids, *token_logprobs(logits, ids, min(MAX_LOGPROBS, logits.shape[-1])))

    def _graph_forward(self, tokens: torch.Tensor, fed: torch.Tensor, meta: AttentionMetadata,
                       sample_rows: torch.Tensor, sampling: tuple[Any, ...], valid: torch.Tensor,
                       warmup: bool, logprobs: bool, penalties: PenaltyInputs | None) -> tuple[torch.Tensor, ...]:
        """A bucket's forward for :class:`GraphedSteps` (``warmup``: an eager pass over pad rows
        whose only lasting effect is compiled kernels — no slot handshake, statistics kept, the
        previous step's sampled ids untouched, only the penalty tables' scratch row written)."""
        quiet = getattr(self.executor, "quiet", contextlib.nullcontext) if warmup else contextlib.nullcontext
        if warmup and penalties is not None:
            scratch = self.penalties.scratch
            penalties = penalties._replace(token_rows=torch.full_like(penalties.token_rows, scratch),
                                           sample_rows=torch.full_like(penalties.sample_rows, scratch))
        with quiet():
            out = self._forward(tokens, fed, meta, sample_rows, sampling, valid, publish=not warmup, logprobs=logprobs,
                                penalties=penalties)
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

    def _mlp(self, layer: Any, index: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's MLP over all tokens at once (one executor call for a sparse block, also
        with no tokens: the EP collective runs on every rank): (its output, None), or a sparse block's routed and
        shared experts' outputs (:func:`sparse_block_parts`), which the residual add sums."""
        if normed.shape[0] == 0:
            if is_sparse_block(layer.mlp):  # the router cannot take 0 rows; the collective must still run
                moe_layer = self.moe_layers.index(index)
                ids = torch.zeros(0, self.top_k, dtype=torch.int64, device=self.device)
                self.executor.forward(moe_layer, normed, ids, torch.zeros(0, self.top_k, device=self.device))
            return normed, None
        if is_sparse_block(layer.mlp):
            return sparse_block_parts(layer.mlp, normed, self.shared_expert_stream)
        out: torch.Tensor = layer.mlp(normed.unsqueeze(0))
        return out.reshape(normed.shape), None


if TYPE_CHECKING:  # mypy checks the classes against the protocols they implement

    def _step_model(model: HFStepModel) -> StepModel:
        return model

    def _expert_source(model: HFStepModel) -> ExpertSource:  # what EPExperts.for_model reads
        return model

    def _executors(local: LocalExperts, ep: EPExperts) -> tuple[MoEExecutor, MoEExecutor]:
        return local, ep
