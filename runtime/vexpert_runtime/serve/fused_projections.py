"""Projections that read the same input as one GEMM: fewer, larger matrix multiplies per decode step.

A decode step multiplies few rows by each weight, so a small GEMM is bound by its launch and its
split-K reduction more than by its bytes (one H200, 256 sequences, DeepSeek-V3 sizes: MLA's q_a
7168→1536 took 16 µs and kv_a 7168→576 12 µs for 22 and 8 MB — 1.4 and 0.7 TB/s; the shared expert's
gate and up 16 µs each; ``benchmarks/decode_step_bound.py --profile-ops``,
``results/serve_engine/decode_step_bound_run19.json``). As SGLang and vLLM do (``fused_qkv_a_proj_with_mqa``,
``MergedColumnParallelLinear``, ``QKVParallelLinear``), the step multiplies once by the
concatenated weights and splits the output:

* MLA (DeepSeek-V3): ``q_a_proj`` and ``kv_a_proj_with_mqa`` → ``attn.fused_a_proj``;
* GQA (Qwen): ``q_proj``, ``k_proj``, ``v_proj`` (with their biases, Qwen2) → ``attn.fused_qkv_proj``;
* SwiGLU MLPs (shared experts, dense layers): ``gate_proj`` and ``up_proj`` → :class:`GateUpMLP`.

Only plain ``nn.Linear`` modules are fused — a subclass (transformers' FP8 linear with its block scales,
a quantized or LoRA layer) computes more than ``x @ Wᵀ + b`` and is left as it is — and our own block-FP8
linears (:class:`~.fp8_linear.Fp8Linear`, ``--linear-format fp8_block``) where every one but the last fills whole
scale blocks (their weights and scales concatenate then: DeepSeek-V3's 1536-row ``q_a_proj`` before the 576-row
``kv_a_proj_with_mqa``, the shared experts' and dense MLPs' gate and up). Each output column is
the same dot product as before (only the GEMM's tiling may differ). The original
``Linear`` modules stay, their weights now views into the fused one (no second copy), so anything that
calls them still works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vexpert_runtime.serve.fp8_linear import Fp8Linear
from vexpert_runtime.serve.sparse_blocks import decoder_layers


def fuse_linears(linears: Sequence[nn.Module]) -> nn.Module:
    """One ``Linear`` whose output is the concatenation of ``linears``' outputs (same input width;
    all with a bias or none); each original's weight and bias become views into it. Block-FP8
    :class:`Fp8Linear` s fuse alike (:func:`fuse_fp8_linears`)."""
    if linears and all(type(layer) is Fp8Linear for layer in linears):
        return fuse_fp8_linears([layer for layer in linears if isinstance(layer, Fp8Linear)])
    return _fuse_plain_linears(linears)


def _fuse_plain_linears(modules: Sequence[nn.Module]) -> nn.Linear:
    linears = [layer for layer in modules if type(layer) is nn.Linear and isinstance(layer, nn.Linear)]
    if len(linears) != len(modules):
        raise ValueError(f"only plain nn.Linear fuses, got {sorted({type(layer).__name__ for layer in modules})}")
    widths = {layer.in_features for layer in linears}
    biased = {layer.bias is not None for layer in linears}
    if len(widths) != 1 or len(biased) != 1:
        raise ValueError(f"cannot fuse projections of input widths {sorted(widths)} / bias {sorted(biased)}")
    weight = torch.cat([layer.weight.detach() for layer in linears], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biased.pop(), device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in linears]), requires_grad=False)
    start = 0
    for layer in linears:
        end = start + layer.out_features
        layer.weight = nn.Parameter(fused.weight[start:end], requires_grad=False)
        if fused.bias is not None:
            layer.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
        start = end
    return fused


def fuse_fp8_linears(linears: Sequence[Fp8Linear]) -> Fp8Linear:
    """One :class:`Fp8Linear` whose output is the concatenation of ``linears``' outputs: fp8 weights and block
    scales concatenated along the output rows (every linear's rows but the last's must fill whole scale blocks — a
    partial block may only end the fused weight —, one block size, one input width, one activation scheme); each original's weight and
    scales become views into it."""
    if not _fp8_fusable(linears):
        raise ValueError("block-FP8 linears fuse when they share the input width, block size and activation scheme "
                         "and every one's rows but the last's fill whole blocks: got "
                         f"{[(m.out_features, m.in_features, m.block, m.fp8_activations) for m in linears]}")
    block = linears[0].block
    fused = Fp8Linear(torch.cat([m.weight for m in linears]), torch.cat([m.weight_scale_inv for m in linears]), block,
                      linears[0].fp8_activations)
    fused.compiled = linears[0].compiled
    start = 0
    for layer in linears:
        end = start + layer.out_features
        layer.weight = fused.weight[start:end]
        layer.weight_scale_inv = fused.weight_scale_inv[start // block[0]:-(-end // block[0])]
        start = end
    return fused


def _fp8_fusable(linears: Sequence[nn.Module]) -> bool:
    fp8 = [m for m in linears if type(m) is Fp8Linear]
    return (len(fp8) == len(linears) > 0 and len({(m.in_features, m.block, m.fp8_activations) for m in fp8}) == 1
            and all(m.out_features % m.block[0] == 0 for m in fp8[:-1]))


class GateUpMLP(nn.Module):
    """A SwiGLU MLP (``down(act(gate(x)) · up(x))``) with gate and up as one GEMM."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.intermediate = int(mlp.gate_proj.out_features)
        self.gate_up_proj = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _plain_linears(module: Any, names: tuple[str, ...]) -> bool:
    """Whether ``module``'s ``names`` are linears that fuse: all plain ``nn.Linear``, or all block-FP8 ones that
    concatenate (:func:`fuse_fp8_linears`)."""
    layers = [layer for name in names if isinstance(layer := getattr(module, name, None), nn.Module)]
    return len(layers) == len(names) and (all(type(layer) is nn.Linear for layer in layers) or _fp8_fusable(layers))


def _is_swiglu_mlp(module: Any) -> bool:
    return (_plain_linears(module, ("gate_proj", "up_proj")) and isinstance(getattr(module, "down_proj", None), nn.Module)
            and callable(getattr(module, "act_fn", None)))


def fuse_model_projections(model: Any) -> dict[str, int]:
    """Fuse every decoder layer's attention input projections and SwiGLU MLPs (shared experts, dense
    MLPs) in place; returns how many of each were fused."""
    counts = {"mla_a": 0, "gqa_qkv": 0, "mlp_gate_up": 0}
    for layer in decoder_layers(model):
        attn = layer.self_attn
        if _plain_linears(attn, ("q_a_proj", "kv_a_proj_with_mqa")):
            attn.fused_a_proj = fuse_linears([attn.q_a_proj, attn.kv_a_proj_with_mqa])
            counts["mla_a"] += 1
        elif _plain_linears(attn, ("q_proj", "k_proj", "v_proj")):
            attn.fused_qkv_proj = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            counts["gqa_qkv"] += 1
        mlp = layer.mlp
        if _is_swiglu_mlp(mlp):
            layer.mlp = GateUpMLP(mlp)
            counts["mlp_gate_up"] += 1
        for name in ("shared_experts", "shared_expert"):
            if _is_swiglu_mlp(getattr(mlp, name, None)):
                setattr(mlp, name, GateUpMLP(getattr(mlp, name)))
                counts["mlp_gate_up"] += 1
    return counts
