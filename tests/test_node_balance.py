"""The supervisor's balance state skips an allocation that would only repeat the static placement
(every layer above τ, no vExpert placed): no plan, no plan id, no allocator time — and allocates as
before once a layer falls below τ, and to go back to static after vExperts were placed."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime_support import TINY_DEEPSEEK_SPEC
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import resolve_setup
from vexpert_runtime.node.balance import BalanceState


def test_a_balanced_window_makes_no_plan_and_a_skewed_one_does(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", TINY_DEEPSEEK_SPEC, seed=2)
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.9},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    })
    state = BalanceState(resolve_setup(config, checkpoint), tokens_per_worker=16)
    layers, experts = TINY_DEEPSEEK_SPEC.num_layers, TINY_DEEPSEEK_SPEC.num_experts
    balanced = torch.full((layers, experts), 40.0)
    assert state.next_plan(balanced) is None
    assert (state.idle_windows, state.allocations, state.plan_id, state.allocator_s) == (1, 0, 0, [])

    skewed = balanced.clone()
    skewed[:, 0] = 400.0  # expert 0 of every layer hot: its GPU carries most of the tokens
    made = state.next_plan(skewed)
    assert made is not None and sum(made.vexperts) > 0 and state.plan_id == 1

    back = state.next_plan(balanced)  # balanced again, but vExperts are placed: the allocator decides
    assert back is not None and sum(back.vexperts) == 0 and state.plan_id == 2
    assert state.next_plan(balanced) is None and state.idle_windows == 2
