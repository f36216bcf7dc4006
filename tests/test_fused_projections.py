"""Fused input projections (:mod:`vexpert_runtime.serve.fused_projections`) compute what the separate ones
did, on tiny random DeepSeek-V3 (MLA, dense first layer, shared expert), Qwen3-MoE (GQA) and Qwen2-MoE (GQA
with biases, sigmoid-gated shared expert), without a second copy of any weight."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from serve_support import tiny_random_model  # noqa: E402
from vexpert_runtime.serve.attention_layers import gqa_inputs, mla_inputs  # noqa: E402
from vexpert_runtime.serve.fused_projections import GateUpMLP, fuse_linears, fuse_model_projections  # noqa: E402


def _parameter_bytes(model: Any) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


EXPECTED = {"deepseek_v3": {"mla_a": 3, "gqa_qkv": 0, "mlp_gate_up": 3},  # dense layer 0 + 2 shared experts
            "qwen3_moe": {"mla_a": 0, "gqa_qkv": 3, "mlp_gate_up": 0},
            "qwen2_moe": {"mla_a": 0, "gqa_qkv": 3, "mlp_gate_up": 3}}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_fused_projections_compute_what_the_separate_ones_did(family: str) -> None:
    original = tiny_random_model(family)
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
    mlp = tiny_random_model("deepseek_v3").model.layers[0].mlp
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

    model = tiny_random_model("qwen3_moe")
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


def test_block_fp8_linears_fuse_where_their_rows_fill_whole_blocks() -> None:
    """``--linear-format fp8_block``: a tiny DeepSeek-V3 whose linears are block-FP8 (16 × 16): the SwiGLU MLPs' gate
    and up fuse (fp8 weights and scales concatenated, the originals views into them), and so do MLA's a-projections
    — kv_a's 40 rows end in a partial block, as DeepSeek-V3's 576 do, which only the last linear may —, and the model
    computes what it did."""
    from torch import nn

    from vexpert_runtime.model.expert_format import quantize_fp8_block
    from vexpert_runtime.serve.fp8_linear import Fp8Linear, converts_to_fp8

    original = tiny_random_model("deepseek_v3")
    for name, module in list(original.named_modules()):
        if isinstance(module, nn.Linear) and converts_to_fp8(module, name) and name != "lm_head":
            parent, _, attr = name.rpartition(".")
            setattr(original.get_submodule(parent), attr,
                    Fp8Linear(*quantize_fp8_block(module.weight.detach(), (16, 16)), (16, 16)))
    attn = original.model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.out_features % 16 and attn.q_a_proj.out_features % 16 == 0
    fused = copy.deepcopy(original)
    assert fuse_model_projections(fused) == {"mla_a": 3, "gqa_qkv": 0, "mlp_gate_up": 3}
    fused_attn = fused.model.layers[0].self_attn
    assert isinstance(fused_attn.fused_a_proj, Fp8Linear) and fused_attn.fused_a_proj.weight_scale_inv.shape[0] == \
        -(-(attn.q_a_proj.out_features + attn.kv_a_proj_with_mqa.out_features) // 16)
    assert fused_attn.kv_a_proj_with_mqa.weight.untyped_storage().data_ptr() == \
        fused_attn.fused_a_proj.weight.untyped_storage().data_ptr()  # a view into the fused weight, no second copy
    x = torch.randn(5, attn.q_a_proj.in_features)
    torch.testing.assert_close(fused_attn.kv_a_proj_with_mqa(x), attn.kv_a_proj_with_mqa(x), rtol=0, atol=0)
    mlp = fused.model.layers[0].mlp
    assert isinstance(mlp, GateUpMLP) and isinstance(mlp.gate_up_proj, Fp8Linear)
    gate = fused.model.layers[0].mlp.gate_up_proj.weight
    assert original.model.layers[0].mlp.gate_proj.weight.shape[0] * 2 == gate.shape[0]
    tokens = torch.randint(0, 96, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens).logits, original(tokens).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole blocks"):  # a partial block in the middle of the fused rows
        fuse_linears([attn.kv_a_proj_with_mqa, attn.q_a_proj])
    # one activation scheme per fused linear: W8A8 linears fuse into a W8A8 one, never with a W8A16 one
    gate, up = (Fp8Linear(m.weight, m.weight_scale_inv, m.block, fp8_activations=True)
                for m in (original.model.layers[0].mlp.gate_proj, original.model.layers[0].mlp.up_proj))
    assert fuse_linears([gate, up]).fp8_activations
    with pytest.raises(ValueError, match="activation scheme"):
        fuse_linears([gate, original.model.layers[0].mlp.up_proj])
