"""`vexpert serve`'s per-rank batch limits: the flags where given, else the device's defaults."""

from __future__ import annotations

import pytest

from vexpert_runtime.commands.serve import CPU_BATCH_DEFAULTS, GPU_BATCH_DEFAULTS, resolve_batch_limits
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.scheduler import SchedulerConfig


def test_a_gpu_rank_batches_more_sequences_than_a_cpu_rank_by_default() -> None:
    assert resolve_batch_limits(None, None, "cuda") == GPU_BATCH_DEFAULTS == (256, 512)
    assert resolve_batch_limits(None, None, "cpu") == CPU_BATCH_DEFAULTS == (64, 256)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_token_budget_follows_a_larger_max_running_unless_given(device: str) -> None:
    assert resolve_batch_limits(1024, None, device) == (1024, 1024)
    assert resolve_batch_limits(8, None, device)[1] == (GPU_BATCH_DEFAULTS if device == "cuda" else CPU_BATCH_DEFAULTS)[1]
    assert resolve_batch_limits(None, 4096, device)[1] == 4096
    # given flags are kept as they are: an impossible pair is refused by the scheduler's check, naming the field
    running, tokens = resolve_batch_limits(300, 100, device)
    with pytest.raises(VExpertInputError, match="max_batch_tokens"):
        SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=tokens, max_running=running).check(4096)
