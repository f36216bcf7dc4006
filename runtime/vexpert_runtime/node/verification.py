"""Output verification (``--verify``): every rank's output of every iteration against the
single-process reference model, computed by the supervisor when its queue is idle."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

from vexpert_runtime.model.moe_math import relative_error
from vexpert_runtime.model.reference import ModelWeights, reference_forward
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
        self.pending: collections.deque[VerifyJob] = collections.deque()

    def add(self, job: VerifyJob) -> None:
        self.pending.append(job)

    def verify_next(self) -> tuple[int, float]:
        """(iteration, relative error) of the oldest pending job."""
        job = self.pending.popleft()
        x = self.workload.inputs(job.iteration, job.rank, self.hidden_size, self.dtype)
        ref, _ = reference_forward(x, self.reference, self.workload.logit_bias(job.iteration))
        return job.iteration, relative_error(torch.from_numpy(job.output), ref)
