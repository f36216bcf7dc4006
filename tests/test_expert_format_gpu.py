"""Block-FP8 experts on a GPU (skipped without CUDA): the grouped-GEMM EP layer over FP8 stacks
(dequantised into a bf16 scratch, then ``torch._grouped_mm``) equals the dequantised reference, and
a whole node with FP8 pool and slots in HBM (filled over CUDA IPC) verifies every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_support import TINY_FP8_DEEPSEEK_SPEC as SPEC
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import CheckpointReader, write_tiny_checkpoint
from vexpert_runtime.model.ep_moe import DeviceRoutingTable, ExpertStacks, ep_moe_layer, static_table
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


def test_node_on_one_gpu_with_fp8_slots_verifies(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=4)
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(tmp_path), "dtype": "bfloat16", "expert_format": "fp8_block"},
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
