"""The head of a step (:func:`~vexpert_runtime.serve.hf_model.step_inputs`): the fed token ids embedded and the rotary
embedding's cos / sin, written so that compiled they are two kernels — equal, bit for bit, to what transformers'
embedding and rotary modules compute, for DeepSeek-V3 (default and its release's YaRN rope), Qwen3-MoE and Qwen2-MoE;
the rope types whose frequencies change with the context go through the module itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_serve_model import _config  # noqa: E402
from vexpert_runtime.serve.hf_model import rotary_cos_sin, step_inputs  # noqa: E402

# DeepSeek-V3's release: YaRN from 4,096 to 163,840 positions (config.json's rope_scaling)
_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
# YaRN with its default attention factor (0.1 · ln(factor) + 1): a scaling the cos / sin carry
_YARN_SCALED = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}


def _rotary(family: str, rope: dict[str, Any] | None = None, positions: int = 128) -> Any:
    config = _config(family)
    config.max_position_embeddings = positions
    if rope is not None:
        config.rope_parameters = rope
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.model.rotary_emb


@pytest.mark.parametrize(("family", "rope"), [("deepseek_v3", None), ("deepseek_v3", _YARN), ("deepseek_v3", _YARN_SCALED),
                                              ("qwen3_moe", None), ("qwen2_moe", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cos_sin_is_the_modules_own_bit_for_bit(family: str, rope: dict[str, Any] | None,
                                                       dtype: torch.dtype) -> None:
    rotary = _rotary(family, rope, 163_840 if rope else 128)
    assert rotary.rope_type == (rope or {}).get("rope_type", "default")
    positions = torch.tensor([0, 1, 5, 77, 4095, 4096, 70_000, 163_839] if rope else [0, 1, 5, 77, 127])
    x = torch.zeros(len(positions), 4, dtype=dtype)
    want_cos, want_sin = rotary(x, positions.unsqueeze(0))
    cos, sin = rotary_cos_sin(rotary, x, positions)
    assert cos.dtype == sin.dtype == dtype and cos.shape == want_cos[0].shape
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    if rope is _YARN_SCALED:
        assert rotary.attention_scaling > 1.0  # the scaling is in the product


def test_a_dynamic_rope_goes_through_the_module() -> None:
    """Dynamic NTK changes its frequencies once a context passes the trained length: the module's own ``forward``
    (which updates them) runs, so the result is its result at every length."""
    rotary = _rotary("qwen3_moe", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, 64)
    calls = []
    rotary.register_forward_hook(lambda *args: calls.append(1))
    long = torch.arange(0, 200, 7)
    x = torch.zeros(len(long), 4)
    cos, sin = rotary_cos_sin(rotary, x, long)
    assert calls == [1]
    want_cos, want_sin = rotary(x, long.unsqueeze(0))
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def test_step_inputs_feed_the_previous_steps_ids_where_asked() -> None:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 6)
    rotary = _rotary("deepseek_v3")
    tokens = torch.tensor([3, 4, 5, 6])
    fed = torch.tensor([-1, 2, -1, 0])
    last = torch.tensor([11, 12, 13])
    positions = torch.tensor([9, 3, 0, 17])
    hidden, cos, sin = step_inputs(embed, rotary, tokens, fed, last, positions)
    assert torch.equal(hidden, embed(torch.tensor([3, 13, 5, 11])))
    want_cos, want_sin = rotary(hidden, positions.unsqueeze(0))
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert torch.equal(step_inputs(embed, rotary, tokens, None, last, positions)[0], embed(tokens))
