"""An MLA layer's output projection (:func:`~vexpert_runtime.serve.attention_layers.mla_output`): W_UV's batched
GEMM writes o_proj's [T, nh, dv] layout directly (a strided ``out=``); the result equals the absorbed formula
o_proj(Σ_c out_latent[t, n, c] · W_UV[n, v, c]) as an einsum computes it, on the CPU and (marker ``gpu``) on
cuBLAS at DeepSeek-V3's head sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vexpert_runtime.serve.attention_layers import mla_output


def _attention(heads: int, dn: int, dv: int, latent: int, hidden: int, device: str, dtype: torch.dtype
               ) -> SimpleNamespace:
    kv_b = torch.nn.Linear(latent, heads * (dn + dv), bias=False, device=device, dtype=dtype)
    o_proj = torch.nn.Linear(heads * dv, hidden, bias=False, device=device, dtype=dtype)
    return SimpleNamespace(qk_nope_head_dim=dn, v_head_dim=dv, num_heads=heads, kv_lora_rank=latent,
                           kv_b_proj=kv_b, o_proj=o_proj)


def _einsum_reference(attn: SimpleNamespace, out_latent: torch.Tensor) -> torch.Tensor:
    dn, dv = attn.qk_nope_head_dim, attn.v_head_dim
    w_uv = attn.kv_b_proj.weight.view(attn.num_heads, dn + dv, attn.kv_lora_rank)[:, dn:]
    return attn.o_proj(torch.einsum("tnc,nvc->tnv", out_latent, w_uv).flatten(1))


def _check(tokens: int, heads: int, dn: int, dv: int, latent: int, hidden: int, device: str,
           dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    attn = _attention(heads, dn, dv, latent, hidden, device, dtype)
    out_latent = torch.randn(tokens, heads, latent, device=device, dtype=dtype)
    with torch.no_grad():
        got = mla_output(attn, out_latent)
        want = _einsum_reference(attn, out_latent)
        # a transposed view of the latent output (the torch twin's layout may differ from the kernel's)
        strided = mla_output(attn, out_latent.transpose(0, 1).contiguous().transpose(0, 1))
    assert got.shape == (tokens, hidden)
    tolerance = 0 if dtype == torch.float32 and device == "cpu" else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(strided, got, rtol=tolerance, atol=tolerance)  # cuBLAS may pick another kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 11])
def test_mla_output_equals_the_absorbed_einsum(tokens: int, dtype: torch.dtype) -> None:
    _check(tokens, heads=4, dn=8, dv=6, latent=16, hidden=24, device="cpu", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_mla_output_equals_the_absorbed_einsum_on_the_gpu(tokens: int) -> None:
    """DeepSeek-V3's sizes (128 heads, dn = dv = 128, latent 512, hidden 7168), bf16 on cuBLAS."""
    _check(tokens, heads=128, dn=128, dv=128, latent=512, hidden=7168, device="cuda", dtype=torch.bfloat16)
