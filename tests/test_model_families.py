"""The model-family registry (``vexpert_runtime.model.families``): every consumer reads the family
names from it, and every entry parses, writes, names and sizes its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import pytest

from operator_support.samples import spec as deployment_spec
from vexpert_operator.api import ModelSpec, VExpertModelProfileSpec
from vexpert_operator.crdgen import all_crds
from vexpert_operator.sizing import KNOWN_SHAPES, model_shape
from vexpert_runtime.config import ModelSource
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.expert_layout import FP8_BLOCK
from vexpert_runtime.model.families import (
    AUTO,
    DEEPSEEK,
    FAMILIES,
    QWEN,
    Architecture,
    FamilyName,
    config_json_for,
    family,
    spec_from_config,
    tensor_names,
)
from vexpert_runtime.model.moe_spec import MoESpec

# One tiny spec per family, shaped the way its config.json can express (a new family adds one here).
TINY: dict[str, MoESpec] = {
    DEEPSEEK: MoESpec(architecture=DEEPSEEK, hidden_size=16, intermediate_size=8, num_experts=8, top_k=3,
                      moe_layers=(1, 2), n_group=4, topk_group=2, routed_scaling_factor=2.5, correction_bias=True,
                      shared_intermediate_size=16),
    QWEN: MoESpec(architecture=QWEN, hidden_size=16, intermediate_size=8, num_experts=6, top_k=2, moe_layers=(0, 1),
                  scoring="softmax", norm_topk_prob=False, shared_intermediate_size=12, shared_expert_gate=True),
}


def _crd_architecture_enums() -> list[list[str]]:
    """The enum of every ``architecture`` property in the generated CRDs."""
    found: list[list[str]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            arch = node.get("properties", {}).get("architecture")
            if arch is not None:
                found.append(arch["enum"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(all_crds())
    return found


def test_every_consumer_reads_the_family_names_from_the_registry() -> None:
    names = tuple(FAMILIES)
    assert get_args(FamilyName) == names
    assert get_args(Architecture) == (*names, AUTO)
    for field in (ModelSource.model_fields["architecture"], ModelSpec.model_fields["architecture"],
                  VExpertModelProfileSpec.model_fields["architecture"]):
        assert field.annotation is Architecture
    enums = _crd_architecture_enums()
    assert len(enums) == 2 and all(enum == [*names, AUTO] for enum in enums)  # deployment and model profile
    assert tuple(KNOWN_SHAPES) == names
    assert set(TINY) == set(names), "give the new family a tiny spec in TINY"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_reads_back_the_config_json_it_writes(name: str) -> None:
    spec = TINY[name]
    raw = config_json_for(spec)
    assert raw["model_type"] in family(name).model_types
    assert spec_from_config(raw) == spec
    assert spec_from_config(raw, architecture=name) == spec


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_reads_its_checkpoints_by_its_own_tensor_names(tmp_path: Path, name: str) -> None:
    from safetensors import safe_open

    from vexpert_runtime.model.checkpoint import CheckpointReader, read_model_spec, write_tiny_checkpoint

    spec = TINY[name]
    write_tiny_checkpoint(tmp_path, spec)
    reader = CheckpointReader(tmp_path, read_model_spec(tmp_path))
    reader.validate()
    names = tensor_names(spec)
    stored: set[str] = set()
    for shard in tmp_path.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            stored |= set(handle.keys())
    layer = spec.moe_layers[0]
    assert {names.router_weight(layer), names.expert(layer, 0, "down"), names.shared(layer, "gate")} <= stored
    assert reader.router(0).weight.shape == (spec.num_experts, spec.hidden_size)


def test_the_families_differ_where_their_checkpoints_do() -> None:
    # DeepSeek-V3 names its shared experts `shared_experts`, Qwen-MoE `shared_expert` (+ its gate)
    assert tensor_names(TINY[DEEPSEEK]).shared(3, "up") == "model.layers.3.mlp.shared_experts.up_proj.weight"
    assert tensor_names(TINY[QWEN]).shared(3, "up") == "model.layers.3.mlp.shared_expert.up_proj.weight"
    assert tensor_names(TINY[QWEN]).shared_gate(3) == "model.layers.3.mlp.shared_expert_gate.weight"
    names = tensor_names(TINY[DEEPSEEK])
    assert names.is_projection(names.expert(1, 2, "gate")) and names.is_projection(names.shared(1, "down"))
    assert not names.is_projection(names.router_weight(1))


def test_qwen3_moe_is_read_as_the_qwen_family() -> None:
    raw = {**config_json_for(TINY[QWEN]), "model_type": "qwen3_moe"}
    del raw["norm_topk_prob"]  # Qwen3-MoE normalises top-k by default, Qwen2-MoE does not
    assert spec_from_config(raw).architecture == QWEN and spec_from_config(raw).norm_topk_prob


def test_an_unknown_model_type_is_refused_naming_every_family(tmp_path: Path) -> None:
    from vexpert_runtime.model.checkpoint import read_model_spec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(VExpertInputError) as caught:
        read_model_spec(tmp_path)
    for entry in FAMILIES.values():
        assert entry.title in caught.value.fix and all(t in caught.value.fix for t in entry.model_types)
    with pytest.raises(ValueError, match="not a model family"):
        family("llama")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_operator_sizes_each_family_from_its_reference_model(name: str) -> None:
    ref = family(name).reference
    dense = model_shape(deployment_spec(model__architecture=name))
    assert dense is not None
    assert (dense.num_experts, dense.num_moe_layers, dense.top_k) == (ref.num_experts, ref.num_moe_layers, ref.top_k)
    assert dense.expert_bytes == 3 * ref.intermediate_size * ref.hidden_size * 2  # bf16
    fp8 = model_shape(deployment_spec(model__architecture=name, model__expertFormat=FP8_BLOCK))
    assert fp8 is not None and dense.expert_bytes // 2 < fp8.expert_bytes < dense.expert_bytes
    assert model_shape(deployment_spec(model__architecture=AUTO)) is None
