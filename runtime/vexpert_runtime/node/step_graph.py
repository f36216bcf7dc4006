"""A GPU worker's decode step as one CUDA graph.

Every MoE layer of an iteration — routing, the sync-free EP layer, the slot handshake's flag waits
and writes (``cuStreamWaitValue32``/``cuStreamWriteValue32`` compare and store constants), the
statistics — is captured once and replayed every iteration. Nothing in it depends on the plan but
the device routing table's *contents*, which a plan switch overwrites in place
(:meth:`~vexpert_runtime.model.ep_moe.DeviceRoutingTable.load`): no re-capture, no stall.

A step can be captured only where every collective in it can: NCCL all-to-alls (one worker per GPU)
or none (one rank). Ranks sharing a GPU exchange through host memory over gloo and run eagerly.

Shapes: ``inputs`` [B, H] (the iteration's hidden states), ``bias`` [L, E] fp32 router skew or None.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from vexpert_runtime.gc_heap import collector_paused

GRAPHS_ENV = "VEXPERT_CUDA_GRAPHS"  # "0": run GPU steps eagerly (debugging)


def graphs_enabled(enforce_eager: bool = False) -> bool:
    """Whether a GPU step may run as CUDA graphs: not under ``vexpert serve --enforce-eager``, nor with
    VEXPERT_CUDA_GRAPHS=0 in the environment (any command)."""
    return not enforce_eager and os.environ.get(GRAPHS_ENV, "1") != "0"


# The step's stream above every other stream of the worker (CUDA: lower is higher; PyTorch offers -1 and 0):
# the shared experts' side stream (priority 0, :mod:`~vexpert_runtime.serve.sparse_blocks`) runs its GEMM beside
# the routed path, whose router / selection / layout kernels are the critical path, and with equal priorities the
# side GEMM's CTAs took the SMs first — the layout kernel took 24 µs a layer in the 256-sequence step and 7 µs with
# the shared experts on the step's stream. On an H100, graphed, priority -1 against 0: 256 sequences 1.937 against
# 1.963 ms, 64 sequences 1.577 against 1.590 (benchmarks/README.md §10, run 32). Graph capture keeps a kernel's
# stream priority in its node.
STEP_STREAM_PRIORITY = -1


def step_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """A new stream for a worker's decode step, at :data:`STEP_STREAM_PRIORITY`."""
    return torch.cuda.Stream(device=device, priority=STEP_STREAM_PRIORITY)


class StepGraph:
    """``run(inputs, bias) -> outputs`` captured on ``stream`` over static input buffers.

    ``run`` must enqueue only device work with fixed shapes on ``stream`` (no host reads); the
    tensors it returns are overwritten by every replay.
    """

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], stream: Any,
                 inputs: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.stream = stream
        self.inputs = torch.empty_like(inputs)
        self.bias = None if bias is None else torch.empty_like(bias)
        self.inputs.copy_(inputs)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's watchdog thread may touch its own side stream meanwhile;
        # no garbage collection inside the capture (gc_heap.collector_paused says why)
        with collector_paused(), torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.outputs = run(self.inputs, self.bias)

    def fits(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a replay can take these inputs (same shapes; bias present iff captured with one)."""
        if inputs.shape != self.inputs.shape or (bias is None) != (self.bias is None):
            return False
        return bias is None or self.bias is None or bias.shape == self.bias.shape

    def replay(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Enqueue one step on the current stream; its outputs (valid once the stream got there)."""
        self.inputs.copy_(inputs, non_blocking=True)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias, non_blocking=True)
        self.graph.replay()
        return self.outputs
