"""The step model's sparse-block forward (:func:`vexpert_runtime.serve.sparse_blocks.sparse_block_output`)
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
    sparse_block_output,
)

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
            got = sparse_block_output(block, x)
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

