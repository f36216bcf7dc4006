"""The fused routers (``serve/fused_router.py`` + ``model/routing_kernel.py``) against transformers'
``DeepseekV3TopkRouter`` and Qwen's ``TopKRouter``, the references they stand in for on a GPU.

CI has no GPU: the selection kernel runs on CPU tensors in Triton's interpreter; that it compiles for an
H200 is ``test_kernel_compile.py``'s, and the serving model with fused routers giving ``generate``'s
tokens is ``test_attention_kernels.py``'s interpreter test. The tensor-core logits GEMM runs only on
CUDA (``test_serve_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from runtime_support import run_in_triton_interpreter
from vexpert_runtime.model.routing_kernel import deepseek_v3_select, supports

# (experts, groups, groups kept, top-k, normalise): the release's routing, 8 experts in groups,
# Kimi K2's (384 experts, one group), one without normalisation, every group kept
CASES = ((256, 8, 4, 8, True), (8, 4, 2, 2, True), (384, 1, 1, 8, True), (16, 2, 1, 3, False), (64, 8, 8, 6, True))


def _router(experts: int, groups: int, kept: int, top_k: int, normalise: bool, hidden: int = 48) -> DeepseekV3TopkRouter:
    config = transformers.DeepseekV3Config(n_routed_experts=experts, n_group=groups, topk_group=kept,
                                           num_experts_per_tok=top_k, hidden_size=hidden, norm_topk_prob=normalise,
                                           routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(0, 0.1)
    return router


def check_selection_on_cpu() -> None:
    """In the interpreter: for every case, the fused router's logits equal transformers' (the same fp32
    ``linear`` on CPU), and per token the same set of experts with the same weights, ids best first; with
    all logits equal (every choice tied) it still picks top-k distinct experts of the lowest kept groups."""
    from vexpert_runtime.serve.fused_router import FusedDeepseekV3Router

    torch.manual_seed(0)
    for case in CASES:
        experts, groups, kept, top_k, normalise = case
        router = _router(*case)
        fused = FusedDeepseekV3Router(router)
        x = torch.randn(37, 48)
        want_logits, want_weights, want_ids = router(x)
        logits, weights, ids = fused(x)
        assert torch.equal(logits, want_logits), case
        order, want_order = ids.argsort(1), want_ids.argsort(1)
        assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order)), case
        torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=1e-6, atol=1e-7)
        choice = (logits.sigmoid() + router.e_score_correction_bias).gather(1, ids)
        assert (choice[:, :-1] >= choice[:, 1:]).all(), case  # best first
        router.weight.data.zero_()
        router.e_score_correction_bias.zero_()
        _, weights, ids = fused(x)
        assert all(len(set(row)) == top_k for row in ids.tolist()), case
        per_group = experts // groups
        if groups > 1 and kept < groups:
            assert (ids < kept * per_group).all(), case  # ties: the lowest groups, the lowest experts
        expected = 2.5 / top_k if normalise else 2.5 * 0.5
        torch.testing.assert_close(weights, torch.full_like(weights, expected))


def check_softmax_selection_on_cpu() -> None:
    """In the interpreter: Qwen3-MoE's and Qwen2-MoE's routers (softmax top-k, renormalised or not) in
    fp32 and bf16 — the same logits (the same ``linear``), per token the same experts, the same weights in
    the logits' dtype."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from vexpert_runtime.serve.fused_router import FusedSoftmaxRouter, stand_in_for

    torch.manual_seed(2)
    for cls, config_cls, experts, top_k, normalise in (
            (Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig, 128, 8, True),
            (Qwen2MoeTopKRouter, transformers.Qwen2MoeConfig, 60, 4, False),
            (Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig, 8, 2, False)):
        config = config_cls(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=normalise, hidden_size=48)
        for dtype in (torch.float32, torch.bfloat16):
            router = cls(config).to(dtype)
            torch.nn.init.normal_(router.weight, std=0.5)
            stand_in = stand_in_for(router)
            assert isinstance(stand_in, FusedSoftmaxRouter)
            x = torch.randn(37, 48).to(dtype)
            want_logits, want_weights, want_ids = router(x)
            logits, weights, ids = stand_in(x)
            assert torch.equal(logits, want_logits) and weights.dtype == want_weights.dtype == dtype
            tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
            torch.testing.assert_close(weights.sort(1).values, want_weights.sort(1).values, **tolerance)
            # bf16 logits tie often (8-bit mantissas): where the k-th and (k+1)-th probabilities are equal either
            # expert is a top-k (torch.topk picks either; the kernel the lower index) — elsewhere the same experts
            probs = logits.float().softmax(-1).sort(1, descending=True).values
            decided = probs[:, top_k - 1] > probs[:, top_k]
            assert decided.float().mean() > 0.5, (cls, dtype)
            assert torch.equal(ids[decided].sort(1).values, want_ids[decided].sort(1).values), (cls, dtype)
            chosen = logits.float().softmax(-1).gather(1, ids).sort(1, descending=True).values
            assert torch.equal(chosen, probs[:, :top_k]), (cls, dtype)  # every row: a top-k set


def test_selection_kernel_equals_transformers_router_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_fused_router", "check_selection_on_cpu")


def test_softmax_selection_equals_qwen_routers_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_fused_router", "check_softmax_selection_on_cpu")


def test_supports_what_the_kernel_can_select() -> None:
    assert all(supports(e, g, k, top) for e, g, k, top, _ in CASES)
    assert not supports(384, 8, 4, 8)  # groups need a power-of-two expert count (a reshape in registers)
    assert not supports(8, 4, 1, 3)  # top-3 from one kept group of 2
    assert not supports(8, 3, 1, 2)  # 8 experts do not split into 3 groups
    assert not supports(8, 1, 1, 9)
    assert supports(6, 1, 1, 2)  # no groups: any count
    with pytest.raises(ValueError, match="384 experts in 8 groups"):
        deepseek_v3_select(torch.zeros(2, 384), None, 8, 8, 4, 1.0, True)


def test_fuse_model_routers_keeps_the_parameters_and_skips_what_it_cannot_select() -> None:
    """Every MoE layer's router swapped (DeepSeek-V3's, Qwen3-MoE's), the state dict unchanged (same names,
    same tensors); a model whose routing the kernel cannot take (6 experts in 2 groups) keeps transformers'
    routers."""
    pytest.importorskip("triton")
    from test_serve_model import _config
    from vexpert_runtime.serve.fused_router import FusedDeepseekV3Router, fuse_model_routers

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(_config("deepseek_v3"))
    before = model.state_dict()
    assert fuse_model_routers(model) == 2  # layers 1 and 2 (layer 0 is dense)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[name].data_ptr() == before[name].data_ptr() for name in before)
    assert all(isinstance(layer.mlp.gate, FusedDeepseekV3Router) for layer in model.model.layers[1:])
    qwen = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe"))
    assert fuse_model_routers(qwen) == 3
    assert all(type(layer.mlp.gate).__name__ == "FusedSoftmaxRouter" for layer in qwen.model.layers)
    config = _config("deepseek_v3")
    config.n_routed_experts = 6
    odd = transformers.AutoModelForCausalLM.from_config(config)
    assert fuse_model_routers(odd) == 0
    assert all(type(layer.mlp.gate) is DeepseekV3TopkRouter for layer in odd.model.layers[1:])
