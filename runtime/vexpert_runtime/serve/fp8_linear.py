"""Block-FP8 linear layers kept as stored (``model.linear_format: fp8_block``): half the HBM of bf16 weights.

A block-FP8 checkpoint (DeepSeek-V3's, Kimi-K2's) stores every projection as F8_E4M3 with F32 ``weight_scale_inv``
blocks. By default a serving rank dequantises the non-expert ones at load (attention, shared experts, dense
MLPs: 14.1 B parameters of DeepSeek-V3, 28.3 GB in bf16 on *every* rank, since attention is not sharded); kept
FP8 they take 14.1 GB, and the KV cache gets the difference (``benchmarks/nonexpert_bytes.py``).
:class:`Fp8Linear` replaces such an ``nn.Linear``: its weight stays fp8 with its scales, and the product runs as
:func:`fp8_linear` — on a GPU the expert GEMM's Triton kernel over one "expert"
(:func:`~vexpert_runtime.model.grouped_gemm_kernel.grouped_gemm`: fp8 weights widened in the kernel, W8A16, no
dequantised copy), elsewhere a dequantised copy per call (slow: the default, ``dense``, dequantises them once at
load on every device). Under ``model.expert_compute: w8a8`` (one activation scheme for the model's FP8 GEMMs, as
DeepSeek-V3's ``activation_scheme: dynamic`` and vLLM's block-FP8 linears have it) the input is quantised per token
and block column first and the kernel multiplies FP8 by FP8 (W8A8); CPU ranks emulate it with the same
quantisation. Where torch's own block-scaled FP8 GEMM runs (cuBLAS on Hopper, :func:`cublas_block_scaling_runs`), a
W8A8 linear with DeepSeek-V3's 128 x 128 blocks at a multiple of 16 rows takes it instead of the Triton kernel.
:func:`fp8_linear` is a torch custom op, so ``torch.compile``'d pieces that call a projection see one opaque node and
CUDA graphs capture its kernel. On an H100 (benchmarks/README.md §10, run 27) the Triton kernel is slower than
cuBLAS's bf16 GEMMs at DeepSeek-V3's attention shapes; torch's block-scaled GEMM is faster than both at 256 rows but
for the fused q_a + kv_a (run 33: o_proj 0.056 against bf16's 0.088 ms).

Not converted: linears with a bias (none in DeepSeek-V3's FP8 release) and MLA's ``kv_b_proj``, whose weight the
decode absorbs into the query and the output (:mod:`.attention_layers` reads it as a matrix).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from vexpert_runtime.model import fusion
from vexpert_runtime.model.expert_format import dequantize_fp8_block
from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip, quantize_activation_groups
from vexpert_runtime.model.grouped_moe import triton_experts_run

# Linears whose weight is read as a matrix elsewhere (MLA's absorbed up-projection): they stay dequantised.
KEPT_DENSE = ("kv_b_proj",)


# torch's own block-scaled FP8 GEMM (``torch._scaled_mm``, cuBLAS's block scaling on Hopper) takes DeepSeek-V3's
# layout only: activation scales per row and 128 columns, weight scales per 128 x 128 block.
_CUBLAS_BLOCK = (128, 128)
# Row counts it takes: multiples of 16 (graph buckets from 16 up; 37 rows failed on an H100 — the Triton kernel takes
# the others: small buckets, prompt chunks)
_CUBLAS_ROWS = 16


@functools.cache
def cublas_block_scaling_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies FP8 by FP8 with 1 x 128 activation and 128 x 128 weight scales into
    ``dtype`` on ``device`` (CUDA torch builds with cuBLAS block scaling on the GPU: an H100 with torch 2.11; not on
    CPU). Asked once per (device, dtype), eagerly: when the serving model loads (:class:`~.hf_model.HFStepModel`), else
    at a W8A8 linear's first call — never first inside a graph capture."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones((16, 128), device=device).to(torch.float8_e4m3fn)
        b = torch.ones((128, 128), device=device).to(torch.float8_e4m3fn)
        scale_a = torch.ones((1, 16), device=device).t()  # [M, K/128], outer-dimension-major
        scale_b = torch.ones((1, 1), device=device)
        out = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)
        return bool(torch.allclose(out.float(), torch.full_like(out.float(), 128.0)))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def quantize_for_block_scaled_mm(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~vexpert_runtime.model.fp8_activations.quantize_activation_groups` with the scales laid out as
    ``torch._scaled_mm``'s block scaling reads them: [M, ⌈K/group⌉] with the rows adjacent (stride (1, M))."""
    quantised, scales = quantize_activation_groups(x, group)
    return quantised, scales.t().contiguous().t()


@torch.library.custom_op("vexpert::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int,
               block_k: int, fp8_activations: bool = False, compiled: bool = False) -> torch.Tensor:
    """x [M, K] (compute dtype) times the block-FP8 weight [N, K]ᵀ (``scale_inv`` [⌈N/block_n⌉, ⌈K/block_k⌉]
    float32) → [M, N] in x's dtype; ``fp8_activations`` (W8A8): x quantised per row and ``block_k`` columns first
    (:func:`~vexpert_runtime.model.fp8_activations.quantize_activation_groups`; ``compiled``: by inductor, one kernel
    instead of several — the op is opaque to the step's compiled pieces, so it compiles its own)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if triton_experts_run(x):
        from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, launch_config

        if fp8_activations and (block_n, block_k) == _CUBLAS_BLOCK and x.shape[1] % block_k == 0 \
                and x.shape[0] > 0 and x.shape[0] % _CUBLAS_ROWS == 0 and cublas_block_scaling_runs(x.device, x.dtype):
            # W8A8 on cuBLAS's FP8 tensor-core GEMM with block scales (an H100 at 256 rows: o_proj 0.056 ms against
            # bf16's 0.088 and this package's Triton kernel's 0.136; benchmarks/scaled_mm_blockwise.py)
            quantised, x_scales = fusion.maybe_compiled(quantize_for_block_scaled_mm, compiled)(x, block_k)
            return torch._scaled_mm(quantised, weight.t(), scale_a=x_scales, scale_b=scale_inv.t(), out_dtype=x.dtype)
        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        config = launch_config("linear", x.shape[0], fp8=True, a8=fp8_activations)  # the linear layers' own table
        if fp8_activations:
            quantised, x_scales = fusion.maybe_compiled(quantize_activation_groups, compiled)(x, block_k)
            return grouped_gemm(quantised, weight.unsqueeze(0), offs, config=config, scales=scale_inv.unsqueeze(0),
                                scale_block=(block_n, block_k), x_scales=x_scales, out_dtype=x.dtype)
        return grouped_gemm(x, weight.unsqueeze(0), offs, config=config, scales=scale_inv.unsqueeze(0),
                            scale_block=(block_n, block_k))
    if fp8_activations:
        x = fp8_activation_round_trip(x, block_k)
    return F.linear(x, dequantize_fp8_block(weight, scale_inv, (block_n, block_k), x.dtype))


@fp8_linear.register_fake
def _fp8_linear_shape(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int,
                      block_k: int, fp8_activations: bool = False, compiled: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Fp8Linear(nn.Module):
    """``y = x @ Wᵀ`` with W kept block-FP8: ``weight`` [N, K] float8_e4m3fn and ``weight_scale_inv`` (buffers,
    the checkpoint's names) of ``block`` (rows, columns) tiles; against FP8 activations where ``fp8_activations``."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
                 fp8_activations: bool = False) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight_scale_inv.dtype != torch.float32:
            raise ValueError(f"Fp8Linear wants a float8_e4m3fn [N, K] weight and float32 scales, got {weight.dtype} "
                             f"{list(weight.shape)} and {weight_scale_inv.dtype}")
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.block = block
        self.fp8_activations = fp8_activations
        self.compiled = False  # W8A8's quantisation compiled (set with the step's compiled pieces)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = fp8_linear(flat, self.weight, self.weight_scale_inv, self.block[0], self.block[1], self.fp8_activations,
                         self.compiled)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype`` (what a load-time dequantisation would have kept)."""
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"{'w8a8' if self.fp8_activations else 'w8a16'}")


def converts_to_fp8(module: nn.Module, name: str) -> bool:
    """Whether the linear ``module`` (at ``name`` in the model) is kept block-FP8 under ``linear_format: fp8_block``."""
    return type(module) is nn.Linear and module.bias is None and not name.endswith(KEPT_DENSE)
