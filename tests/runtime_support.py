"""Shared fixtures of the node-runtime tests: the tiny DeepSeek-shaped MoE they all build."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from vexpert_runtime.model.expert_layout import FP8_BLOCK
from vexpert_runtime.model.families import DEEPSEEK
from vexpert_runtime.model.moe_spec import MoESpec

# 2 MoE layers × 8 experts, group-limited top-2 routing, correction bias, a shared expert:
# every DeepSeek-V3 routing feature at a size the 2-core CI machine runs in milliseconds.
TINY_DEEPSEEK_SPEC = MoESpec(
    architecture=DEEPSEEK,
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    moe_layers=(1, 2),
    n_group=2,
    topk_group=2,
    routed_scaling_factor=1.5,
    correction_bias=True,
    shared_intermediate_size=16,
)

# A block-FP8 checkpoint (DeepSeek-V3's format) with real 128×128 blocks: H = 256 is two whole
# blocks, I = 192 one whole and one partial block (gate/up rows, down columns).
TINY_FP8_DEEPSEEK_SPEC = dataclasses.replace(
    TINY_DEEPSEEK_SPEC,
    hidden_size=256,
    intermediate_size=192,
    num_experts=4,
    shared_intermediate_size=192,
    fp8_block=(128, 128),
    expert_storage=FP8_BLOCK,
)


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float) -> None:
    """Terminate a runtime process started by a test; kill it if it has not exited after ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_in_triton_interpreter(module: str, function: str) -> None:
    """Run ``tests/<module>.py``'s ``function()`` in a subprocess with ``TRITON_INTERPRET=1`` (set before
    Triton is imported: its interpreter patches ``tl.sort``/``tl.cumsum`` at import); fail with its stderr."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(repo / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
