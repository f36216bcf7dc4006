"""MoE checkpoints: ``config.json`` → :class:`MoESpec`, safetensors → expert, router and shared weights.

The families read, their ``config.json`` fields and their tensor names are the registry's
(:mod:`~vexpert_runtime.model.families`); this module does the I/O. Only the MoE part is read
(attention and dense layers are not this runtime's business). Shapes come from ``config.json``;
:meth:`CheckpointReader.validate` checks every needed tensor's presence, shape and dtype from the
safetensors headers alone, so a bad checkpoint fails before any process starts.

Expert weights are *packed*: one flat row ``[gate (I·H) | up (I·H) | down (H·I)]`` per expert
(:mod:`~vexpert_runtime.model.weights`), the layout of the L2 pool and the L1 slots (one copy per expert fill).

Block-FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8: ``quantization_config`` ``{quant_method: fp8,
fmt: e4m3, weight_block_size: [bo, bi]}``) store each expert and shared projection as ``F8_E4M3`` with a
``…weight_scale_inv`` F32 ``[⌈out/bo⌉, ⌈in/bi⌉]``. Their experts stay FP8 in the pool and slots
(``MoESpec.expert_storage``, :mod:`~vexpert_runtime.model.expert_format`); shared experts, which are resident,
are dequantised at load. A dense checkpoint's experts can be stored so too (``model.expert_format: fp8_block``):
quantised at load, in 128 × 128 blocks.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

import torch

from vexpert_runtime.config import ExpertComputeChoice
from vexpert_runtime.documents import read_document
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.expert_format import (
    FP8_DTYPE,
    ExpertFormat,
    dequantize_fp8_block,
    quantize_fp8_block,
)
from vexpert_runtime.model.expert_layout import DENSE, FP8_BLOCK, scale_shape
from vexpert_runtime.model.families import (
    PROJECTIONS,
    TensorNames,
    config_json_for,
    spec_from_config,
    tensor_names,
)
from vexpert_runtime.model.moe_spec import MoESpec
from vexpert_runtime.model.weights import RouterWeights, SharedExpertWeights

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SCALE_SUFFIX = "_scale_inv"  # block scales of ``X.weight`` are ``X.weight_scale_inv``
FP8_HEADER_DTYPE = "F8_E4M3"
EXPERT_FORMAT_CHOICES = ("auto", DENSE, FP8_BLOCK)
EXPERT_COMPUTE_CHOICES = get_args(ExpertComputeChoice)  # model.expert_compute


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def read_model_spec(path: str | Path, architecture: str = "auto") -> MoESpec:
    """Parse ``path/config.json`` (a Hugging Face config) into a :class:`MoESpec`.

    ``architecture`` forces the family (a name of :data:`~vexpert_runtime.model.families.FAMILIES`);
    "auto" reads ``model_type``.
    """
    return spec_from_config(read_checkpoint_config(path), architecture, origin=str(Path(path) / CONFIG_FILE))


def read_checkpoint_config(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` as a dict; a missing file, one that is not JSON (its line and column) or not an
    object is a :class:`VExpertInputError` for ``model.checkpoint_path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise VExpertInputError(
            "model.checkpoint_path", f"{config_path} not found", "point it at a directory with config.json"
        )
    data: dict[str, Any] = read_document(config_path, "model.checkpoint_path", "use the checkpoint's own config.json",
                                         fmt="json").data
    return data


def resolve_expert_storage(spec: MoESpec, requested: str, compute: str = "w8a16") -> MoESpec:
    """Apply ``model.expert_format``: ``auto`` keeps the checkpoint's own format (block FP8 stays FP8,
    dense stays in model.dtype), ``dense`` dequantises FP8 experts at load, ``fp8_block`` keeps FP8 rows —
    a block-FP8 checkpoint's own, or a dense checkpoint's experts quantised at load in 128 × 128 blocks
    (DeepSeek's converter's scheme; vLLM's ``--quantization fp8`` does the same for a whole model). Then
    ``model.expert_compute``: ``w8a16`` (FP8 rows against activations of the compute dtype) or ``w8a8``
    (activations quantised to FP8 too: FP8 rows only); ``auto`` is w8a16 here, where no device is known
    (:func:`~vexpert_runtime.node.setup.resolve_expert_compute` resolves it for a node's GPUs)."""
    if requested == "auto":
        resolved = spec
    elif requested in (DENSE, FP8_BLOCK):
        resolved = replace(spec, expert_storage=requested)
    else:
        raise VExpertInputError("model.expert_format", f"{requested!r} is unknown",
                                f"use one of {EXPERT_FORMAT_CHOICES}")
    if compute not in EXPERT_COMPUTE_CHOICES:
        raise VExpertInputError("model.expert_compute", f"{compute!r} is unknown", f"use one of {EXPERT_COMPUTE_CHOICES}")
    if compute == "w8a8" and resolved.expert_storage != FP8_BLOCK:
        raise VExpertInputError(
            "model.expert_compute", f"w8a8 multiplies FP8 expert rows, and this node keeps {resolved.expert_storage} "
            f"rows (model.expert_format {requested})",
            "set model.expert_format (--expert-format) to fp8_block, or model.expert_compute to w8a16")
    return replace(resolved, fp8_activations=compute == "w8a8")


# ---------------------------------------------------------------------------------------------
# Tensor names and shapes
# ---------------------------------------------------------------------------------------------


# Routed-expert, router and shared-gate names in the layout DeepSeek-V3 and Qwen-MoE share (tests and tools
# name tensors of tiny checkpoints with them); the reader asks the spec's family (tensor_names).
_SHARED_LAYOUT = TensorNames()


def expert_tensor(layer: int, expert: int, projection: str) -> str:
    return _SHARED_LAYOUT.expert(layer, expert, projection)


def router_tensor(layer: int) -> str:
    return _SHARED_LAYOUT.router_weight(layer)


def correction_bias_tensor(layer: int) -> str:
    return _SHARED_LAYOUT.correction_bias(layer)


def shared_tensor(spec: MoESpec, layer: int, projection: str) -> str:
    return tensor_names(spec).shared(layer, projection)


def shared_gate_tensor(layer: int) -> str:
    return _SHARED_LAYOUT.shared_gate(layer)


def projection_shape(projection: str, rows: int, hidden: int) -> tuple[int, int]:
    """gate/up: [I, H]; down: [H, I]."""
    return (hidden, rows) if projection == "down" else (rows, hidden)


def required_tensors(spec: MoESpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor the runtime reads, with its expected shape."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    names = tensor_names(spec)
    for layer in spec.moe_layers:
        yield names.router_weight(layer), (spec.num_experts, hidden)
        if spec.correction_bias:
            yield names.correction_bias(layer), (spec.num_experts,)
        for expert in range(spec.num_experts):
            for proj in PROJECTIONS:
                yield from _projection_tensors(spec, names.expert(layer, expert, proj), projection_shape(proj, inter, hidden))
        if spec.shared_intermediate_size:
            for proj in PROJECTIONS:
                shape = projection_shape(proj, spec.shared_intermediate_size, hidden)
                yield from _projection_tensors(spec, names.shared(layer, proj), shape)
        if spec.shared_expert_gate:
            yield names.shared_gate(layer), (1, hidden)


def _projection_tensors(spec: MoESpec, name: str, shape: tuple[int, int]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A projection weight and, in a block-FP8 checkpoint, its scales [⌈out/bo⌉, ⌈in/bi⌉]."""
    yield name, shape
    if spec.fp8_block is not None:
        yield name + SCALE_SUFFIX, scale_shape(*shape, spec.fp8_block)


def is_fp8_projection(spec: MoESpec, name: str) -> bool:
    """Whether ``name`` is an expert or shared projection stored as FP8 in ``spec``'s checkpoint."""
    return spec.fp8_block is not None and tensor_names(spec).is_projection(name)


def _dtype_problem(spec: MoESpec, name: str, dtype: str) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) when a tensor's header dtype does not fit ``spec``, else None."""
    if name.endswith(SCALE_SUFFIX):
        if dtype == "F32":
            return None
        return f"has dtype {dtype}; block scales (weight_scale_inv) must be F32", "re-convert the checkpoint"
    if is_fp8_projection(spec, name):
        if dtype == FP8_HEADER_DTYPE:
            return None
        return (f"has dtype {dtype}, but config.json's quantization_config declares F8_E4M3 weights",
                "use the config.json that belongs to these weights")
    if dtype == FP8_HEADER_DTYPE:
        return ("is F8_E4M3, but config.json has no FP8 quantization_config",
                "use the checkpoint's own config.json (quantization_config: quant_method fp8, weight_block_size)")
    if dtype not in _FLOAT_DTYPES:
        return (f"has dtype {dtype}; only F32/F16/BF16 tensors and block-FP8 (F8_E4M3 + F32 scales) projections "
                "are supported", "convert the checkpoint to bf16 or to DeepSeek-style block FP8")
    return None


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


# Safetensors files are read here without the library: the header (8-byte little-endian length, then
# JSON) gives each tensor's dtype, shape and byte range, and tensor bytes are read with plain reads
# straight into the tensor that keeps them. Nothing is memory-mapped and no handle outlives a read,
# so a process holds exactly the tensors it asked for: a mapping would keep every page it touched
# resident (and counted in its RSS) for as long as the handle lived.
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_STORED_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": FP8_DTYPE, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's header entry: safetensors dtype name, shape and absolute byte range in its file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return _STORED_DTYPES.get(self.dtype)


def _not_safetensors(file: Path, why: str) -> VExpertInputError:
    return VExpertInputError("model.checkpoint_path", f"{file.name} is not a safetensors file: {why}",
                             "re-download or re-convert the shard")


def read_safetensors_header(file: Path) -> dict[str, StoredTensor]:
    """Tensor name → :class:`StoredTensor` from a safetensors file's header (no tensor bytes read).
    Raises :class:`VExpertInputError` ("… is not a safetensors file: …") for a truncated, empty or
    corrupt file."""
    try:
        with open(file, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _not_safetensors(file, f"{size} bytes, shorter than the 8-byte header length")
            length = struct.unpack("<Q", prefix)[0]
            if length > min(size - 8, _MAX_HEADER_BYTES):
                raise _not_safetensors(file, f"header length {length} exceeds the file ({size} bytes) or 100 MB")
            raw = handle.read(length)
    except OSError as exc:
        raise VExpertInputError("model.checkpoint_path", f"{file.name} cannot be read: {exc}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _not_safetensors(file, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _not_safetensors(file, "header is not a JSON object")
    data_start, data_bytes = 8 + length, size - 8 - length
    out: dict[str, StoredTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (isinstance(dtype, str) and isinstance(shape, list)
                     and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, begin, end)))
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise _not_safetensors(file, f"bad header entry for {name}")
        stored = StoredTensor(dtype, tuple(shape), data_start + begin, data_start + end)
        torch_dtype = stored.torch_dtype
        if begin > end or (torch_dtype is not None and end - begin != stored.numel * _itemsize(torch_dtype)):
            raise _not_safetensors(file, f"{name}'s byte range [{begin}, {end}) does not fit {dtype} {shape}")
        if end > data_bytes:
            raise _not_safetensors(file, f"it ends before {name} does (truncated: {size} bytes)")
        out[name] = stored
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_bytes(file: Path, stored: StoredTensor, name: str, out: torch.Tensor) -> None:
    """Read ``stored``'s bytes into ``out`` (a contiguous CPU tensor of exactly that many bytes)."""
    view = out.reshape(-1).view(torch.uint8).numpy().data  # writable, shares out's memory
    if len(view) != stored.end - stored.start:
        raise ValueError(f"{name}: {len(view)} bytes asked, {stored.end - stored.start} stored")
    done = 0
    try:
        with open(file, "rb", buffering=0) as handle:
            handle.seek(stored.start)
            while done < len(view):
                got = handle.readinto(view[done:])
                if not got:
                    raise _not_safetensors(file, f"it ends inside {name} (truncated)")
                done += got
    except OSError as exc:
        raise VExpertInputError("model.checkpoint_path", f"{file.name} cannot be read: {exc}") from None


class CheckpointReader:
    """Lazy reader of a (possibly sharded) safetensors checkpoint; reads only the tensors asked for.

    It caches each shard's header, never its bytes: a tensor read is a plain read into the tensor
    returned (or, for :meth:`experts` with ``out``, into the caller's rows), so the reader adds
    nothing to a process's memory beyond what the caller keeps."""

    def __init__(self, path: str | Path, spec: MoESpec) -> None:
        self.path = Path(path)
        self.spec = spec
        self._file_of = _tensor_files(self.path)
        self._headers: dict[Path, dict[str, StoredTensor]] = {}

    def _header(self, file: Path) -> dict[str, StoredTensor]:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    def _keys(self, file: Path) -> set[str]:
        return set(self._header(file))

    def _stored(self, name: str) -> tuple[Path, StoredTensor]:
        file = self._file_of.get(name)
        if file is None:
            raise VExpertInputError("model.checkpoint_path", f"tensor {name} is missing from {self.path}")
        stored = self._header(file).get(name)
        if stored is None:
            raise VExpertInputError("model.checkpoint_path",
                                    f"tensor {name} is missing from {file.name} (the index lists it there)",
                                    "use a complete checkpoint whose index matches its shards")
        return file, stored

    def has(self, name: str) -> bool:
        return name in self._file_of

    def validate(self) -> None:
        """Check presence, shape and dtype of every needed tensor (headers only). Raises
        :class:`VExpertInputError` naming the first bad tensor."""
        for name, shape in required_tensors(self.spec):
            file = self._file_of.get(name)
            if file is None:
                raise VExpertInputError(
                    "model.checkpoint_path",
                    f"tensor {name} is missing from {self.path}",
                    "use a complete checkpoint whose config.json matches its weights",
                )
            stored = self._header(file).get(name)
            if stored is None:
                raise VExpertInputError(
                    "model.checkpoint_path",
                    f"tensor {name} is missing from {file.name} (the index lists it there)",
                    "use a complete checkpoint whose index matches its shards",
                )
            if stored.shape != shape:
                raise VExpertInputError(
                    "model.checkpoint_path",
                    f"tensor {name} in {file.name} has shape {list(stored.shape)}, config.json implies {list(shape)}",
                    "use the config.json that belongs to these weights",
                )
            problem = _dtype_problem(self.spec, name, stored.dtype)
            if problem is not None:
                raise VExpertInputError("model.checkpoint_path", f"tensor {name} in {file.name} {problem[0]}", problem[1])

    def raw(self, name: str) -> torch.Tensor:
        """A tensor in its stored dtype (a new tensor: its bytes read from the shard)."""
        file, stored = self._stored(name)
        dtype = stored.torch_dtype
        if dtype is None:
            raise VExpertInputError("model.checkpoint_path", f"tensor {name} in {file.name} has dtype {stored.dtype}, "
                                    "which this runtime cannot read")
        out = torch.empty(stored.shape, dtype=dtype)
        if out.numel():
            _read_bytes(file, stored, name, out)
        return out

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor converted to ``dtype``; FP8 projections are dequantised with their block scales
        (a plain cast would drop the scales)."""
        out = self.raw(name)
        if out.dtype == FP8_DTYPE:
            if self.spec.fp8_block is None:
                raise VExpertInputError("model.checkpoint_path", f"tensor {name} is F8_E4M3 but config.json declares no FP8")
            return dequantize_fp8_block(out, self.raw(name + SCALE_SUFFIX), self.spec.fp8_block, dtype)
        return out.to(dtype)

    def _fill(self, name: str, target: torch.Tensor) -> None:
        """Write tensor ``name``, flattened and in ``target``'s dtype, into the 1-D ``target``: straight
        from the file when the stored dtype is ``target``'s and ``target`` is dense CPU memory, else
        through one temporary (a cast, FP8 dequantisation, or a device copy)."""
        file, stored = self._stored(name)
        if stored.numel != target.numel():
            raise VExpertInputError("model.checkpoint_path",
                                    f"tensor {name} in {file.name} has shape {list(stored.shape)} "
                                    f"({stored.numel} elements), the packed row expects {target.numel()}",
                                    "use the config.json that belongs to these weights")
        if stored.torch_dtype == target.dtype and target.device.type == "cpu" and target.is_contiguous():
            if target.numel():
                _read_bytes(file, stored, name, target)
            return
        source = self.raw(name) if stored.torch_dtype == target.dtype else self.tensor(name, target.dtype)
        target.copy_(source.reshape(-1))

    def _fill_row(self, layer: int, expert: int, fmt: ExpertFormat, row: torch.Tensor) -> None:
        """Packed row ``row`` [D] of ``expert`` of checkpoint layer ``layer`` in format ``fmt``."""
        names = {p: tensor_names(self.spec).expert(layer, expert, p) for p in PROJECTIONS}
        if fmt.fp8_block is None:
            n = fmt.intermediate * fmt.hidden
            for k, name in enumerate(names.values()):
                self._fill(name, row[k * n : (k + 1) * n])
            return
        layout = fmt.layout
        for proj, name in names.items():
            weights, scales = layout.matrix_range(proj), layout.scale_range(proj)  # scales 16-byte aligned: float32 views
            if self.spec.fp8_block is None:  # a dense checkpoint's expert, quantised here (model.expert_format: fp8_block)
                weight, scale = quantize_fp8_block(self.tensor(name), layout.block)
                row[weights[0] : weights[1]].view(FP8_DTYPE).copy_(weight.reshape(-1))
                row[scales[0] : scales[1]].view(torch.float32).copy_(scale.reshape(-1))
                continue
            self._fill(name, row[weights[0] : weights[1]].view(FP8_DTYPE))
            self._fill(name + SCALE_SUFFIX, row[scales[0] : scales[1]].view(torch.float32))
        row[layout.matrix_range("down")[1] : layout.scales_offset].zero_()  # padding, as pack_fp8 leaves it
        row[layout.scale_range("down")[1] :].zero_()

    def expert(self, layer_index: int, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Packed row [D] of expert ``expert`` of MoE layer ``layer_index`` (0..L−1) in the spec's
        storage format (``dtype`` is the compute dtype: the element type of dense rows)."""
        return self.experts(layer_index, [expert], dtype)[0]

    def experts(self, layer_index: int, experts: list[int], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed rows [len(experts), D] (see :meth:`expert`), each read straight into its row of one
        tensor: ``out`` when given (a [len(experts), D] tensor of the row dtype, e.g. a pool buffer;
        returned), else a new one. Peak memory is the rows plus, at most, one projection in flight
        (none when the checkpoint's dtype is the row's)."""
        fmt = self.spec.expert_format(dtype)
        shape = (len(experts), fmt.row_numel)
        if out is None:
            out = torch.empty(shape, dtype=fmt.row_dtype)
        elif tuple(out.shape) != shape or out.dtype != fmt.row_dtype:
            raise ValueError(f"out is {out.dtype} {list(out.shape)}, the rows are {fmt.row_dtype} {list(shape)}")
        layer = self.spec.moe_layers[layer_index]
        direct = out.device.type == "cpu" and out.stride(-1) == 1
        staging = None if direct else torch.empty(fmt.row_numel, dtype=fmt.row_dtype)
        for i, expert in enumerate(experts):
            if staging is None:
                self._fill_row(layer, expert, fmt, out[i])
            else:  # a device or strided destination: one row of host staging
                self._fill_row(layer, expert, fmt, staging)
                out[i].copy_(staging)
        return out

    def router(self, layer_index: int) -> RouterWeights:
        layer = self.spec.moe_layers[layer_index]
        names = tensor_names(self.spec)
        bias = self.tensor(names.correction_bias(layer)) if self.spec.correction_bias else None
        return RouterWeights(self.tensor(names.router_weight(layer)), bias)

    def shared(self, layer_index: int, dtype: torch.dtype) -> SharedExpertWeights | None:
        if not self.spec.shared_intermediate_size:
            return None
        layer = self.spec.moe_layers[layer_index]
        names = tensor_names(self.spec)
        gate, up, down = (self.tensor(names.shared(layer, p), dtype) for p in PROJECTIONS)
        out_gate = self.tensor(names.shared_gate(layer), dtype) if self.spec.shared_expert_gate else None
        return SharedExpertWeights(gate, up, down, out_gate)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name → shard file, from ``model.safetensors.index.json`` or every shard's header."""
    if not path.is_dir():
        raise VExpertInputError("model.checkpoint_path", f"{path} is not a directory")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise VExpertInputError("model.checkpoint_path", f"{index} has no valid weight_map") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
            raise VExpertInputError(
                "model.checkpoint_path", f"{index}: weight_map must map tensor names to shard file names"
            )
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise VExpertInputError("model.checkpoint_path", f"{index.name} names {file.name}, which is missing")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise VExpertInputError("model.checkpoint_path", f"no *.safetensors files in {path}")
    files = {}
    for shard in shards:
        files.update(dict.fromkeys(read_safetensors_header(shard), shard))
    return files


# ---------------------------------------------------------------------------------------------
# Writing tiny checkpoints (tests and the demo)
# ---------------------------------------------------------------------------------------------


def random_weights(spec: MoESpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for every tensor in :func:`required_tensors`, scaled so activations stay O(1):
    fp32, except that a block-FP8 spec gets its projections quantised (fp8 + F32 scales)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in required_tensors(spec):
        if name.endswith(SCALE_SUFFIX):
            continue  # written with its weight below
        if name.endswith("e_score_correction_bias"):
            out[name] = 0.05 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            out[name] = torch.randn(shape, generator=gen) / fan_in**0.5
        if is_fp8_projection(spec, name):
            assert spec.fp8_block is not None
            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_block(out[name], spec.fp8_block)
    return out


def write_checkpoint(path: str | Path, spec: MoESpec, weights: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """Write ``config.json``, ``shards`` safetensors files and the index into ``path``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config_json_for(spec), indent=2))
    names = list(weights)
    per_shard = -(-len(names) // max(1, shards))
    weight_map: dict[str, str] = {}
    for i in range(0, len(names), per_shard):
        file = f"model-{i // per_shard + 1:05d}-of-{-(-len(names) // per_shard):05d}.safetensors"
        chunk = {n: weights[n].contiguous() for n in names[i : i + per_shard]}
        save_file(chunk, str(out / file))
        weight_map.update(dict.fromkeys(chunk, file))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out


def write_tiny_checkpoint(path: str | Path, spec: MoESpec, seed: int = 0, shards: int = 2) -> Path:
    """A complete random checkpoint of ``spec``'s shape (what tests and ``vexpert demo`` load)."""
    return write_checkpoint(path, spec, random_weights(spec, seed), shards)
