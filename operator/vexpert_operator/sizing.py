"""Memory sizing of a node pod and the largest pinned pool (Np) a node type allows. Pure functions.

A node pod pins ``Np × expert_bytes × L`` bytes of host memory (the pool vExperts are copied from)
and keeps ``/dev/shm`` as a memory-backed emptyDir; both count against the container's memory
limit, so the pod requests exactly ``pool(Np_cap) + shm + overhead`` (Guaranteed QoS). The tuner
may lower Np at run time but never above ``Np_cap``, so tuning never needs a bigger pod.

Headroom: the pod is sized into a node's allocatable memory minus what other pods bound there
already request (DaemonSets, system pods) minus ``runtime.memoryHeadroom`` (DaemonSets that arrive
later, requests that grow). A pod that filled allocatable would never schedule next to them.

Stability: Np_cap, once chosen, is kept while the pod still fits next to what runs now (the
headroom may be used up); a few GiB less on some node must not re-size, and so roll, a healthy
group. It is chosen anew when the spec changes or when the pod no longer fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from vexpert_runtime.model.expert_layout import DENSE, FP8_BLOCK, expert_row_bytes
from vexpert_runtime.model.families import FAMILIES, ModelFamily

from .api import ModelShape, VExpertDeploymentSpec
from .quantity import format_bytes_human, parse_bytes


def family_shape(family: ModelFamily, expert_format: str = DENSE, dtype: str = "bfloat16") -> ModelShape:
    """The shape of the family's published model (its registry ``reference``, e.g. DeepSeek-V3) with the
    bytes of one expert row stored as ``expert_format`` (dense: in ``dtype``)."""
    ref = family.reference
    return ModelShape(num_experts=ref.num_experts, num_moe_layers=ref.num_moe_layers, top_k=ref.top_k,
                      expert_bytes=expert_row_bytes(expert_format, ref.intermediate_size, ref.hidden_size, dtype))


# Every family's reference shape in bf16 (DeepSeek-V3: the paper's 84 MiB slot; 42 MiB as block FP8).
KNOWN_SHAPES: dict[str, ModelShape] = {name: family_shape(family) for name, family in FAMILIES.items()}


def model_shape(spec: VExpertDeploymentSpec) -> ModelShape | None:
    """The shape used for sizing: the spec's, else the architecture's known one with the bytes of
    one expert row in the runtime's storage format (``expertFormat``: fp8_block = FP8 weights and
    block scales; dense and auto = dtype, the upper bound since auto keeps dense checkpoints dense)."""
    if spec.model.shape is not None:
        return spec.model.shape
    family = FAMILIES.get(spec.model.architecture)
    if family is None:  # auto: the runtime reads the family from config.json
        return None
    fmt = FP8_BLOCK if spec.model.expert_format == FP8_BLOCK else DENSE
    return family_shape(family, fmt, spec.model.dtype)


def pinned_pool_bytes(pooled_experts: int, shape: ModelShape) -> int:
    """Host bytes one node pins for ``pooled_experts`` experts per layer."""
    return pooled_experts * shape.expert_bytes * shape.num_moe_layers


@dataclass(frozen=True)
class MemoryFit:
    """The memory figure a pod is sized from: one node's allocatable memory, the requests of the
    pods already bound there (not the deployment's own), and the headroom left free."""

    node: str  # "" offline (a node profile's allocatable memory, nothing known to run there)
    allocatable: int
    requested: int
    headroom: int

    @property
    def free(self) -> int:
        return max(0, self.allocatable - self.requested)

    @property
    def available(self) -> int:
        """What a new pod may take: free memory less the headroom."""
        return max(0, self.free - self.headroom)

    def describe(self) -> str:
        where = f"node {self.node}" if self.node else "the node profile"
        return (f"{where}: allocatable {format_bytes_human(self.allocatable)} − requested by other pods "
                f"{format_bytes_human(self.requested)} − headroom {format_bytes_human(self.headroom)} = "
                f"{format_bytes_human(self.available)} available")


@dataclass(frozen=True)
class Sizing:
    pooled_experts_cap: int
    pinned_pool_bytes: int
    shm_bytes: int
    overhead_bytes: int
    gpu_bytes_per_gpu: int
    kept: bool = False  # Np_cap is the running group's (it fits what is free; the headroom may be used up)

    @property
    def pod_memory_bytes(self) -> int:
        return self.pinned_pool_bytes + self.shm_bytes + self.overhead_bytes


def gpu_bytes_per_gpu(spec: VExpertDeploymentSpec, shape: ModelShape) -> int:
    """Expert weights a GPU holds: its base experts in every layer plus the G·Vmax vExpert slots
    (one buffer: the runtime streams layer-ahead into slots the previous layer does not use)."""
    base = shape.num_experts // spec.parallelism.expert_parallel_size
    slots = spec.vexpert.group_size * spec.vexpert.vmax
    return base * shape.num_moe_layers * shape.expert_bytes + slots * shape.expert_bytes


def np_bounds(spec: VExpertDeploymentSpec, shape: ModelShape) -> tuple[int, int]:
    """[min, max] of Np from the spec, clipped to the number of experts."""
    pe = spec.vexpert.pinned_experts
    if pe.mode == "fixed" and pe.value is not None:
        return pe.value, pe.value
    upper = min(pe.max or shape.num_experts, shape.num_experts)
    return min(pe.min, upper), upper


def memory_headroom(spec: VExpertDeploymentSpec) -> int:
    return parse_bytes(spec.runtime.memory_headroom)


def size_pod(spec: VExpertDeploymentSpec, shape: ModelShape, fit: MemoryFit | None,
             keep_cap: int | None = None) -> Sizing:
    """Choose Np_cap (as large as ``fit.available`` allows, within bounds) and size the pod.

    ``keep_cap`` (the cap the running group was sized with) is kept while it is within bounds and
    the pod still fits into the node's free memory, headroom or not (see the module docstring).
    With ``fit`` None (offline render without a node profile) Np_cap is the upper bound. The
    result may not fit; :func:`vexpert_operator.validation.check_fit` says so.
    """
    shm = parse_bytes(spec.runtime.shm_size)
    overhead = parse_bytes(spec.runtime.memory_overhead)
    low, high = np_bounds(spec, shape)
    per_expert = shape.expert_bytes * shape.num_moe_layers
    if fit is None or spec.vexpert.pinned_experts.mode == "fixed":
        cap = high
    elif keep_cap is not None and low <= keep_cap <= high and \
            pinned_pool_bytes(keep_cap, shape) + shm + overhead <= fit.free:
        cap = keep_cap
    else:
        room = fit.available - shm - overhead
        cap = max(low, min(high, room // per_expert if room > 0 else 0))
    return Sizing(
        kept=cap == keep_cap and fit is not None and spec.vexpert.pinned_experts.mode != "fixed",
        pooled_experts_cap=cap,
        pinned_pool_bytes=pinned_pool_bytes(cap, shape),
        shm_bytes=shm,
        overhead_bytes=overhead,
        gpu_bytes_per_gpu=gpu_bytes_per_gpu(spec, shape),
    )
