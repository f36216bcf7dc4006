"""A node's resolved configuration: everything checked against the machine and the checkpoint
before any process starts (ranks, ports, memory of the pool and the slots)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from vexpert_runtime.config import DEFAULT_MASTER_PORT, RuntimeConfig
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
    MoESpec,
    read_model_spec,
    resolve_expert_storage,
)
from vexpert_runtime.model.dispatch import choose_dispatch
from vexpert_runtime.model.expert_layout import DENSE
from vexpert_runtime.node.slots import SlotLayout
from vexpert_runtime.policy.names import DEFAULT_PLACEMENT_POLICY, PlacementPolicyName
from vexpert_runtime.policy.profile import PerformanceProfile
from vexpert_runtime.policy.registry import placement_policy
from vexpert_runtime.ports import free_port

# ---------------------------------------------------------------------------------------------
# Setup: everything resolved and validated before any process starts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the node will use: L2 pool (coordinator), per worker L1 slots and base experts."""

    pool_bytes: int
    slot_bytes_per_worker: int
    base_bytes_per_worker: int
    workers: int
    device: str

    @property
    def host_bytes(self) -> int:
        """Host memory: the pool, plus on CPU every worker's slots and base experts."""
        per_worker = self.slot_bytes_per_worker + self.base_bytes_per_worker if self.device == "cpu" else 0
        return self.pool_bytes + self.workers * per_worker


@dataclass(frozen=True)
class NodeSetup:
    """A node's resolved configuration."""

    checkpoint: Path
    spec: MoESpec
    dtype: str
    device: str
    local_workers: int
    world: int
    node_rank: int
    master_addr: str
    master_port: int
    group_size: int
    vmax: int
    balance_threshold: float
    k: int
    pooled: int
    metrics_port: int
    slot_fill_timeout_s: float
    host_memory_limit_bytes: int | None
    profile: PerformanceProfile
    memory: MemoryPlan
    workers_per_gpu: int = 1  # worker processes sharing one GPU (their all-to-all goes over gloo)
    dispatch: str = "plan"  # replica dispatch every worker runs (plan | local | global), resolved from auto
    dispatch_reason: str = "configured"  # why (auto's comparison, for logs and the report)
    metrics_addr: str = "0.0.0.0"
    placement_policy: PlacementPolicyName = DEFAULT_PLACEMENT_POLICY  # the registry entry the node runs
    linear_format: str = "dense"  # a block-FP8 checkpoint's non-expert linears: dequantised or kept (serving ranks)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def slots(self) -> int:
        """S = G·vmax slots per buffer."""
        return self.group_size * self.vmax

    @property
    def ranks(self) -> list[int]:
        """EP ranks of this node's workers."""
        return [self.node_rank * self.local_workers + i for i in range(self.local_workers)]


def memory_plan(spec: MoESpec, dtype: torch.dtype, pooled: int, slots: int, world: int, workers: int, device: str) -> MemoryPlan:
    expert = spec.expert_bytes(dtype)
    return MemoryPlan(
        pool_bytes=spec.num_layers * pooled * expert,
        slot_bytes_per_worker=SlotLayout(slots, spec.expert_numel, spec.row_dtype(dtype)).bytes_per_worker,
        base_bytes_per_worker=spec.num_layers * (spec.num_experts // world) * expert,
        workers=workers,
        device=device,
    )


def resolve_expert_compute(requested: str, spec: MoESpec, device: str) -> str:
    """``model.expert_compute`` for this node: ``auto`` is ``w8a8`` where the experts are FP8 rows (``spec``: storage
    resolved) on GPUs with FP8 tensor cores (compute capability 8.9+) and block columns FP8 dots take (32+) —
    as vLLM and SGLang serve a block-FP8 checkpoint on such GPUs, and the shorter step (run 27 on an H100: 13-18 %) —,
    else ``w8a16`` (dense rows; CPU ranks, where W8A8 is only emulated; older GPUs). Explicit choices pass through."""
    if requested != "auto":
        return requested
    block = spec.storage_block
    fp8_dots = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    return "w8a8" if block is not None and block[1] % 32 == 0 and fp8_dots else "w8a16"


def check_fp8_options(spec: MoESpec, linear_format: str, device: str) -> None:
    """``model.expert_compute`` and ``model.linear_format`` against the checkpoint (``spec``, storage resolved)
    and the device: W8A8 wants FP8 tensor cores and blocks of 32+ columns, FP8 linears an FP8 checkpoint."""
    if spec.fp8_activations and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise VExpertInputError(
            "model.expert_compute",
            f"w8a8 multiplies on FP8 tensor cores, and this GPU ({torch.cuda.get_device_name()}, compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}) has none (8.9+: Ada, Hopper, Blackwell)",
            "set model.expert_compute (--expert-compute) to w8a16",
        )
    if linear_format == "fp8_block" and spec.fp8_block is None:
        raise VExpertInputError(
            "model.linear_format",
            "fp8_block keeps a block-FP8 checkpoint's linear layers as stored, and this checkpoint's are not FP8 "
            "(no quantization_config weight_block_size)",
            "set model.linear_format (--linear-format) to dense, or serve a block-FP8 checkpoint",
        )
    if spec.fp8_activations and device == "cuda" and (spec.storage_block or (0, 0))[1] % 32:
        raise VExpertInputError(
            "model.expert_compute",
            f"w8a8 quantises activations per weight block column and FP8 dots want 32 or more of them: this "
            f"checkpoint's blocks are {spec.storage_block}",
            "set model.expert_compute (--expert-compute) to w8a16",
        )


def resolve_setup(config: RuntimeConfig, checkpoint: str | Path, cpu_workers: int | None = None) -> NodeSetup:
    """Validate ``config`` against the machine and the checkpoint; raise :class:`VExpertInputError`
    (one clear line, exit 2) on the first problem. Nothing is started here."""
    device = "cpu" if cpu_workers else config.runtime.device
    if device == "cuda" and not torch.cuda.is_available():
        raise VExpertInputError(
            "runtime.device",
            "cuda was requested but no CUDA device is visible",
            "set runtime.device: cpu and runtime.cpu_workers: N, or pass --cpu-workers N",
        )
    par = config.parallelism
    sharing = config.runtime.workers_per_gpu if device == "cuda" else 1
    if device == "cuda":
        visible = torch.cuda.device_count()
        needed = -(-par.gpus_per_node // sharing)
        if needed > visible:
            raise VExpertInputError(
                "parallelism.gpus_per_node",
                f"{par.gpus_per_node} worker GPUs per node ({sharing} per GPU) need {needed} GPUs, {visible} visible",
                "set gpus_per_node (and expert_parallel_size) to the GPUs this node sees",
            )
        local = par.gpus_per_node  # one worker per GPU: local rank i uses cuda:i (i // workers_per_gpu)
    else:
        local = cpu_workers or config.runtime.cpu_workers or par.gpus_per_node
    node_rank = resolve_node_rank(par.node_rank, par.num_nodes)
    world = par.num_nodes * local
    expert_format: str = config.model.expert_format
    if expert_format == "auto" and device == "cpu" and config.model.expert_compute != "w8a8":
        # No CPU kernel reads FP8 rows: each step would dequantise every stack (a block-FP8 checkpoint served 12x
        # slower, benchmarks/README.md §10 run 26), so CPU ranks keep dense rows unless fp8_block (or w8a8, which
        # multiplies FP8 rows) is asked for.
        expert_format = DENSE
    raw = read_model_spec(checkpoint, config.model.architecture)
    stored = resolve_expert_storage(raw, expert_format)
    spec = resolve_expert_storage(raw, expert_format, resolve_expert_compute(config.model.expert_compute, stored, device))
    check_fp8_options(spec, config.model.linear_format, device)
    CheckpointReader(checkpoint, spec).validate()
    if spec.num_experts % world:
        raise VExpertInputError(
            "runtime.cpu_workers" if device == "cpu" else "parallelism.expert_parallel_size",
            f"{spec.num_experts} experts cannot be split evenly over {world} EP ranks",
            "use a rank count that divides the expert count",
        )
    pooled = config.tuning.pooled_experts or spec.num_experts
    check_pooled(pooled, spec.num_experts)
    knobs = config.vexpert
    dtype: torch.dtype = getattr(torch, config.model.dtype)
    memory = memory_plan(spec, dtype, pooled, knobs.group_size * knobs.vmax, world, local, device)
    check_memory(memory, config.runtime.host_memory_limit_bytes)
    master_addr, master_port = rendezvous_address(par.master_addr, par.master_port, par.num_nodes)
    if node_rank == 0 and par.master_port is not None:
        check_port_free(master_addr, master_port, "parallelism.master_port")
    if config.runtime.metrics_port:
        check_port_free("0.0.0.0", config.runtime.metrics_port, "runtime.metrics_port")
    policy = placement_policy(knobs.placement_policy)
    if knobs.dispatch == "auto" and policy.even_split:  # keep the even split that defines the policy
        dispatch, dispatch_reason = "plan", f"auto: {policy.name} splits an expert's tokens evenly over its copies"
    else:
        dispatch, dispatch_reason = choose_dispatch(
            knobs.dispatch, world=world, slots=knobs.group_size * knobs.vmax, nodes=par.num_nodes, device=device,
            allreduce_us=knobs.dispatch_allreduce_us, moe_layer_us=knobs.dispatch_moe_layer_us,
        )
    return NodeSetup(
        checkpoint=Path(checkpoint),
        spec=spec,
        linear_format=config.model.linear_format,
        dtype=config.model.dtype,
        device=device,
        local_workers=local,
        world=world,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        group_size=knobs.group_size,
        vmax=knobs.vmax,
        balance_threshold=knobs.balance_threshold,
        k=config.tuning.allocation_interval,
        pooled=pooled,
        metrics_port=config.runtime.metrics_port,
        slot_fill_timeout_s=config.runtime.slot_fill_timeout_s,
        workers_per_gpu=sharing,
        host_memory_limit_bytes=config.runtime.host_memory_limit_bytes,
        profile=config.profile,
        memory=memory,
        dispatch=dispatch,
        dispatch_reason=dispatch_reason,
        placement_policy=policy.name,
    )


_ORDINAL = re.compile(r"-([0-9]+)\Z")  # a StatefulSet pod is <set>-<ordinal>


def resolve_node_rank(configured: int, num_nodes: int, environ: Mapping[str, str] | None = None) -> int:
    """This node's index in the group, from the first of:

    1. ``VEXPERT_NODE_RANK`` when set and not empty (the operator fills it from the pod's
       ``apps.kubernetes.io/pod-index`` label, which Kubernetes < 1.28 does not set: empty then);
    2. the StatefulSet ordinal ending ``VEXPERT_POD_NAME`` (the pod's name, ``<statefulset>-<i>``);
    3. the ordinal ending ``HOSTNAME`` — only inside Kubernetes (``KUBERNETES_SERVICE_HOST`` set),
       where a StatefulSet pod's hostname is its name; elsewhere a hostname like ``gpu-box-3`` says
       nothing about ranks;
    4. ``parallelism.node_rank`` from the config.

    A value that is not a non-negative integer, a pod name without an ordinal, or a rank ≥ the
    number of nodes raises :class:`VExpertInputError` naming its source (one line, exit 2).
    """
    env = os.environ if environ is None else environ
    raw = env.get("VEXPERT_NODE_RANK", "").strip()
    if raw:
        if not (raw.isascii() and raw.isdigit()):
            raise VExpertInputError(
                "VEXPERT_NODE_RANK", f"{raw!r} is not a node index", "set a non-negative integer, or leave it empty to use the pod name"
            )
        return _check_rank(int(raw), num_nodes, f"VEXPERT_NODE_RANK={raw}")
    pod = env.get("VEXPERT_POD_NAME", "").strip()
    if pod:
        match = _ORDINAL.search(pod)
        if match is None:
            raise VExpertInputError(
                "VEXPERT_POD_NAME",
                f"{pod!r} does not end in a StatefulSet ordinal (-N), so the node rank is unknown",
                "set VEXPERT_NODE_RANK, or run the node in the operator's StatefulSet",
            )
        return _check_rank(int(match.group(1)), num_nodes, f"VEXPERT_POD_NAME={pod}")
    host = env.get("HOSTNAME", "").strip()
    if host and env.get("KUBERNETES_SERVICE_HOST"):
        match = _ORDINAL.search(host)
        if match is not None:
            return _check_rank(int(match.group(1)), num_nodes, f"HOSTNAME={host}")
    return _check_rank(configured, num_nodes, "parallelism.node_rank")


def _check_rank(rank: int, num_nodes: int, source: str) -> int:
    if rank >= num_nodes:
        field = source.split("=", 1)[0]
        raise VExpertInputError(
            field,
            f"node rank {rank} (from {source}) ≥ number of nodes {num_nodes}",
            "parallelism.expert_parallel_size / gpus_per_node must match the node count",
        )
    return rank


def check_port_free(host: str, port: int, field: str) -> None:
    """Raise if ``host:port`` is a local address already in use (other hosts are not checked)."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise VExpertInputError(field, f"port {port} on {host} is already in use", "pick a free port") from None


def check_pooled(pooled: int, num_experts: int) -> None:
    if not 1 <= pooled <= num_experts:
        raise VExpertInputError(
            "tuning.pooled_experts",
            f"Np={pooled} does not fit the model's {num_experts} routed experts per layer",
            f"use 1 ≤ Np ≤ {num_experts} (or leave it unset for all)",
        )


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(memory: MemoryPlan, limit: int | None) -> None:
    """The pool and slots must fit the configured limit, the machine and (CPU) /dev/shm."""
    need = memory.host_bytes
    detail = (
        f"pool {memory.pool_bytes} B + {memory.workers} workers × (slots {memory.slot_bytes_per_worker} B"
        + (f" + base experts {memory.base_bytes_per_worker} B" if memory.device == "cpu" else "")
        + f") = {need} B"
    )
    if limit is not None and need > limit:
        raise VExpertInputError(
            "runtime.host_memory_limit_bytes",
            f"{detail} exceeds the limit of {limit} B",
            "lower tuning.pooled_experts or vexpert.vmax, or raise the limit",
        )
    available = _available_memory()
    if available is not None and need > available:
        raise VExpertInputError(
            "tuning.pooled_experts", f"{detail} exceeds the {available} B of memory available", "lower Np or vmax"
        )
    if memory.device == "cpu" and Path("/dev/shm").is_dir():
        shm_free = shutil.disk_usage("/dev/shm").free
        slots = memory.workers * memory.slot_bytes_per_worker
        if slots > shm_free:
            raise VExpertInputError(
                "vexpert.vmax",
                f"slot buffers need {slots} B of shared memory, /dev/shm has {shm_free} B free",
                "lower vmax or group_size, or enlarge /dev/shm",
            )



LOOPBACK = "127.0.0.1"


def rendezvous_address(master_addr: str, master_port: int | None, num_nodes: int) -> tuple[str, int]:
    """Where the workers' torch.distributed group meets: one node's group needs nobody outside the
    pod, so it meets on loopback (whatever the config names) and, unless the config pins a port, on
    a free one; a multi-node group meets at rank 0's address and the pinned (or default) port."""
    if num_nodes == 1:
        return LOOPBACK, master_port if master_port is not None else free_port()
    return master_addr, master_port if master_port is not None else DEFAULT_MASTER_PORT


def rendezvous_url(setup: NodeSetup) -> str:
    """The workers' ``init_method``: a single-node group meets in a file store in the temporary
    directory (torch's TCPStore listens on every interface whatever address it is given; a file
    store listens on none), named per group start so a restarted group never reads an old one;
    a multi-node group meets at rank 0's TCP address."""
    if setup.world == setup.local_workers:
        path = Path(tempfile.gettempdir()) / f"vexpert-rendezvous-{os.getpid()}-{uuid.uuid4().hex}"
        return f"file://{path}"
    return f"tcp://{setup.master_addr}:{setup.master_port}"


def single_node_environment(setup: NodeSetup) -> dict[str, str]:
    """Environment for the workers of a single-node group: gloo's pair sockets on the loopback
    interface (by default gloo listens on the address the host name resolves to)."""
    if setup.world != setup.local_workers or "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    return {"GLOO_SOCKET_IFNAME": loopback_interface()}


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux)."""
    import socket

    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"
