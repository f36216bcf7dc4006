"""Output verification (``--verify``): every rank's output of every iteration against the
single-process reference model, computed by the supervisor when its queue is idle.

In low precision (bf16, fp16) the tokens whose routing is within ``VERIFY_TIE_MARGIN`` of a tie in
some layer are left out of the comparison: the reference routes them itself, on the CPU, and a
near-tie choice follows the summation order of the workers' kernels — either expert is right, and
counting it as an error made bf16 verification fail on correct runs. fp32 compares every token."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

from vexpert_runtime.model.moe_math import relative_error
from vexpert_runtime.model.reference import VERIFY_TIE_MARGIN, ModelWeights, reference_outputs
from vexpert_runtime.workload import Workload


@dataclass(frozen=True)
class VerifyJob:
    """One rank's output [B, H] of one iteration, to compare with the reference."""

    iteration: int
    rank: int
    output: np.ndarray


class OutputVerifier:
    """Regenerates a rank's input from the workload and runs the reference on it."""

    def __init__(self, reference: ModelWeights, workload: Workload, hidden_size: int, dtype: torch.dtype) -> None:
        self.reference = reference
        self.workload = workload
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.tie_margin = VERIFY_TIE_MARGIN[str(dtype).removeprefix("torch.")]
        self.pending: collections.deque[VerifyJob] = collections.deque()

    def add(self, job: VerifyJob) -> None:
        self.pending.append(job)

    def verify_next(self) -> tuple[int, float, int]:
        """(iteration, relative error, tokens left out at a routing tie) of the oldest pending job."""
        job = self.pending.popleft()
        x = self.workload.inputs(job.iteration, job.rank, self.hidden_size, self.dtype)
        ref = reference_outputs(x, self.reference, self.workload.logit_bias(job.iteration))
        output = torch.from_numpy(job.output)
        if not self.tie_margin:  # full precision: every token
            return job.iteration, relative_error(output, ref.h), 0
        settled = ref.margins >= self.tie_margin
        return job.iteration, relative_error(output[settled], ref.h[settled]), int((~settled).sum())
