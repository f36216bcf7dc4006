"""The Triton grouped SwiGLU (``model/grouped_gemm_kernel.py``, issue #21) against the per-expert loop.

CPU: in Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``), on shapes that are not
multiples of the blocks, empty groups, a group longer than ``BLOCK_M`` (the loop over the expert's row
blocks inside a program, or several row tiles), both grids, strided weight views of packed rows and a slice of a larger output.
GPU (marker ``gpu``): at DeepSeek-V3's expert sizes in bf16, against ``torch._grouped_mm``.
"""

from __future__ import annotations

import pytest
import torch

from runtime_support import run_in_triton_interpreter


def check_kernel_on_cpu() -> None:
    from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, triton_swiglu
    from vexpert_runtime.model.grouped_moe import grouped_swiglu, packed_views

    torch.manual_seed(0)
    experts, intermediate, hidden = 4, 24, 40
    rows = torch.randn(experts, 3 * intermediate * hidden) / hidden**0.5
    w13, w2 = packed_views(rows, intermediate, hidden)
    offs = torch.tensor([5, 5, 37, 40], dtype=torch.int32)  # group 1 empty, group 2 longer than BLOCK_M = 16
    x = torch.randn(48, hidden)  # 8 rows past offs[-1]: not written
    want = grouped_swiglu(x, w13, w2, offs, grouped=False)
    # expert-major grids (row splits 1-3) and row-tile grids (split 0), blocks that do not divide the shapes
    for configs in (((16, 16, 16, 4, 2, 1), (16, 16, 32, 4, 2, 2)), ((32, 32, 64, 4, 2, 1), (16, 64, 16, 4, 2, 3)),
                    ((16, 16, 16, 4, 2, 0), (16, 32, 32, 4, 2, 0)), ((32, 16, 64, 4, 2, 0), (16, 16, 16, 4, 2, 1))):
        got = triton_swiglu(x, w13, w2, offs, configs=configs)
        assert torch.allclose(got[:40], want[:40], rtol=1e-4, atol=1e-4), configs
    # Into a slice of a larger buffer (the EP layer's resident rows): rows around it untouched.
    out = torch.full((60, hidden), 7.0)
    triton_swiglu(x, w13, w2, offs, configs=((16, 16, 16, 4, 2, 2),) * 2, out=out[10:58])
    assert torch.allclose(out[10:50], want[:40], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[:10], torch.full((10, hidden), 7.0)) and torch.equal(out[50:], torch.full((10, hidden), 7.0))
    # The plain GEMM (the down projection) alone, and a bad weight layout named.
    for config in ((16, 32, 16, 4, 2, 1), (16, 32, 16, 4, 2, 0)):
        plain = grouped_gemm(x, w13, offs, config=config)
        for e, (start, end) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True)):
            assert torch.allclose(plain[start:end], x[start:end] @ w13[e].T, rtol=1e-4, atol=1e-4), config
    try:
        grouped_gemm(x, w13.transpose(1, 2), offs)
    except ValueError as error:
        assert "unit stride along K" in str(error)
    else:
        raise AssertionError("a transposed weight view was accepted")


def check_fp8_kernel_on_cpu() -> None:
    """Block-FP8 rows read in place (fp8 weights, scales per K tile) equal the loop over their
    dequantised copy: partial scale blocks (I 24 and H 40 over 16×16 blocks), K tiles wider than a
    scale block (narrowed to it), both grids, a stack that is a slice of a larger buffer (slots)."""
    from vexpert_runtime.model.expert_format import ExpertFormat, quantize_fp8_block
    from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, triton_swiglu
    from vexpert_runtime.model.grouped_moe import grouped_swiglu

    torch.manual_seed(1)
    experts, intermediate, hidden, block = 4, 24, 40, (16, 16)
    fmt = ExpertFormat(intermediate, hidden, torch.float32, block)
    packed = []
    for _ in range(experts + 2):
        weights = {"gate": torch.randn(intermediate, hidden), "up": torch.randn(intermediate, hidden),
                   "down": torch.randn(hidden, intermediate)}
        quantised = {p: quantize_fp8_block(w / hidden**0.5, block) for p, w in weights.items()}
        packed.append(fmt.pack_fp8({p: q for p, (q, _) in quantised.items()}, {p: s for p, (_, s) in quantised.items()}))
    buffer = torch.stack(packed)
    rows = buffer[1:-1]  # a slice of a larger buffer, as a layer's slots are
    stack = fmt.fp8_stack(rows)
    assert stack is not None and stack.w13.data_ptr() == rows.data_ptr()  # views, no copy
    w13, w2 = fmt.stack_weights(rows)
    offs = torch.tensor([5, 5, 37, 40], dtype=torch.int32)
    x = torch.randn(48, hidden)
    want = grouped_swiglu(x, w13, w2, offs, grouped=False)
    for configs in (((16, 16, 16, 4, 2, 1), (16, 16, 16, 4, 2, 2)), ((16, 32, 64, 4, 2, 0), (16, 16, 32, 4, 2, 0))):
        got = triton_swiglu(x, stack.w13, stack.w2, offs, configs=configs, scales=(stack.s13, stack.s2),
                            scale_block=block)
        assert torch.allclose(got[:40], want[:40], rtol=1e-4, atol=1e-4), configs
    down = grouped_gemm(x[:, :intermediate].contiguous(), stack.w2, offs, config=(16, 16, 16, 4, 2, 0),
                        scales=stack.s2, scale_block=block)
    for e, (start, end) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True)):
        assert torch.allclose(down[start:end], x[start:end, :intermediate] @ w2[e].T, rtol=1e-4, atol=1e-4)
    try:
        grouped_gemm(x, stack.w13, offs, swiglu=True, scales=stack.s2, scale_block=block)
    except ValueError as error:
        assert "scales float32" in str(error)
    else:
        raise AssertionError("scales of the wrong shape were accepted")


def test_triton_grouped_swiglu_equals_the_loop_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_grouped_gemm_kernel", "check_kernel_on_cpu")


def test_triton_grouped_swiglu_reads_block_fp8_rows_in_place_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_grouped_gemm_kernel", "check_fp8_kernel_on_cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 256])
def test_triton_grouped_swiglu_matches_grouped_mm_at_deepseek_sizes(tokens: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    from vexpert_runtime.model.grouped_moe import GROUP_ALIGN, grouped_swiglu, packed_views

    torch.manual_seed(tokens)
    experts, intermediate, hidden = 8, 2048, 7168
    rows = torch.randn(experts, 3 * intermediate * hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w13, w2 = packed_views(rows, intermediate, hidden)
    counts = torch.multinomial(torch.tensor([8.0, 4, 2, 1, 1, 0.5, 0.5, 0.01]), 2 * tokens, replacement=True).bincount(
        minlength=experts)
    offs = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(int(offs[-1]) + 16, hidden, device="cuda", dtype=torch.bfloat16)
    want = grouped_swiglu(x, w13, w2, offs, gpu_kernel="cutlass").float()
    got = grouped_swiglu(x, w13, w2, offs).float()  # the default on CUDA: the Triton kernel
    used = int(offs[-1])
    assert (got[:used] - want[:used]).abs().max() <= 0.02 * want[:used].abs().max()
