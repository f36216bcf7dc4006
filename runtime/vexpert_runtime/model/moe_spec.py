"""``MoESpec``: what the runtime knows about a model's MoE layers, and the ``config.json`` fields every
family reads the same way (positive sizes, block-FP8 ``quantization_config``, the spec's own checks).

Each family's parser (:mod:`~vexpert_runtime.model.families`) builds a :class:`MoESpec` from a
``config.json`` mapping with these helpers. Torch-free, like the registry that imports it: the
operator reads family names and shapes without torch; the methods that hand out torch objects
import it when called.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.expert_layout import DEFAULT_FP8_BLOCK, DENSE, FP8_BLOCK

if TYPE_CHECKING:
    import torch

    from vexpert_runtime.model.expert_format import ExpertFormat


@dataclass(frozen=True)
class MoESpec:
    """What the runtime needs to know about a model's MoE layers.

    ``moe_layers`` are checkpoint layer indices (``model.layers.{l}``); everything else in the runtime
    numbers MoE layers 0..L−1 in that order.
    """

    architecture: str  # the family's name in model.families.FAMILIES (e.g. DEEPSEEK or QWEN)
    hidden_size: int  # H
    intermediate_size: int  # I, per routed expert
    num_experts: int  # E
    top_k: int  # K
    moe_layers: tuple[int, ...]
    scoring: str = "sigmoid"  # "sigmoid" (DeepSeek-V3) or "softmax" (Qwen)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    correction_bias: bool = False  # DeepSeek-V3 noaux_tc: e_score_correction_bias per layer
    shared_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert's output
    fp8_block: tuple[int, int] | None = None  # checkpoint's expert/shared projections are block FP8 (bo, bi)
    expert_storage: str = DENSE  # row format of pool and slots: DENSE or FP8_BLOCK (resolve_expert_storage)
    fp8_activations: bool = False  # FP8 rows multiplied against FP8 activations (model.expert_compute w8a8)

    @property
    def num_layers(self) -> int:
        """L: MoE layers."""
        return len(self.moe_layers)

    def expert_format(self, compute_dtype: torch.dtype) -> ExpertFormat:
        """How pool and slot rows are stored and read, computing in ``compute_dtype`` (model.dtype)."""
        # imported on use: expert_format needs torch, and the operator imports this module without it
        from vexpert_runtime.model.expert_format import ExpertFormat

        return ExpertFormat(self.intermediate_size, self.hidden_size, compute_dtype, self.storage_block,
                            self.fp8_activations)

    @property
    def storage_block(self) -> tuple[int, int] | None:
        """The FP8 block of the pool's and slots' rows (None: dense rows): the checkpoint's own, or — a dense
        checkpoint stored as FP8 (``model.expert_format: fp8_block``), quantised at load — DeepSeek-V3's 128 × 128."""
        if self.expert_storage != FP8_BLOCK:
            return None
        return self.fp8_block or DEFAULT_FP8_BLOCK

    @property
    def expert_numel(self) -> int:
        """D: elements of one packed expert row (dense: 3·I·H; FP8: bytes of weights and scales)."""
        import torch  # on use, as in expert_format

        return self.expert_format(torch.float32).row_numel

    def row_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Element type of packed rows (pool, slots) when the model computes in ``dtype``."""
        return self.expert_format(dtype).row_dtype

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one packed expert row (one slot fill)."""
        return self.expert_format(dtype).row_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# config.json fields every family reads alike
# ---------------------------------------------------------------------------------------------


def positive_int(raw: dict[str, Any], key: str, origin: str) -> int:
    """``raw[key]``, which must be a positive integer (a boolean is not one)."""
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise VExpertInputError(f"{origin}: {key}", f"must be a positive integer, got {value!r}")
    return value


def quantization_fields(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """MoESpec fields for ``quantization_config``: none (dense), or block FP8 stored as FP8 (auto)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return {}
    field = f"{origin}: quantization_config"
    fix = "use a bf16/fp16/fp32 checkpoint or a block-FP8 one (quant_method fp8, fmt e4m3, weight_block_size)"
    if not isinstance(quant, dict):
        raise VExpertInputError(field, f"must be an object, got {quant!r}", fix)
    if quant.get("quant_method") != "fp8":
        raise VExpertInputError(f"{field}.quant_method", f"{quant.get('quant_method')!r} is not supported", fix)
    if quant.get("fmt", "e4m3") != "e4m3":
        raise VExpertInputError(f"{field}.fmt", f"{quant.get('fmt')!r} is not supported (only e4m3)", fix)
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise VExpertInputError(
            f"{field}.weight_block_size", f"must be two positive integers, got {block!r} (per-tensor FP8 is not supported)", fix
        )
    return {"fp8_block": (block[0], block[1]), "expert_storage": FP8_BLOCK}


def quantization_config_for(spec: MoESpec) -> dict[str, Any]:
    """The ``config.json`` entries that :func:`quantization_fields` reads back into ``spec``'s."""
    if spec.fp8_block is None:
        return {}
    return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(spec.fp8_block),
                                    "activation_scheme": "dynamic"}}


def checked_spec(spec: MoESpec, origin: str) -> MoESpec:
    """``spec`` if its routing is consistent (layers, top-k within experts and groups), else raise."""
    if not spec.moe_layers:
        raise VExpertInputError(origin, "the model has no MoE layers")
    if spec.top_k > spec.num_experts:
        raise VExpertInputError(f"{origin}: num_experts_per_tok", f"{spec.top_k} exceeds {spec.num_experts} experts")
    if spec.num_experts % spec.n_group != 0:
        raise VExpertInputError(f"{origin}: n_group", f"{spec.n_group} does not divide {spec.num_experts} experts")
    if not 1 <= spec.topk_group <= spec.n_group:
        raise VExpertInputError(f"{origin}: topk_group", f"must be in [1, n_group={spec.n_group}]")
    per_group = spec.num_experts // spec.n_group
    if spec.topk_group * per_group < spec.top_k:
        raise VExpertInputError(f"{origin}: topk_group", "the selected groups hold fewer experts than top_k")
    return spec
