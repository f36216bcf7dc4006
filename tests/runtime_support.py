"""Shared fixtures of the node-runtime tests: the tiny DeepSeek-shaped MoE they all build."""

from __future__ import annotations

from vexpert_runtime.checkpoint import DEEPSEEK, MoESpec

# 2 MoE layers × 8 experts, group-limited top-2 routing, correction bias, a shared expert:
# every DeepSeek-V3 routing feature at a size the 2-core CI machine runs in milliseconds.
TINY_DEEPSEEK_SPEC = MoESpec(
    architecture=DEEPSEEK,
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    moe_layers=(1, 2),
    n_group=2,
    topk_group=2,
    routed_scaling_factor=1.5,
    correction_bias=True,
    shared_intermediate_size=16,
)
