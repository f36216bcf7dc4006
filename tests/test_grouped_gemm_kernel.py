"""The Triton grouped SwiGLU (``model/grouped_gemm_kernel.py``, issue #21) against the per-expert loop.

CPU: in Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``), on shapes that are not
multiples of the blocks, empty groups, a group longer than ``BLOCK_M`` (the loop over the expert's row
blocks inside a program, or several row tiles), both grids, strided weight views of packed rows and a slice of a larger output.
GPU (marker ``gpu``): at DeepSeek-V3's expert sizes in bf16, against ``torch._grouped_mm``.
"""

from __future__ import annotations

from typing import Any

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
    # The rows read in place (a single-GPU EP layer): row m of the grouped order is token row_src[m] of 20 tokens
    # (a token in several groups, padding rows naming token 0), both grids — bit for bit the copied rows' result.
    tokens = torch.randn(20, hidden)
    row_src = torch.randint(0, 20, (48,), generator=torch.Generator().manual_seed(5))
    for configs in (((16, 16, 16, 4, 2, 1), (16, 16, 32, 4, 2, 2)), ((16, 16, 16, 4, 2, 0), (16, 32, 32, 4, 2, 0))):
        copied = triton_swiglu(tokens[row_src], w13, w2, offs, configs=configs)
        assert torch.equal(triton_swiglu(tokens, w13, w2, offs, configs=configs, row_src=row_src)[:40], copied[:40])
    try:
        grouped_gemm(tokens, w13, offs, row_src=row_src.to(torch.int32))
    except ValueError as error:
        assert "row_src" in str(error)
    else:
        raise AssertionError("int32 row_src was accepted")
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


def random_fp8_rows(fmt: Any, count: int) -> torch.Tensor:
    """``count`` packed block-FP8 rows [count, D] of ``fmt`` (an ExpertFormat) with random weights."""
    from vexpert_runtime.model.expert_format import quantize_fp8_block

    rows = []
    for _ in range(count):
        shapes = {"gate": (fmt.intermediate, fmt.hidden), "up": (fmt.intermediate, fmt.hidden),
                  "down": (fmt.hidden, fmt.intermediate)}
        quantised = {p: quantize_fp8_block(torch.randn(*shape) / fmt.hidden**0.5, fmt.fp8_block)
                     for p, shape in shapes.items()}
        rows.append(fmt.pack_fp8({p: q for p, (q, _) in quantised.items()}, {p: s for p, (_, s) in quantised.items()}))
    return torch.stack(rows)


def check_w8a8_kernel_on_cpu() -> None:
    """W8A8: FP8 activations (quantised per row and 32-wide group ahead of each GEMM) against block-FP8 rows
    equal, to float32 rounding, the twin that quantises alike and multiplies dequantised weights one expert at a
    time (the CPU ranks' path) — and both differ from W8A16 by e4m3's error only. Partial scale blocks (I 48, H 80
    over 32×32), the one-scale and per-column paths, both grids, a slot-like slice, misuse named."""
    from vexpert_runtime.model.expert_format import ExpertFormat, w8a8_swiglu
    from vexpert_runtime.model.fp8_activations import (
        fp8_activation_round_trip,
        quantize_activation_groups,
        quantized_wire_rows,
        unpack_wire_rows,
    )
    from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, triton_swiglu
    from vexpert_runtime.model.grouped_moe import grouped_swiglu

    torch.manual_seed(3)
    experts, intermediate, hidden, block = 4, 48, 80, (32, 32)
    fmt = ExpertFormat(intermediate, hidden, torch.float32, block)
    rows = random_fp8_rows(fmt, experts + 1)[1:]  # a slice of a larger buffer, as a layer's slots are
    stack = fmt.fp8_stack(rows)
    assert stack is not None
    w13, w2 = fmt.stack_weights(rows)
    offs = torch.tensor([5, 5, 37, 40], dtype=torch.int32)
    x = torch.randn(48, hidden)
    twin = w8a8_swiglu(x, w13, w2, offs, block[1])
    w8a16 = grouped_swiglu(x, w13, w2, offs, grouped=False)
    assert 1e-3 < (twin[:40] - w8a16[:40]).norm() / w8a16[:40].norm() < 0.1  # e4m3 activations: 3 mantissa bits
    # one scale per K tile (BLOCK_N divides 32) on the expert-major grid; per-column scales (BLOCK_N 64, K tiles
    # of 64 narrowed to 32) on the row-tile grid
    for configs in (((16, 16, 32, 4, 2, 1), (16, 32, 32, 4, 2, 2)), ((16, 64, 64, 4, 2, 0), (16, 16, 32, 4, 2, 0))):
        got = triton_swiglu(x, stack.w13, stack.w2, offs, configs=configs, scales=(stack.s13, stack.s2),
                            scale_block=block, fp8_activations=True)
        assert torch.allclose(got[:40], twin[:40], rtol=1e-4, atol=1e-4), configs
        # the dispatch's wire rows (quantised before the all-to-all): the same numbers through strided views
        quantised, x_scales = unpack_wire_rows(quantized_wire_rows(x, block[1]), hidden)
        wired = triton_swiglu(quantised, stack.w13, stack.w2, offs, configs=configs, scales=(stack.s13, stack.s2),
                              scale_block=block, fp8_activations=True, x_scales=x_scales, out=torch.empty_like(x))
        assert torch.equal(wired[:40], got[:40]), configs
        # ... read in place by row (a single-GPU EP layer): the tokens' wire rows, 48 buffer rows over 20 tokens
        tokens = x[:20]
        row_src = torch.cat([torch.arange(20), torch.arange(20), torch.arange(8)]).roll(3)
        quantised, x_scales = unpack_wire_rows(quantized_wire_rows(tokens, block[1]), hidden)
        gathered = triton_swiglu(quantised, stack.w13, stack.w2, offs, configs=configs, scales=(stack.s13, stack.s2),
                                 scale_block=block, fp8_activations=True, x_scales=x_scales,
                                 out=torch.empty_like(x), row_src=row_src)
        copied = triton_swiglu(tokens[row_src], stack.w13, stack.w2, offs, configs=configs,
                               scales=(stack.s13, stack.s2), scale_block=block, fp8_activations=True)
        assert torch.equal(gathered[:40], copied[:40]), configs
    # the down GEMM alone, into a slice of a larger output (rows around it untouched)
    act = torch.randn(48, intermediate)
    aq, scales = quantize_activation_groups(act, block[1])
    assert aq.dtype == torch.float8_e4m3fn and scales.shape == (48, 2)  # 48 columns: one whole group, one partial
    assert aq[:, :32].float().abs().amax(1).eq(448).all()  # each group's largest element maps to e4m3's largest
    out = torch.full((52, hidden), 7.0)
    grouped_gemm(aq, stack.w2, offs, config=(16, 32, 32, 4, 2, 0), scales=stack.s2, scale_block=block,
                 x_scales=scales, out=out[2:50])
    act_used = fp8_activation_round_trip(act, block[1])
    for e, (start, end) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True)):
        want = act_used[start:end].double() @ w2[e].double().T
        assert torch.allclose(out[2 + start:2 + end].double(), want, rtol=1e-4, atol=1e-4), e
    assert out[:2].eq(7.0).all() and out[50:].eq(7.0).all()
    for bad, named in (({"x_scales": None}, "x_scales"), ({"x_scales": scales[:, :1].contiguous()}, "x_scales float32")):
        try:
            grouped_gemm(aq, stack.w2, offs, scales=stack.s2, scale_block=block, out_dtype=torch.float32,
                         **{"x_scales": scales, **bad})
        except ValueError as error:
            assert named in str(error), error
        else:
            raise AssertionError(f"{bad} was accepted")
    narrow = ExpertFormat(intermediate, hidden, torch.float32, (16, 16))
    narrow_stack = narrow.fp8_stack(random_fp8_rows(narrow, experts))
    assert narrow_stack is not None
    try:
        triton_swiglu(x, narrow_stack.w13, narrow_stack.w2, offs, scales=(narrow_stack.s13, narrow_stack.s2),
                      scale_block=(16, 16), fp8_activations=True)
    except ValueError as error:
        assert "32 (FP8 dots, W8A8)" in str(error), error
    else:
        raise AssertionError("16-column blocks were accepted for FP8 dots")


def check_fp8_linear_on_cpu() -> None:
    """The GPU branch of ``vexpert::fp8_linear`` (a block-FP8 linear kept as stored: the grouped GEMM over one
    "expert") equals the product with the dequantised weight: partial blocks, row counts below, at and past a tile,
    a strided input, through ``Fp8Linear`` and ``torch.compile`` (the op is one opaque node)."""
    import vexpert_runtime.serve.fp8_linear as fp8_linear_module
    from vexpert_runtime.model.expert_format import quantize_fp8_block
    from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip
    from vexpert_runtime.serve.fp8_linear import Fp8Linear

    fp8_linear_module.triton_experts_run = lambda x: True  # the kernel path, in the interpreter on CPU tensors
    torch.manual_seed(4)
    for out_features, in_features, block in ((48, 80, (32, 32)), (40, 72, (16, 16))):
        weight, scales = quantize_fp8_block(torch.randn(out_features, in_features) / in_features**0.5, block)
        linear = Fp8Linear(weight, scales, block)
        dense = linear.dequantized(torch.float32)
        for rows in (1, 16, 37):
            x = torch.randn(rows, in_features)
            assert torch.allclose(linear(x), x @ dense.T, rtol=1e-4, atol=1e-4), (block, rows)
        wide = torch.randn(5, 2 * in_features)[:, ::2]  # a strided input
        assert torch.allclose(linear(wide), wide @ dense.T, rtol=1e-4, atol=1e-4)
        batched = torch.randn(2, 3, in_features)
        assert torch.allclose(linear(batched), batched @ dense.T, rtol=1e-4, atol=1e-4)
        compiled = torch.compile(lambda t, layer=linear: layer(t) * 2.0, fullgraph=True)  # no graph break
        assert torch.allclose(compiled(batched), 2.0 * batched @ dense.T, rtol=1e-4, atol=1e-4)
        if block[1] >= 32:  # W8A8 (FP8 dots want 32-column blocks): the input quantised per row and block column
            w8a8 = Fp8Linear(weight, scales, block, fp8_activations=True)
            for rows in (1, 37):
                x = torch.randn(rows, in_features)
                want = fp8_activation_round_trip(x, block[1]) @ dense.T
                assert torch.allclose(w8a8(x), want, rtol=1e-4, atol=1e-4), rows
                assert not torch.allclose(w8a8(x), x @ dense.T, rtol=1e-3, atol=1e-3)  # it did quantise
                eager = w8a8(x)
                w8a8.compiled = True  # the quantisation by inductor (set with the step's compiled pieces)
                assert torch.equal(w8a8(x), eager), rows
                w8a8.compiled = False


def test_triton_grouped_swiglu_equals_the_loop_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_grouped_gemm_kernel", "check_kernel_on_cpu")


def test_triton_grouped_swiglu_reads_block_fp8_rows_in_place_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_grouped_gemm_kernel", "check_fp8_kernel_on_cpu")


def test_fp8_linears_kernel_path_equals_the_dequantised_product_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_grouped_gemm_kernel", "check_fp8_linear_on_cpu")


def test_triton_w8a8_grouped_swiglu_equals_its_twin_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_grouped_gemm_kernel", "check_w8a8_kernel_on_cpu")


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
    # the rows read in place (a single-GPU EP layer's gate/up GEMM gathers each row's token): bit for bit the same
    row_src = torch.randint(0, tokens, (x.shape[0],), device="cuda")
    tokens_x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    gathered = grouped_swiglu(tokens_x, w13, w2, offs, row_src=row_src)
    assert torch.equal(gathered[:used], grouped_swiglu(tokens_x[row_src], w13, w2, offs)[:used])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 37, 256])
def test_fp8_linears_at_deepseek_sizes_equal_the_dequantised_product(rows: int) -> None:
    """DeepSeek-V3's attention output projection (16384 → 7168) and q_b (1536 → 24576) kept block-FP8
    (``--linear-format fp8_block``): the kernel's product equals bf16 ``F.linear`` over the dequantised weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    from vexpert_runtime.model.expert_format import quantize_fp8_block
    from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip, quantize_activation_groups
    from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, launch_config
    from vexpert_runtime.model.moe_math import relative_error
    from vexpert_runtime.serve.fp8_linear import Fp8Linear, cublas_block_scaling_runs

    torch.manual_seed(rows)
    if torch.cuda.get_device_capability() >= (9, 0):  # Hopper: W8A8 takes torch's block-scaled GEMM (cuBLAS)
        assert cublas_block_scaling_runs(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    # o_proj, q_b, and the fused q_a + kv_a (2112 columns: a partial last scale block)
    for out_features, in_features in ((7168, 16384), (24576, 1536), (2112, 7168)):
        weight = torch.randn(out_features, in_features, device="cuda") / in_features**0.5
        linear = Fp8Linear(*quantize_fp8_block(weight, (128, 128)), (128, 128))
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x, linear.dequantized(torch.bfloat16)).float()
        assert relative_error(linear(x).float(), want) <= 1e-2, (out_features, in_features)
        # W8A8 (model.expert_compute w8a8): against its float32 twin, the same quantised activations — on cuBLAS's
        # block-scaled GEMM where it runs, and on the Triton kernel; the two agree as closely
        w8a8 = Fp8Linear(linear.weight, linear.weight_scale_inv, (128, 128), fp8_activations=True)
        twin = fp8_activation_round_trip(x.float(), 128) @ linear.dequantized(torch.float32).T
        assert relative_error(w8a8(x).float(), twin) <= 1e-2, (out_features, in_features)
        quantised, x_scales = quantize_activation_groups(x, 128)
        offs = torch.full((1,), rows, dtype=torch.int32, device="cuda")
        triton_w8a8 = grouped_gemm(quantised, linear.weight.unsqueeze(0), offs, config=launch_config("linear", rows, True, True),
                                   scales=linear.weight_scale_inv.unsqueeze(0), x_scales=x_scales, out_dtype=x.dtype)
        assert relative_error(w8a8(x).float(), triton_w8a8.float()) <= 1e-2, (out_features, in_features)
        # as the decode step's graph holds it: captured once (compiled quantisation), replayed on new rows
        w8a8.compiled = True
        eager = w8a8(x)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            w8a8(x)  # warm-up off the capture (inductor's compile)
            with torch.cuda.graph(graph, stream=stream):
                captured = w8a8(x)
        torch.cuda.current_stream().wait_stream(stream)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert not torch.equal(captured, eager) and torch.equal(captured, w8a8(x)), (out_features, in_features)
