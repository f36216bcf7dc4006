"""Block-FP8 experts on a GPU (skipped without CUDA): the grouped-GEMM EP layer over FP8 stacks
(the Triton grouped GEMM reading the fp8 weights and their block scales in place) equals the
dequantised reference — at the tiny spec's partial blocks and at DeepSeek-V3's expert sizes, without a
dequantised copy —, and a whole node with FP8 pool and slots in HBM (filled over CUDA IPC) verifies
every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_support import TINY_FP8_DEEPSEEK_SPEC as SPEC
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import CheckpointReader, write_tiny_checkpoint
from vexpert_runtime.model.ep_moe import DeviceRoutingTable, ExpertStacks, ep_moe_layer, static_table
from vexpert_runtime.model.fp8_activations import dequantize_activation_groups, quantize_activation_groups
from vexpert_runtime.model.grouped_moe import uses_grouped_gemm
from vexpert_runtime.model.moe_math import relative_error, shared_forward
from vexpert_runtime.model.reference import VERIFY_TOLERANCE, ModelWeights, reference_moe_layer
from vexpert_runtime.model.routing import route
from vexpert_runtime.node import NodeOptions, resolve_setup, run_node
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device")]


def _on(device: torch.device, weights: object) -> object:
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(weights).items()}
    return type(weights)(**fields)


def test_fp8_grouped_gemm_on_gpu_equals_the_dequantised_reference(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=3)
    reader = CheckpointReader(tmp_path, SPEC)
    reference = ModelWeights.load(reader, torch.bfloat16)
    device = torch.device("cuda", 0)
    fmt = SPEC.expert_format(torch.bfloat16)
    x = torch.randn(64, SPEC.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    xd = x.to(device)
    assert uses_grouped_gemm(xd)
    for layer in range(SPEC.num_layers):
        ref, _ = reference_moe_layer(x, reference, layer)
        rows = reader.experts(layer, list(range(SPEC.num_experts)), torch.bfloat16).to(device)
        assert rows.dtype == torch.uint8
        ids, weights = route(xd, _on(device, reference.routers[layer]), SPEC)  # type: ignore[arg-type]
        shared = shared_forward(xd, _on(device, reference.shared[layer]))  # type: ignore[arg-type]
        stacks = ExpertStacks(rows, None, SPEC.intermediate_size, format=fmt)
        table = DeviceRoutingTable.of(static_table(SPEC.num_layers, SPEC.num_experts, 1, 0), device)
        y, _ = ep_moe_layer(xd, ids, weights, table, layer, stacks, shared, 0, 1, None)
        assert relative_error(y.cpu(), ref) <= VERIFY_TOLERANCE["bfloat16"], layer
        # the same layer over the reference's dense bf16 rows: one rank's gate/up GEMM reads each token in place
        dense = ExpertStacks(reference.experts[layer].to(device), None, SPEC.intermediate_size)
        y_dense, _ = ep_moe_layer(xd, ids, weights, table, layer, dense, shared, 0, 1, None)
        assert relative_error(y_dense.cpu(), ref) <= VERIFY_TOLERANCE["bfloat16"], layer


def _float32_gemms(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, group: int, swiglu: bool) -> torch.Tensor:
    """One W8A8 GEMM's float32 twin over the same FP8 numbers: a [M, K] quantised as the kernel's caller does
    (per row and ``group`` columns), times the float32 dequantised w [E, N, K] per group (SwiGLU of the halves)."""
    quantised, scales = quantize_activation_groups(a, group)
    wide = dequantize_activation_groups(quantised, scales, group, torch.float32)
    width = w.shape[1] // 2 if swiglu else w.shape[1]
    out, start = torch.zeros(a.shape[0], width, device=a.device), 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            h = wide[start:end] @ w[e].T
            out[start:end] = torch.nn.functional.silu(h[:, :width]) * h[:, width:] if swiglu else h
        start = end
    return out


@pytest.mark.parametrize("compute", ["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [16, 256])
def test_fp8_experts_at_deepseek_sizes_are_read_in_place(tokens: int, compute: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight DeepSeek-V3 experts (I 2048, H 7168, 128×128 blocks) as FP8 rows, skewed groups: the EP
    layer's SwiGLU equals the one over their dequantised bf16 stack, makes no dequantised copy (the
    dequantisation is not called, and the memory it takes stays below a tenth of such a stack). W8A8: each GEMM
    equal to its float32 twin over the same FP8 numbers, and the whole within e4m3's error of W8A16."""
    from vexpert_runtime.model.expert_format import ExpertFormat, quantize_fp8_block
    from vexpert_runtime.model.grouped_moe import GROUP_ALIGN, grouped_swiglu

    experts, inter, hidden, block = 8, 2048, 7168, (128, 128)
    fmt = ExpertFormat(inter, hidden, torch.bfloat16, block, fp8_activations=compute == "w8a8")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    rows = []
    for _ in range(experts):
        weights = {"gate": torch.randn(inter, hidden, device="cuda", generator=gen) * 0.02,
                   "up": torch.randn(inter, hidden, device="cuda", generator=gen) * 0.02,
                   "down": torch.randn(hidden, inter, device="cuda", generator=gen) * 0.02}
        quantised = {p: quantize_fp8_block(w, block) for p, w in weights.items()}
        rows.append(fmt.pack_fp8({p: q.cpu() for p, (q, _) in quantised.items()},
                                 {p: s.cpu() for p, (_, s) in quantised.items()}).cuda())
        del weights, quantised
    stack = torch.stack(rows)
    del rows
    counts = torch.multinomial(torch.tensor([8.0, 4, 2, 1, 1, 0.5, 0.5, 0.01]), 2 * tokens, replacement=True,
                               generator=torch.Generator().manual_seed(tokens)).bincount(minlength=experts)
    offs = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).cumsum(0).to(torch.int32).cuda()
    used = int(offs[-1])
    x = torch.randn(used + 16, hidden, device="cuda", dtype=torch.bfloat16)
    w13, w2 = fmt.stack_weights(stack)
    want = grouped_swiglu(x, w13, w2, offs).float()
    dequantised_bytes = (w13.numel() + w2.numel()) * 2
    del w13, w2
    w13_32, w2_32 = ExpertFormat(inter, hidden, torch.float32, block).stack_weights(stack) if fmt.fp8_activations \
        else (None, None)
    stacks = ExpertStacks(stack, None, inter, format=fmt)
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    monkeypatch.setattr(ExpertFormat, "stack_weights", lambda *_: pytest.fail("FP8 rows were dequantised"))
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    stacks.swiglu(x, stack, offs, out)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < dequantised_bytes / 10
    got = out.float()
    if w13_32 is None:
        assert (got[:used] - want[:used]).abs().max() <= 0.02 * want[:used].abs().max()
        return
    # W8A8, GEMM by GEMM against float32 over the same FP8 numbers (to bf16's rounding of the outputs); the served
    # SwiGLU is exactly these two launches
    from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm

    fp8 = fmt.fp8_stack(stack)
    assert fp8 is not None and w2_32 is not None
    xq, xs = quantize_activation_groups(x, block[1])
    act = grouped_gemm(xq, fp8.w13, offs, swiglu=True, scales=fp8.s13, scale_block=block, x_scales=xs,
                       out_dtype=torch.bfloat16)
    assert relative_error(act[:used].float(), _float32_gemms(x, w13_32, offs, block[1], True)[:used]) <= 5e-3
    aq, as_ = quantize_activation_groups(act, block[1])
    down = grouped_gemm(aq, fp8.w2, offs, scales=fp8.s2, scale_block=block, x_scales=as_, out_dtype=torch.bfloat16)
    assert relative_error(down[:used].float(), _float32_gemms(act, w2_32, offs, block[1], False)[:used]) <= 5e-3
    assert torch.equal(out[:used], down[:used])
    # the whole of it within e4m3's error of W8A16 (3 mantissa bits: ~5 %). Not against a float32 twin of the
    # whole: the intermediate is requantised, so a bf16 step between the kernel's and a twin's intermediate flips
    # e4m3 roundings and group scales — on an H100 the FP8 tensor cores' reduced-precision accumulation within a K
    # tile made 1.5 % of such a difference at 256 tokens (benchmarks/w8a8_accuracy.py measures both)
    assert relative_error(got[:used], want[:used]) <= 0.08


@pytest.mark.parametrize("compute", ["w8a16", "w8a8"])
def test_node_on_one_gpu_with_fp8_slots_verifies(tmp_path: Path, compute: str) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=4)
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(tmp_path), "dtype": "bfloat16", "expert_format": "fp8_block",
                  "expert_compute": compute},
        "parallelism": {"expert_parallel_size": 1, "gpus_per_node": 1, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": 4},
        "runtime": {"device": "cuda", "metrics_port": 0, "slot_fill_timeout_s": 30.0},
    })
    setup = resolve_setup(config, tmp_path)
    assert setup.memory.pool_bytes == SPEC.num_layers * SPEC.num_experts * SPEC.expert_bytes(torch.bfloat16)
    workload = drifting_workload((("decode_in1000out1000", 1000),), SPEC.num_layers, SPEC.num_experts, tokens_per_worker=32)
    report = run_node(setup, NodeOptions(workload=workload, iterations=12, verify=True))
    assert report.iterations == 12
    assert report.max_rel_error is not None and report.max_rel_error <= VERIFY_TOLERANCE["bfloat16"]
