"""Fused input projections (:mod:`vexpert_runtime.serve.fused_projections`) compute what the separate ones
did, on tiny random DeepSeek-V3 (MLA, dense first layer, shared expert), Qwen3-MoE (GQA) and Qwen2-MoE (GQA
with biases, sigmoid-gated shared expert), without a second copy of any weight."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vexpert_runtime.serve.attention_layers import gqa_inputs, mla_inputs  # noqa: E402
from vexpert_runtime.serve.fused_projections import GateUpMLP, fuse_linears, fuse_model_projections  # noqa: E402


def _model(family: str) -> Any:
    common = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts_per_tok": 2,
              "max_position_embeddings": 64, "initializer_range": 0.1, "tie_word_embeddings": False}
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
            n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=8)
    else:
        config = transformers.Qwen2MoeConfig(**common, num_key_value_heads=2, num_experts=8,
                                             shared_expert_intermediate_size=48)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for param in model.parameters():  # biases are zero at init: make them matter
        if param.dim() == 1:
            param.data.normal_(0, 0.1)
    return model


def _parameter_bytes(model: Any) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


EXPECTED = {"deepseek_v3": {"mla_a": 3, "gqa_qkv": 0, "mlp_gate_up": 3},  # dense layer 0 + 2 shared experts
            "qwen3_moe": {"mla_a": 0, "gqa_qkv": 3, "mlp_gate_up": 0},
            "qwen2_moe": {"mla_a": 0, "gqa_qkv": 3, "mlp_gate_up": 3}}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_fused_projections_compute_what_the_separate_ones_did(family: str) -> None:
    original = _model(family)
    fused = copy.deepcopy(original)
    before = _parameter_bytes(fused)
    assert fuse_model_projections(fused) == EXPECTED[family]
    assert _parameter_bytes(fused) == before  # the originals are views into the fused weights
    tokens = torch.randint(0, 96, (1, 11))
    x = torch.randn(11, 64)
    rope = 8 if family == "deepseek_v3" else 16
    cos, sin = torch.randn(11, rope), torch.randn(11, rope)
    with torch.no_grad():
        # the whole model (its MLPs now GateUpMLP; its attention still calls the original, now viewed, Linears)
        torch.testing.assert_close(fused(tokens).logits, original(tokens).logits, rtol=1e-5, atol=1e-5)
        for got_layer, want_layer in zip(fused.model.layers, original.model.layers, strict=True):
            inputs = mla_inputs if family == "deepseek_v3" else gqa_inputs
            for got, want in zip(inputs(got_layer.self_attn, x, cos, sin), inputs(want_layer.self_attn, x, cos, sin),
                                 strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fused_mlp_and_its_originals_share_storage() -> None:
    mlp = _model("deepseek_v3").model.layers[0].mlp
    gate_before = mlp.gate_proj.weight.detach().clone()
    fused = GateUpMLP(mlp)
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == fused.gate_up_proj.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(mlp.gate_proj.weight, gate_before, rtol=0, atol=0)
    with torch.no_grad():
        fused.gate_up_proj.weight[0, 0] = 42.0  # one tensor: a write through the fused weight is seen by the view
    assert mlp.gate_proj.weight[0, 0] == 42.0


def test_a_linear_subclass_is_left_alone() -> None:
    """e.g. transformers' FP8 linear: its weight is not the whole of what it multiplies by."""
    class ScaledLinear(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    model = _model("qwen3_moe")
    attn = model.model.layers[0].self_attn
    attn.k_proj = ScaledLinear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    counts = fuse_model_projections(model)
    assert counts["gqa_qkv"] == 2 and not hasattr(attn, "fused_qkv_proj")
    with pytest.raises(ValueError, match=r"plain nn\.Linear"):
        fuse_linears([attn.q_proj, attn.k_proj])


def test_projections_of_different_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="input widths"):
        fuse_linears([torch.nn.Linear(4, 3), torch.nn.Linear(5, 3)])
    with pytest.raises(ValueError, match="bias"):
        fuse_linears([torch.nn.Linear(4, 3), torch.nn.Linear(4, 3, bias=False)])
