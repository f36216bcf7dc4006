"""The model families vExpert reads: the one registry of their names, how each family's ``config.json``
becomes a :class:`~vexpert_runtime.model.moe_spec.MoESpec`, how its MoE tensors are named in the
checkpoint, and the published model the operator sizes a deployment from when it gives no shape.

Everything that depends on the family reads it here: ``model.architecture`` in the runtime config and
in the operator's CRD (:data:`Architecture`), the checkpoint reader (:func:`tensor_names`), the
tiny-checkpoint writer (:func:`config_json_for`) and the operator's sizing (:attr:`ModelFamily.reference`).
Serving needs nothing per family: it runs transformers' own module for the checkpoint (any whose sparse
blocks have a router ``gate`` and fused ``experts``, see :mod:`vexpert_runtime.serve.sparse_blocks`).

Adding a family: its name in :data:`FamilyName`, one :class:`ModelFamily` in ``_ENTRIES`` below, and tests
(``tests/test_model_families.py`` reads every entry). Torch-free: the operator imports this module.

The families:

* DeepSeek-V3 (``model_type: deepseek_v3``): ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
  router ``mlp.gate.weight`` [E, H] and, for ``topk_method: noaux_tc``, ``mlp.gate.e_score_correction_bias``
  [E]; shared experts ``mlp.shared_experts.{gate,up,down}_proj.weight`` (intermediate
  ``n_shared_experts · moe_intermediate_size``). MoE layers are ``l ≥ first_k_dense_replace`` with
  ``l % moe_layer_freq == 0``.
* Qwen-MoE (``model_type: qwen2_moe`` / ``qwen3_moe``): same expert and router names, shared expert
  ``mlp.shared_expert.{gate,up,down}_proj.weight`` plus its sigmoid gate ``mlp.shared_expert_gate.weight``
  [1, H] (Qwen2 only). MoE layers are those not in ``mlp_only_layers`` with ``(l+1) % decoder_sparse_step == 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.moe_spec import (
    MoESpec,
    checked_spec,
    positive_int,
    quantization_config_for,
    quantization_fields,
)

FamilyName = Literal["deepseek_v3", "qwen2_moe"]
# model.architecture: a family, or "auto" = the one whose model_types hold config.json's model_type
Architecture = Literal[FamilyName, "auto"]
AUTO = "auto"
DEEPSEEK: FamilyName = "deepseek_v3"
QWEN: FamilyName = "qwen2_moe"
PROJECTIONS = ("gate", "up", "down")  # an expert's SwiGLU projections, in packed-row order


@dataclass(frozen=True)
class TensorNames:
    """Where a family's MoE tensors are in its checkpoint, all under ``model.layers.{layer}.{block}``
    (Hugging Face layout: one tensor per projection). The defaults are DeepSeek-V3's names."""

    block: str = "mlp"  # the decoder layer's MoE module
    router: str = "gate"  # its weight [E, H] and, with noaux_tc, e_score_correction_bias [E]
    experts: str = "experts"  # routed experts: {experts}.{e}.{projection}.weight
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # names of gate, up, down
    shared_expert: str = "shared_experts"
    shared_expert_gate: str = "shared_expert_gate"  # Qwen2-MoE's sigmoid gate on the shared expert

    def _block(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}"

    def _projection(self, projection: str) -> str:
        return self.projections[PROJECTIONS.index(projection)]

    def expert(self, layer: int, expert: int, projection: str) -> str:
        return f"{self._block(layer)}.{self.experts}.{expert}.{self._projection(projection)}.weight"

    def router_weight(self, layer: int) -> str:
        return f"{self._block(layer)}.{self.router}.weight"

    def correction_bias(self, layer: int) -> str:
        return f"{self._block(layer)}.{self.router}.e_score_correction_bias"

    def shared(self, layer: int, projection: str) -> str:
        return f"{self._block(layer)}.{self.shared_expert}.{self._projection(projection)}.weight"

    def shared_gate(self, layer: int) -> str:
        return f"{self._block(layer)}.{self.shared_expert_gate}.weight"

    def is_projection(self, name: str) -> bool:
        """Whether ``name`` is a routed or shared expert's projection weight (what block FP8 quantises)."""
        return name.endswith(tuple(f".{p}.weight" for p in self.projections))


@dataclass(frozen=True)
class ReferenceShape:
    """A published model of the family: the MoE shape the operator sizes a deployment from when its
    spec gives none (the runtime always reads the real one from ``config.json``)."""

    model: str
    num_experts: int  # E
    num_moe_layers: int  # L
    intermediate_size: int  # I, per routed expert
    hidden_size: int  # H
    top_k: int  # K


@dataclass(frozen=True)
class ModelFamily:
    """One entry of the registry: everything that differs between families."""

    name: FamilyName
    title: str  # how people name it, for messages
    model_types: tuple[str, ...]  # config.json model_type values read as this family; the first is written
    hf_architecture: str  # config.json "architectures" of the checkpoints config_json_for describes
    parse: Callable[[dict[str, Any], str], MoESpec]  # config.json mapping, origin → spec (checked after)
    config_fields: Callable[[MoESpec, int], dict[str, Any]]  # spec, first MoE layer → family's config.json keys
    tensors: TensorNames
    reference: ReferenceShape


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3
# ---------------------------------------------------------------------------------------------


def _deepseek_spec(raw: dict[str, Any], origin: str) -> MoESpec:
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise VExpertInputError(
            f"{origin}: scoring_func", f"{raw.get('scoring_func')!r} is not supported", "DeepSeek-V3 uses sigmoid"
        )
    layers = positive_int(raw, "num_hidden_layers", origin)
    first_dense = int(raw.get("first_k_dense_replace", 0) or 0)
    freq = int(raw.get("moe_layer_freq", 1) or 1)
    experts = positive_int(raw, "n_routed_experts", origin)  # checked in this order: the first problem is named
    return MoESpec(
        architecture=DEEPSEEK,
        hidden_size=positive_int(raw, "hidden_size", origin),
        intermediate_size=positive_int(raw, "moe_intermediate_size", origin),
        num_experts=experts,
        top_k=positive_int(raw, "num_experts_per_tok", origin),
        moe_layers=tuple(i for i in range(first_dense, layers) if i % freq == 0),
        scoring="sigmoid",
        n_group=int(raw.get("n_group", 1) or 1),
        topk_group=int(raw.get("topk_group", 1) or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0) or 1.0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        correction_bias=raw.get("topk_method", "noaux_tc") == "noaux_tc",
        shared_intermediate_size=int(raw.get("n_shared_experts", 0) or 0) * positive_int(raw, "moe_intermediate_size", origin),
        **quantization_fields(raw, origin),
    )


def _deepseek_config(spec: MoESpec, first_moe_layer: int) -> dict[str, Any]:
    if spec.shared_intermediate_size % spec.intermediate_size:
        raise ValueError("DeepSeek shared experts must be a multiple of moe_intermediate_size")
    return {
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": spec.shared_intermediate_size // spec.intermediate_size,
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc" if spec.correction_bias else "greedy",
        "first_k_dense_replace": first_moe_layer,
        "moe_layer_freq": 1,
    }


# ---------------------------------------------------------------------------------------------
# Qwen-MoE (Qwen2-MoE, Qwen3-MoE)
# ---------------------------------------------------------------------------------------------


def _qwen_spec(raw: dict[str, Any], origin: str) -> MoESpec:
    layers = positive_int(raw, "num_hidden_layers", origin)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers", []) or [])
    shared = int(raw.get("shared_expert_intermediate_size", 0) or 0)
    return MoESpec(
        architecture=QWEN,
        hidden_size=positive_int(raw, "hidden_size", origin),
        intermediate_size=positive_int(raw, "moe_intermediate_size", origin),
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
        num_experts=positive_int(raw, "num_experts" if "num_experts" in raw else "num_local_experts", origin),
        top_k=positive_int(raw, "num_experts_per_tok", origin),
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        scoring="softmax",
        norm_topk_prob=bool(raw.get("norm_topk_prob", raw.get("model_type") == "qwen3_moe")),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        **quantization_fields(raw, origin),
    )


def _qwen_config(spec: MoESpec, first_moe_layer: int) -> dict[str, Any]:
    return {
        "num_experts": spec.num_experts,
        "shared_expert_intermediate_size": spec.shared_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(first_moe_layer)),
    }


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

_ENTRIES = (
    ModelFamily(
        name=DEEPSEEK, title="DeepSeek-V3", model_types=("deepseek_v3",), hf_architecture="DeepseekV3ForCausalLM",
        parse=_deepseek_spec, config_fields=_deepseek_config, tensors=TensorNames(),
        # 58 MoE layers × 256 experts, expert = 3 × 7168 × 2048 parameters (the paper's 84 MiB slot in bf16)
        reference=ReferenceShape("deepseek-ai/DeepSeek-V3", num_experts=256, num_moe_layers=58,
                                 intermediate_size=2048, hidden_size=7168, top_k=8),
    ),
    ModelFamily(
        name=QWEN, title="Qwen-MoE", model_types=("qwen2_moe", "qwen3_moe"), hf_architecture="Qwen2MoeForCausalLM",
        parse=_qwen_spec, config_fields=_qwen_config, tensors=TensorNames(shared_expert="shared_expert"),
        reference=ReferenceShape("Qwen/Qwen1.5-MoE-A2.7B", num_experts=60, num_moe_layers=24,
                                 intermediate_size=1408, hidden_size=2048, top_k=4),
    ),
)
FAMILIES: dict[str, ModelFamily] = {entry.name: entry for entry in _ENTRIES}


def family(name: str) -> ModelFamily:
    """The registry entry named ``name`` (a :class:`MoESpec`'s ``architecture``)."""
    found = FAMILIES.get(name)
    if found is None:
        raise ValueError(f"{name!r} is not a model family; known: {', '.join(FAMILIES)}")
    return found


def family_of_model_type(model_type: str) -> ModelFamily | None:
    """The family that reads checkpoints of ``config.json``'s ``model_type``, None if none does."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def supported_checkpoints() -> str:
    """The families as a newcomer would ask for them: 'DeepSeek-V3 (deepseek_v3) or Qwen-MoE (…)'."""
    return " or ".join(f"{f.title} ({', '.join(f.model_types)})" for f in FAMILIES.values())


def tensor_names(spec: MoESpec) -> TensorNames:
    """How the checkpoint ``spec`` was read from names its MoE tensors."""
    return family(spec.architecture).tensors


def spec_from_config(raw: dict[str, Any], architecture: str = AUTO, origin: str = "config.json") -> MoESpec:
    """Build a :class:`MoESpec` from a parsed ``config.json`` mapping. ``architecture`` forces the
    family (a name of :data:`FAMILIES`); ``auto`` takes the one whose ``model_types`` hold ``model_type``."""
    model_type = str(raw.get("model_type", ""))
    chosen = family_of_model_type(model_type) if architecture == AUTO else FAMILIES.get(architecture)
    if chosen is None:
        raise VExpertInputError(
            "model.architecture",
            f"{origin}: model_type {model_type!r} is not a supported MoE family",
            f"use a {supported_checkpoints()} checkpoint, or set model.architecture",
        )
    return checked_spec(chosen.parse(raw, origin), origin)


def config_json_for(spec: MoESpec) -> dict[str, Any]:
    """A Hugging Face style ``config.json`` mapping describing ``spec`` (for tiny test checkpoints).

    The MoE layers must be contiguous at the end (dense layers before them).
    """
    first = spec.moe_layers[0]
    if spec.moe_layers != tuple(range(first, first + spec.num_layers)):
        raise ValueError("config_json_for needs contiguous MoE layers")
    entry = family(spec.architecture)
    return {
        "model_type": entry.model_types[0],
        "architectures": [entry.hf_architecture],
        "hidden_size": spec.hidden_size,
        "moe_intermediate_size": spec.intermediate_size,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": first + spec.num_layers,
        "norm_topk_prob": spec.norm_topk_prob,
        "torch_dtype": "float32",
        **quantization_config_for(spec),
        **entry.config_fields(spec, first),
    }
