"""The node's GPU path (skipped without CUDA): the EP layer on a GPU equals the single-process
reference; whole nodes (coordinator + one worker per GPU, NCCL all-to-all, slots in HBM filled over
CUDA IPC from the pinned pool) run with plan changes on 1 and on 2 GPUs, verified against the
reference every step and bitwise on the slot contents; ``vexpert node --config`` with
``runtime.device: cuda`` runs and reports its metrics."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from node_faults import faulty_filler
from runtime_support import TINY_DEEPSEEK_SPEC, metric_value
from scripted_plans import scripted_plans
from slot_audit import SlotAudit, slot_checksums
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import CheckpointReader, write_tiny_checkpoint
from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    ep_moe_layer,
    plan_from_slots,
    static_table,
)
from vexpert_runtime.model.moe_math import relative_error, shared_forward
from vexpert_runtime.model.reference import VERIFY_TOLERANCE, ModelWeights, reference_moe_layer
from vexpert_runtime.model.routing import route
from vexpert_runtime.node import NodeOptions, NodeRuntime, resolve_setup, run_node
from vexpert_runtime.node.slots import row_checksum
from vexpert_runtime.policy.placement import static_placement
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload
from vexpert_runtime.workload import Workload

REPO = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")

SPEC = dataclasses.replace(TINY_DEEPSEEK_SPEC, hidden_size=64, intermediate_size=32, shared_intermediate_size=32)

# fp32 on a GPU differs from the CPU reference by reduction order only; bf16 by rounding.
TOLERANCE = VERIFY_TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ep_layer_on_gpu_equals_reference(tmp_path: Path, dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    write_tiny_checkpoint(tmp_path, SPEC, seed=3)
    weights = ModelWeights.load(CheckpointReader(tmp_path, SPEC), torch_dtype)
    device = torch.device("cuda", 0)
    x = torch.randn(48, SPEC.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch_dtype)
    bias = torch.tensor([2.0, 0, 0, 1.0, 0, 0, 0, 0])
    for layer in range(SPEC.num_layers):
        ref, _ = reference_moe_layer(x, weights, layer, bias)
        router = weights.routers[layer]
        xd = x.to(device)
        router_d = type(router)(router.weight.to(device), None if router.correction_bias is None else router.correction_bias.to(device))
        ids, topk_weights = route(xd, router_d, SPEC, bias.to(device))
        rows = weights.experts[layer].to(device)
        shared = weights.shared[layer]
        assert shared is not None
        shared_d = type(shared)(shared.gate.to(device), shared.up.to(device), shared.down.to(device), None)
        y, stats = ep_moe_layer(
            xd,
            ids,
            topk_weights,
            DeviceRoutingTable.of(static_table(SPEC.num_layers, SPEC.num_experts, 1, 0), device),
            layer,
            ExpertStacks(rows, None, SPEC.intermediate_size),
            shared_forward(xd, shared_d),
            0,
            1,
            None,
        )
        assert y.device == device and stats.computed.is_cuda  # the caller reads it when it suits
        assert int(stats.computed.sum()) == 48 * SPEC.top_k
        assert relative_error(y.cpu(), ref) <= TOLERANCE[dtype], layer


def _setup(checkpoint: Path, gpus: int, dtype: str = "float32", k: int = 4, vmax: int = 2, group_size: int = 1) -> Any:
    config = RuntimeConfig.model_validate(
        {
            "model": {"checkpoint_path": str(checkpoint), "dtype": dtype},
            "parallelism": {"expert_parallel_size": gpus, "gpus_per_node": gpus, "master_port": free_port()},
            "vexpert": {"group_size": group_size, "vmax": vmax, "balance_threshold": 0.95},
            "tuning": {"allocation_interval": k},
            # more ranks than GPUs: workers share them (all-to-all over gloo through host memory)
            "runtime": {"device": "cuda", "metrics_port": 0, "slot_fill_timeout_s": 30.0,
                        "workers_per_gpu": max(1, -(-gpus // max(GPUS, 1)))},
        }
    )
    return resolve_setup(config, checkpoint)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_node_on_one_gpu_verifies_and_skips_every_allocation(tmp_path: Path, dtype: str) -> None:
    """One rank holds every expert: no placement is better than the static one, so every window's
    allocation is skipped (the supervisor's ``allocation_is_idle``) and the first plan stays; the GPU
    step still verifies against the reference, graphed in bf16. Plan changes on a GPU: the two-rank
    tests below (two workers share the GPU where there is one)."""
    write_tiny_checkpoint(tmp_path, SPEC, seed=4)
    setup = _setup(tmp_path, 1, dtype=dtype, vmax=1, group_size=2)
    assert setup.device == "cuda" and setup.local_workers == 1
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=32)
    report = run_node(setup, NodeOptions(workload=workload, iterations=24, verify=True))
    assert report.iterations == 24
    assert [tuple(switch) for switch in report.plan_switches] == [(0, 0)]
    assert report.allocations == 0 and metric_value(report.metrics_text, "vexpert_allocations_skipped_total") >= 4  # k=4: 6 windows, the last may not close
    assert report.static_balance == report.vexpert_balance == 1.0
    assert report.max_rel_error is not None and report.max_rel_error <= TOLERANCE[dtype]
    assert report.degraded_groups == 0
    assert "vexpert_slot_fill_wait_seconds" in report.metrics_text
    if dtype == "bfloat16":  # grouped GEMMs, one rank, no collective: the iterations replay the captured step
        assert report.graphed_steps >= 10, report.graphed_steps
    else:  # the fp32 per-expert loop reads group ends on the host: eager
        assert report.graphed_steps == 0
    assert "vexpert_graphed_steps_total" in report.metrics_text


def test_node_allocates_on_the_gpu_with_the_graphed_allocator(tmp_path: Path) -> None:
    # two ranks (on two GPUs, or sharing the one there is): the skewed loads make windows worth allocating
    write_tiny_checkpoint(tmp_path, SPEC, seed=5)
    setup = _setup(tmp_path, 2, vmax=1, group_size=2, k=2)
    lines: list[str] = []
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=16)
    report = run_node(setup, NodeOptions(workload=workload, iterations=40, log=lines.append))
    assert any("graphed allocator ready on cuda:0" in line for line in lines), lines
    assert report.allocations >= 5 and report.degraded_groups == 0, (report.allocations, report.windows)
    # replays of the captured graph: well under the eager CPU allocator's milliseconds on this tiny shape
    assert sorted(report.allocator_s)[len(report.allocator_s) // 2] < 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the experts run as grouped GEMMs
def test_node_with_two_ranks_fills_slots_over_ipc_and_switches_plans(tmp_path: Path, dtype: str) -> None:
    # two GPUs, or two workers sharing the one GPU there is (the slot path is the same: IPC, GPU flags)
    write_tiny_checkpoint(tmp_path, SPEC, seed=5)
    setup = _setup(tmp_path, 2, dtype=dtype)
    base = static_placement(2, 8, 2)
    # rank 0 holds experts 0-3, rank 1 holds 4-7; G=1, vmax=2: two slots per buffer
    plan_a = plan_from_slots(base, torch.tensor([[[4, 5], [0, 1]], [[6, -1], [2, -1]]]))
    plan_b = plan_from_slots(base, torch.tensor([[[6, 7], [2, 3]], [[4, 5], [0, 1]]]))
    report = NodeRuntime(
        setup,
        NodeOptions(
            workload=Workload(tokens_per_worker=32, seed=1),
            iterations=8,
            verify=True,
            allocate=False,
            filler=faulty_filler(delays={5 * 2 + 1: 0.5}),  # iteration 5, layer 1: workers must wait, not read stale slots
            probe=SlotAudit,
        ),
        balance=scripted_plans({0: plan_a, 4: plan_b}),
    ).run()
    assert report.iterations == 8
    assert report.plan_switches == [(0, 1), (4, 2)]
    assert report.max_rel_error is not None and report.max_rel_error <= TOLERANCE[dtype]
    assert report.degraded_groups == 0
    assert report.records[5].step_s >= 0.3  # the GPU waited for the late layer (the host only sees the step)
    assert report.bytes_streamed > 0
    reader = CheckpointReader(tmp_path, SPEC)
    for record in report.records:  # every slot computed with held exactly its plan's expert (bitwise)
        table = report.tables[record.plan_ids[0]]
        for rank, per_group in slot_checksums(record.details).items():
            for layer, sums in enumerate(per_group):
                for slot, expert in enumerate(table.slot_expert[layer, rank].tolist()):
                    if expert >= 0:
                        assert sums[slot] == row_checksum(reader.expert(layer, expert, getattr(torch, dtype)))


def _cli_config(path: Path, ranks: int) -> Path:
    raw = {
        "model": {"dtype": "bfloat16"},  # no checkpoint: the built-in demo model (32 experts, 6 layers)
        "parallelism": {"expert_parallel_size": ranks, "gpus_per_node": ranks, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": 8},
        # more ranks than GPUs: workers share them
        "runtime": {"device": "cuda", "metrics_port": 0, "workers_per_gpu": max(1, -(-ranks // max(GPUS, 1)))},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("ranks", [1, 2])
def test_vexpert_node_cli_on_gpus(tmp_path: Path, ranks: int) -> None:
    config = _cli_config(tmp_path / "runtime.yaml", ranks)
    done = subprocess.run(
        [sys.executable, "-m", "vexpert_runtime", "node", "--config", str(config), "--iterations", "40",
         "--tokens-per-worker", "128", "--load", "bundled:decode_in1000out1000:1000"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert f"{ranks} cuda workers" in done.stderr
    final = re.search(
        r"stopped after (\d+) iterations: balance static ([0-9.]+) → ([0-9.]+), (\d+) tokens/s, slot-fill wait mean "
        r"([0-9.]+) ms max ([0-9.]+) ms per iteration, (\d+) B streamed \(([0-9.]+) GB/s while copying\), "
        r"(\d+) plan switches",
        done.stderr,
    )
    assert final is not None, done.stderr
    assert int(final.group(1)) == 40 and int(final.group(4)) > 0
    if ranks == 1:  # one rank holds every expert: every window's allocation is skipped, the first plan stays
        assert int(final.group(9)) == 0 and float(final.group(2)) == float(final.group(3)) == 1.0
    else:
        assert int(final.group(9)) >= 3  # a new plan every k=8 iterations
        assert int(final.group(7)) > 0  # replicas streamed into the other rank's slots
        assert float(final.group(3)) >= float(final.group(2))
