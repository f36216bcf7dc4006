"""What a worker process is started with (:class:`WorkerArgs`, pickled at spawn): one module that the
worker (:mod:`.worker`), its model runners (:mod:`.runners`) and the supervisor all import, so none
of them imports another for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vexpert_runtime.model.checkpoint import MoESpec
from vexpert_runtime.node.protocol import SharedState
from vexpert_runtime.node.slot_probe import ProbeFactory
from vexpert_runtime.workload import Workload


@dataclass
class WorkerArgs:
    """Everything a worker process needs (pickled at spawn)."""

    local_rank: int
    gpu: int  # cuda:<gpu> on GPU nodes
    shared_gpu: bool  # other workers use the same GPU: everything over gloo (NCCL refuses)
    rank: int
    world: int
    rendezvous: str  # torch.distributed init_method (node.setup.rendezvous_url)
    checkpoint: str
    spec: MoESpec
    dtype: str
    device: str
    slots: int
    k: int
    timeout_s: float
    workload: Workload
    shared: SharedState
    results: Any
    control: Any
    parent_pid: int
    verify: bool
    probe: ProbeFactory | None = None  # looks at every layer's slots (node.slot_probe); the worker then runs eagerly
    serve: Any = None  # ServeWorkerArgs: serve requests through the model (vexpert serve) instead of ``workload``
    dispatch: str = "plan"  # replica dispatch of every layer (plan | local | global; the same on every rank)
