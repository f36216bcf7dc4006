"""The step model's sparse-block forward (:func:`vexpert_runtime.serve.sparse_blocks.sparse_block_parts`, summed)
computes transformers' own block forward — routed experts plus the shared expert (DeepSeek-V3), the sigmoid-
gated shared expert (Qwen2-MoE), none (Qwen3-MoE) — bit for bit, in the same order of summation; on a GPU
its shared expert may run on a side stream (tests/test_serve_gpu.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from serve_support import tiny_random_model
from vexpert_runtime.serve.sparse_blocks import (
    is_sparse_block,
    shared_expert,
    shared_expert_output,
    sparse_block_parts,
)


def block_output(block: object, x: torch.Tensor) -> torch.Tensor:
    """The block's routed + shared experts' outputs summed in transformers' order, as the step's residual add sums
    them."""
    routed, shared = sparse_block_parts(block, x)
    return routed if shared is None else routed + shared

SHARED = {"deepseek_v3": ("DeepseekV3MLP", None), "qwen2_moe": ("Qwen2MoeMLP", "Linear"), "qwen3_moe": (None, None)}


@pytest.mark.parametrize("family", list(SHARED))
def test_the_sparse_block_output_is_transformers_block_forward(family: str) -> None:
    model = tiny_random_model(family)
    blocks = [layer.mlp for layer in model.model.layers if is_sparse_block(layer.mlp)]
    assert blocks
    torch.manual_seed(3)
    for block in blocks:
        x = torch.randn(13, model.config.hidden_size)
        with torch.no_grad():
            expected = block(x.unsqueeze(0)).reshape(x.shape)
            got = block_output(block, x)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        module, gate = shared_expert(block)
        assert (type(module).__name__ if module is not None else None,
                type(gate).__name__ if gate is not None else None) == SHARED[family]
        shared = shared_expert_output(block, x)
        assert (shared is None) == (module is None)
        if shared is not None:  # the shared expert's share is not zero: dropping it would change the output
            assert shared.abs().max() > 1e-3
            with torch.no_grad():
                _, weights, ids = block.gate(x)
                routed_only = block.experts(x, ids, weights)
            assert not torch.allclose(routed_only, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_the_residual_add_of_a_blocks_parts_is_the_add_of_its_output(family: str, dtype: torch.dtype) -> None:
    """The step model hands a sparse block's routed and shared outputs to its residual add (add_and_norm), which
    sums them first: the residual stream and the next norm are the ones the block's output gives, bit for bit in
    bf16 too (the block's own rounding kept), eager and compiled."""
    import shutil

    from vexpert_runtime.model import fusion
    from vexpert_runtime.serve.hf_model import add_and_norm

    model = tiny_random_model(family).to(dtype)
    block = next(layer.mlp for layer in model.model.layers if is_sparse_block(layer.mlp))
    norm = model.model.layers[1].input_layernorm
    torch.manual_seed(4)
    x, hidden = torch.randn(2, 9, model.config.hidden_size, dtype=dtype).unbind()
    compiles = shutil.which("g++") is not None or shutil.which("c++") is not None  # inductor's CPU backend
    with torch.no_grad():
        output, parts = block_output(block, x), sparse_block_parts(block, x)
        assert (parts[1] is None) == (family == "qwen3_moe")
        for fused in (False, True) if compiles else (False,):  # (a compiled norm may sum in another order: each
            residual_norm = fusion.maybe_compiled(add_and_norm, fused)  # form against itself)
            got, want = residual_norm(norm, hidden, *parts), residual_norm(norm, hidden, output)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)

