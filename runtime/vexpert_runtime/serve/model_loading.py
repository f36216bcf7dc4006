"""Rank-local loading of a Hugging Face MoE checkpoint: everything but the routed experts.

``AutoModelForCausalLM.from_pretrained`` materialises every tensor of the checkpoint, so each EP rank
of a 671B DeepSeek-V3 would need the whole model in memory before it could drop the experts it does
not serve. :func:`load_without_experts` builds the same transformers model on the meta device from
``config.json`` and reads from the safetensors shards only the tensors that are not routed experts
(attention/MLA, norms, embeddings, lm_head, dense MLPs, routers, shared experts), one at a time,
straight into the parameter it becomes. The routed experts (``mlp.experts`` of every sparse block:
router ``gate`` + fused ``experts`` with ``gate_up_proj``) stay on meta, never read: the caller
replaces them with its own executor, whose resident rows come from
:meth:`~vexpert_runtime.model.checkpoint.CheckpointReader.experts` (only this rank's experts).

What ``from_pretrained(path, dtype=dtype)`` does, and so what this module reproduces bit for bit:

* Names: transformers 5 keeps every non-expert name as the parameter name (``save_pretrained``
  writes ``model.layers.{l}.self_attn.q_proj.weight`` and so on); only the experts are renamed (the
  checkpoint's ``mlp.experts.{e}.{gate,up,down}_proj.weight`` fused into ``gate_up_proj`` /
  ``down_proj``), and those are never read here.
* Tied weights (``tie_word_embeddings``): ``lm_head.weight`` is ``model.embed_tokens.weight``; the
  checkpoint holds only one of them (``save_pretrained`` writes the embedding). Where both are
  present transformers ties them only if they are equal, and so does this loader.
* Dtypes: every tensor becomes the meta tensor's dtype (``dtype`` for weights), except the
  model's ``_keep_in_fp32_modules(_strict)`` under fp16/bf16: DeepSeek-V3's router
  ``e_score_correction_bias`` is float32 whatever ``dtype`` is (and whatever the checkpoint stored).
* Non-persistent buffers (rotary ``inv_freq`` / ``original_inv_freq``) are not in the checkpoint:
  transformers moves them off meta and recomputes them with the model's ``_init_weights``, and so
  does this loader.
* Memory (CPU): a tensor kept in its stored dtype is a view of the memory-mapped shard, as
  ``from_pretrained``'s is — also at the same address alignment, which matters: CPU kernels such as
  the matrix-vector product of Qwen2-MoE's ``shared_expert_gate`` sum in an alignment-dependent
  order, so a copy (differently aligned) gives different low bits. Only the pages of the tensors
  read are ever touched. On other devices each tensor is read with ``pread`` into a host buffer,
  copied to the device and freed: the host holds one tensor at a time.

Beyond ``from_pretrained``: block-FP8 checkpoints (``F8_E4M3`` weight + F32 ``weight_scale_inv``,
DeepSeek-V3's format). ``from_config`` builds plain ``nn.Linear`` layers for them, so FP8 non-expert
weights are dequantised to ``dtype`` at load with their block scales (as :class:`CheckpointReader`
dequantises shared experts) — or, ``fp8_linears``, kept FP8 (:mod:`.fp8_linear`); the scales count as read.

Every needed tensor's presence, shape and dtype is checked from the safetensors headers before the
first tensor is read, so a bad checkpoint fails with one :class:`VExpertInputError` and nothing half
loaded.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CONFIG_FILE,
    FP8_HEADER_DTYPE,
    SCALE_SUFFIX,
    _tensor_files,
)
from vexpert_runtime.model.expert_format import dequantize_fp8_block
from vexpert_runtime.model.expert_layout import scale_shape
from vexpert_runtime.model.families import supported_checkpoints
from vexpert_runtime.serve.fp8_linear import Fp8Linear, converts_to_fp8
from vexpert_runtime.serve.sparse_blocks import is_sparse_block

_FIELD = "model.checkpoint_path"
# safetensors header dtypes → torch (what a tensor may be stored as)
_HEADER_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_without_experts` read: ``tensors_read`` safetensors tensors (block scales
    included) holding ``bytes_read`` bytes of tensor data; ``skipped_expert_tensors`` routed-expert
    tensors of the checkpoint it left unread."""

    tensors_read: int
    bytes_read: int
    skipped_expert_tensors: int


@dataclass(frozen=True)
class _Read:
    """One model tensor (``target``, a parameter or persistent buffer) from checkpoint tensor
    ``key`` (and its block scales ``scales``, FP8 only), converted to ``dtype``."""

    target: str
    key: str
    dtype: torch.dtype
    scales: str | None = None


class _TensorReader:
    """Reads single tensors by name from the shards (``safe_open`` + ``get_tensor``: no whole-file
    load) and counts what it returned — the one place tensor data leaves the files."""

    def __init__(self, root: Path, files: dict[str, Path], stack: ExitStack, device: torch.device) -> None:
        self.root = root
        self.files = files
        # CPU: mapped, views at from_pretrained's alignment; elsewhere: one host buffer at a time
        self.backend = "mmap" if device.type == "cpu" else "pread"
        self._stack = stack
        self._handles: dict[Path, Any] = {}
        self.tensors = 0
        self.bytes = 0

    def handle(self, file: Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            try:
                try:
                    opened = safe_open(str(file), framework="pt", device="cpu", backend=self.backend)
                except TypeError:  # safetensors < 0.8 has no backend choice (mmap)
                    opened = safe_open(str(file), framework="pt", device="cpu")
                self._handles[file] = self._stack.enter_context(opened)
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise VExpertInputError(_FIELD, f"{file.name} is not a safetensors file: {exc}",
                                        "re-download or re-convert the shard") from None
        return self._handles[file]

    def header(self, key: str) -> tuple[tuple[int, ...], str] | None:
        """(shape, safetensors dtype) of a checkpoint tensor from its shard's header, None if absent."""
        file = self.files.get(key)
        if file is None:
            return None
        handle = self.handle(file)
        try:
            sliced = handle.get_slice(key)
        except Exception:  # the index names a shard that lacks the tensor
            return None
        return tuple(sliced.get_shape()), str(sliced.get_dtype())

    def read(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self.handle(self.files[key]).get_tensor(key)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor


def load_without_experts(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                         *, attn_implementation: str | None = None, fp8_linears: bool = False,
                         fp8_activations: bool = False) -> tuple[Any, LoadReport]:
    """The transformers causal LM of checkpoint directory ``path`` with every tensor but the routed
    experts loaded on ``device`` (in ``dtype``, float32 where transformers keeps float32), in eval mode.

    The routed experts' parameters of every sparse MoE block stay on the meta device, unread (replace
    ``mlp.experts`` before running the model). Everything else equals
    ``AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)`` exactly, non-persistent
    buffers (rotary frequencies) included. ``attn_implementation`` as in ``from_pretrained``.
    ``fp8_linears`` (``model.linear_format: fp8_block``): a block-FP8 checkpoint's bias-free linears stay FP8
    (:class:`~.fp8_linear.Fp8Linear`, weight and scales as stored) instead of being dequantised, multiplied against
    FP8 activations where ``fp8_activations`` (``model.expert_compute: w8a8``).

    Raises :class:`VExpertInputError` (field ``model.checkpoint_path``) naming the first missing,
    wrong-shaped or wrong-typed tensor, before any tensor is read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise VExpertInputError(_FIELD, f"{root / CONFIG_FILE} not found", "point it at a directory with config.json")
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        raise VExpertInputError(_FIELD, f"{root / CONFIG_FILE}: transformers cannot read it: {exc}",
                                "use the checkpoint's own config.json") from None
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    target_device = torch.device(device)
    expert_prefixes = _routed_expert_prefixes(model)
    files = _tensor_files(root)
    with ExitStack() as stack:
        reader = _TensorReader(root, files, stack, target_device)
        plan, ties = _plan(model, reader, expert_prefixes, dtype)
        for read in plan:  # every header checked: only now is tensor data read
            if fp8_linears and read.scales is not None and _keeps_fp8(model, read.target):
                _set_fp8_linear(model, reader, read, target_device, fp8_activations)
            else:
                _set_tensor(model, read.target, _materialise(reader, read, target_device, model.config))
        tensors, read_bytes = reader.tensors, reader.bytes
    _tie(model, ties)
    _recompute_non_persistent_buffers(model, expert_prefixes, target_device)
    _check_only_experts_on_meta(model, expert_prefixes)
    if (root / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(root), local_files_only=True)
    skipped = sum(1 for key in files if _under(key, expert_prefixes))
    return model.eval(), LoadReport(tensors, read_bytes, skipped)


# ---------------------------------------------------------------------------------------------
# Which tensors, from where, in what dtype
# ---------------------------------------------------------------------------------------------


def _routed_expert_prefixes(model: Any) -> tuple[str, ...]:
    """``"<block>.experts."`` of every sparse MoE block (router gate + fused experts)."""
    prefixes = tuple(f"{name}.experts." for name, module in model.named_modules() if name and is_sparse_block(module))
    if not prefixes:
        raise VExpertInputError(_FIELD, f"{type(model).__name__} has no sparse MoE block (router gate + fused experts)",
                                f"use a {supported_checkpoints()} checkpoint")
    return prefixes


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return name.startswith(prefixes)


def _plan(model: Any, reader: _TensorReader, expert_prefixes: tuple[str, ...],
          dtype: torch.dtype) -> tuple[list[_Read], list[tuple[str, str]]]:
    """The tensors to read (headers checked) and the ties (target, source) to make after reading.

    Tied pairs (``model.all_tied_weights_keys``, target → source) follow ``from_pretrained``: the
    one the checkpoint holds is read and the other tied to it; when it holds both, both are read
    and tied only if equal (:func:`_tie`)."""
    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers (tied ones twice)
    ties: list[tuple[str, str]] = []
    unread: set[str] = set()  # tied names the checkpoint lacks: tied to their partner, not read
    for target, source in dict(getattr(model, "all_tied_weights_keys", None) or {}).items():
        has_source, has_target = reader.header(source) is not None, reader.header(target) is not None
        if not (has_source or has_target):
            raise VExpertInputError(_FIELD, f"{source}: missing from {reader.root} (and so is {target}, which is "
                                    "tied to it)", "use a complete checkpoint whose config.json matches its weights")
        ties.append((target, source) if has_source else (source, target))
        if has_source != has_target:
            unread.add(target if has_source else source)
    wanted = [name for name in state if not (_under(name, expert_prefixes) or name in unread)]
    fp32_patterns = _keep_fp32_patterns(model, dtype)
    plan = [_checked_read(name, state[name], reader, fp32_patterns, model.config) for name in wanted]
    return plan, ties


def _keep_fp32_patterns(model: Any, dtype: torch.dtype) -> list[re.Pattern[str]]:
    """transformers' dtype plan: ``_keep_in_fp32_modules_strict`` stay float32 under fp16 and bf16,
    ``_keep_in_fp32_modules`` under fp16 (glob patterns searched in the parameter name)."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    return [re.compile(str(pattern).replace("*", ".*")) for pattern, kept in plan.items() if kept == torch.float32]


def _checked_read(name: str, meta: torch.Tensor, reader: _TensorReader, fp32_patterns: list[re.Pattern[str]],
                  config: Any) -> _Read:
    """The read of model tensor ``name`` (checkpoint key = parameter name), its header checked."""
    header = reader.header(name)
    fix = "use a complete checkpoint whose config.json matches its weights"
    if header is None:
        raise VExpertInputError(_FIELD, f"{name}: missing from {reader.root}", fix)
    shape, stored = header
    if shape != tuple(meta.shape):
        raise VExpertInputError(_FIELD, f"{name}: shape {list(shape)} in the checkpoint, the model built from "
                                f"config.json has {list(meta.shape)}", "use the config.json that belongs to these weights")
    want = torch.float32 if any(p.search(name) for p in fp32_patterns) else meta.dtype
    if stored == FP8_HEADER_DTYPE:
        return _Read(name, name, want, _checked_scales(name, shape, reader, config, meta))
    stored_dtype = _HEADER_DTYPES.get(stored)
    if stored_dtype is None or stored_dtype.is_floating_point != meta.is_floating_point():
        raise VExpertInputError(_FIELD, f"{name}: dtype {stored} in the checkpoint cannot become the model's {meta.dtype}",
                                "convert the checkpoint to bf16/fp16/fp32 (or DeepSeek-style block FP8)")
    return _Read(name, name, want)


def _checked_scales(name: str, shape: tuple[int, ...], reader: _TensorReader, config: Any, meta: torch.Tensor) -> str:
    """The block-scale tensor of an FP8 weight (``<name>_scale_inv``), its header checked."""
    block = _fp8_block(config)
    if block is None or len(shape) != 2 or not meta.is_floating_point():
        raise VExpertInputError(_FIELD, f"{name}: F8_E4M3 in the checkpoint, but config.json declares no block-FP8 "
                                "quantization_config (weight_block_size) for it",
                                "use the checkpoint's own config.json, or a bf16/fp16/fp32 checkpoint")
    scales = name + SCALE_SUFFIX
    header = reader.header(scales)
    want = scale_shape(shape[0], shape[1], block)
    if header is None or header[0] != want or header[1] != "F32":
        got = "missing" if header is None else f"{header[1]} {list(header[0])}"
        raise VExpertInputError(_FIELD, f"{scales}: {got}, the FP8 weight {name} needs F32 {list(want)} block scales",
                                "use a complete block-FP8 checkpoint")
    return scales


def _fp8_block(config: Any) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of a block-FP8 config.json, else None."""
    quant: Any = getattr(config, "quantization_config", None)
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    block = quant.get("weight_block_size") if quant.get("quant_method") == "fp8" else None
    if isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return int(block[0]), int(block[1])
    return None


# ---------------------------------------------------------------------------------------------
# Reading and placing
# ---------------------------------------------------------------------------------------------


def _materialise(reader: _TensorReader, read: _Read, device: torch.device, config: Any) -> torch.Tensor:
    """One tensor on ``device`` in ``read.dtype`` (no copy when the stored one already is)."""
    stored = reader.read(read.key)
    if read.scales is None:
        return stored.to(device=device, dtype=read.dtype)
    block = _fp8_block(config)
    assert block is not None  # checked with the headers
    scales = reader.read(read.scales).to(device)
    return dequantize_fp8_block(stored.to(device), scales, block, read.dtype)


def _keeps_fp8(model: Any, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    return attr == "weight" and converts_to_fp8(model.get_submodule(module_name), module_name)


def _set_fp8_linear(model: Any, reader: _TensorReader, read: _Read, device: torch.device,
                    fp8_activations: bool) -> None:
    """Replace the linear whose weight is ``read`` with an :class:`Fp8Linear` of the stored fp8 weight and scales."""
    block = _fp8_block(model.config)
    assert block is not None and read.scales is not None  # checked with the headers
    module_name = read.target.rpartition(".")[0]
    parent_name, _, attr = module_name.rpartition(".")
    linear = Fp8Linear(reader.read(read.key).to(device), reader.read(read.scales).to(device), block, fp8_activations)
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, linear)


def _set_tensor(model: Any, name: str, value: torch.Tensor) -> None:
    """Replace the meta parameter or buffer ``name`` with ``value`` (as transformers' loader does:
    a new Parameter flagged initialised, so ``_init_weights`` never overwrites it)."""
    module_name, _, attr = name.rpartition(".")
    module: nn.Module = model.get_submodule(module_name) if module_name else model
    if attr in module._parameters:
        old = module._parameters[attr]
        value = nn.Parameter(value, requires_grad=bool(old is not None and old.requires_grad)
                             and value.is_floating_point())
    value._is_hf_initialized = True  # type: ignore[attr-defined]
    setattr(module, attr, value)


def _tie(model: Any, ties: list[tuple[str, str]]) -> None:
    """Make each ``target`` the very parameter ``source`` is (both loaded: only if equal, else keep both)."""
    for target, source in ties:
        source_value = model.get_parameter(source)
        target_value = model.get_parameter(target)
        if target_value is source_value:
            continue
        if target_value.device.type != "meta" and not torch.equal(target_value, source_value):
            continue  # the checkpoint holds both, different: transformers does not tie them either
        module_name, _, attr = target.rpartition(".")
        setattr(model.get_submodule(module_name) if module_name else model, attr, source_value)


def _recompute_non_persistent_buffers(model: Any, expert_prefixes: tuple[str, ...], device: torch.device) -> None:
    """Move non-persistent buffers (not in checkpoints: rotary ``inv_freq``, …) off meta and let the
    owning PreTrainedModel's ``_init_weights`` recompute them, as ``from_pretrained`` does."""
    from transformers import PreTrainedModel

    owners: dict[str, tuple[nn.Module, Any]] = {}
    for name, module in model.named_modules():
        if _under(name + ".", expert_prefixes) or not module._non_persistent_buffers_set:
            continue
        for attr in module._non_persistent_buffers_set:
            buffer = module._buffers.get(attr)
            if buffer is None:
                continue
            fresh = torch.empty_like(buffer, device=device)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))  # a buffer _init_weights leaves alone shows up below
            module._buffers[attr] = fresh
        owners[name] = (module, _owning_model(model, name, PreTrainedModel))
    with torch.no_grad():
        for name, (module, owner) in owners.items():
            owner._init_weights(module)
            for attr in module._non_persistent_buffers_set:
                buffer = module._buffers.get(attr)
                if buffer is not None and buffer.is_floating_point() and bool(torch.isnan(buffer).any()):
                    raise RuntimeError(f"{name}.{attr}: non-persistent buffer not recomputed by "
                                       f"{type(owner).__name__}._init_weights")


def _owning_model(model: Any, name: str, base: type) -> Any:
    """The innermost PreTrainedModel containing submodule ``name`` (whose ``_init_weights`` applies)."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        candidate = model.get_submodule(".".join(parts[:end])) if end else model
        if isinstance(candidate, base):
            return candidate
    return model


def _check_only_experts_on_meta(model: Any, expert_prefixes: tuple[str, ...]) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta" and not _under(name, expert_prefixes):
            raise RuntimeError(f"{name} is still on the meta device after loading")
