"""Node typing: which GPU nodes are "the same" for calibration, and where a deployment can land.

A node type is identified by GPU product, GPU count, driver version and instance type, read from
the labels NVIDIA GPU feature discovery sets. A new driver version is a new type, so it gets
recalibrated. GPU memory (``nvidia.com/gpu.memory``) is read but is not part of the identity: the
product already names the GPU, and the label moves by a few MiB with ECC mode and driver
reservations; were it part of the identity (name, node affinity, runtime config), a node reporting
a little less would split the type and roll a healthy group. Host memory is never part of it
either: sizing takes a figure from the type's nodes (:meth:`NodeType.memory_fit`) that the
caller keeps stable. Pure functions over plain node dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vexpert_runtime.policy.profile import NodeTypeKey

from .api import Toleration
from .naming import bounded_name, label_value
from .quantity import parse_bytes
from .sizing import MemoryFit

GPU_PRODUCT = "nvidia.com/gpu.product"
GPU_COUNT = "nvidia.com/gpu.count"
GPU_MEMORY = "nvidia.com/gpu.memory"
DRIVER_FULL = "nvidia.com/cuda.driver-version.full"
DRIVER_PARTS = ("nvidia.com/cuda.driver-version.major", "nvidia.com/cuda.driver-version.minor",
                "nvidia.com/cuda.driver-version.revision")
DRIVER_PARTS_OLD = ("nvidia.com/cuda.driver.major", "nvidia.com/cuda.driver.minor", "nvidia.com/cuda.driver.rev")
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
INSTANCE_TYPE_BETA = "beta.kubernetes.io/instance-type"
GPU_RESOURCE = "nvidia.com/gpu"


def _int(value: str | None) -> int:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return 0


def driver_version(labels: Mapping[str, str]) -> str:
    if labels.get(DRIVER_FULL):
        return labels[DRIVER_FULL]
    for keys in (DRIVER_PARTS, DRIVER_PARTS_OLD):
        parts = [labels.get(k, "") for k in keys]
        if parts[0]:
            return ".".join(p for p in parts if p)
    return ""


def node_type_key(labels: Mapping[str, str]) -> NodeTypeKey | None:
    """The node's type, or None for nodes without a GPU product label."""
    product = labels.get(GPU_PRODUCT, "")
    if not product:
        return None
    return NodeTypeKey(
        gpu_product=product,
        gpu_count=_int(labels.get(GPU_COUNT)),
        gpu_memory_mib=_int(labels.get(GPU_MEMORY)),
        driver_version=driver_version(labels),
        instance_type=labels.get(INSTANCE_TYPE) or labels.get(INSTANCE_TYPE_BETA, ""),
    )


def identity(key: NodeTypeKey) -> NodeTypeKey:
    """The part of a key that makes a type: the key without GPU memory (see the module docstring)."""
    return key.model_copy(update={"gpu_memory_mib": 0})


def node_type_name(key: NodeTypeKey) -> str:
    """A DNS-1123 name (≤ 63) for the type: readable prefix + hash of the key's identity."""
    prefix = f"{key.gpu_product}-{key.gpu_count}x"
    return bounded_name(prefix, identity(key).model_dump(), 63)


def _is(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": [label_value(value)]}


def _absent(key: str) -> dict[str, Any]:
    return {"key": key, "operator": "DoesNotExist"}


def _driver_options(version: str) -> list[list[dict[str, Any]]]:
    """Each way :func:`driver_version` can have read ``version`` from a node's labels."""
    if not version:
        return [[_absent(DRIVER_FULL), _absent(DRIVER_PARTS[0]), _absent(DRIVER_PARTS_OLD[0])]]
    parts = version.split(".")
    options = [[_is(DRIVER_FULL, version)]]
    if len(parts) <= 3:
        for labels, guard in ((DRIVER_PARTS, [_absent(DRIVER_FULL)]),
                              (DRIVER_PARTS_OLD, [_absent(DRIVER_FULL), _absent(DRIVER_PARTS[0])])):
            pinned = [_is(k, v) if i < len(parts) else _absent(k) for i, (k, v) in
                      enumerate(zip(labels, [*parts, "", ""][:3], strict=True))]
            options.append(guard + pinned)
    return options


def node_type_terms(key: NodeTypeKey) -> list[list[dict[str, Any]]]:
    """Required node-affinity terms that match exactly the nodes of this type: ORed terms of ANDed
    expressions, one per label generation the key may have been read from (GFD's full or split
    driver labels, the GA or beta instance-type label); a field the key lacks must be absent, or
    a type without an instance type would also match every other instance type. GPU memory is not
    matched: it is no part of the type's identity."""
    common = [_is(GPU_PRODUCT, key.gpu_product)]
    if key.gpu_count:
        common.append(_is(GPU_COUNT, str(key.gpu_count)))
    if key.instance_type:
        instance = [[_is(INSTANCE_TYPE, key.instance_type)],
                    [_absent(INSTANCE_TYPE), _is(INSTANCE_TYPE_BETA, key.instance_type)]]
    else:
        instance = [[_absent(INSTANCE_TYPE), _absent(INSTANCE_TYPE_BETA)]]
    return [common + driver + inst for driver in _driver_options(key.driver_version) for inst in instance]


@dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str]
    key: NodeTypeKey | None  # the full key (GPU memory included); the type is its identity()
    type_name: str
    allocatable_memory: int
    allocatable_gpus: int | None  # None: the node does not report nvidia.com/gpu
    ready: bool
    unschedulable: bool
    taints: tuple[Mapping[str, Any], ...] = ()
    requested_memory: int = 0  # memory requests of the pods bound here that are not the deployment's own

    @property
    def free_memory(self) -> int:
        return max(0, self.allocatable_memory - self.requested_memory)

    @property
    def gpu_memory_mib(self) -> int:
        return self.key.gpu_memory_mib if self.key is not None else 0


def pod_memory_request(pod: Mapping[str, Any]) -> int:
    """The memory a pod holds on its node for the scheduler: the larger of its containers' sum and
    its largest init container, plus the pod overhead (RuntimeClass). A container with a limit but
    no request requests its limit (the API server defaults it so)."""
    spec = pod.get("spec") or {}

    def memory(container: Mapping[str, Any]) -> int:
        res = container.get("resources") or {}
        value = (res.get("requests") or {}).get("memory") or (res.get("limits") or {}).get("memory") or 0
        try:
            return parse_bytes(value)
        except ValueError:
            return 0

    containers = sum(memory(c) for c in spec.get("containers") or [])
    init = max((memory(c) for c in spec.get("initContainers") or []), default=0)
    try:
        overhead = parse_bytes((spec.get("overhead") or {}).get("memory") or 0)
    except ValueError:
        overhead = 0
    return max(containers, init) + overhead


def memory_requested_by_node(pods: Iterable[Mapping[str, Any]], exclude: Mapping[str, str] | None = None,
                             exclude_namespace: str = "") -> dict[str, int]:
    """Node name → memory requested by the pods bound there and not finished (what the scheduler
    counts against allocatable: DaemonSets, system pods, other workloads). Pods in
    ``exclude_namespace`` whose labels contain ``exclude`` are left out: the deployment's own pods
    are what is being sized."""
    used: dict[str, int] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if exclude and meta.get("namespace", "") == exclude_namespace and \
                all(labels.get(k) == v for k, v in exclude.items()):
            continue
        used[node] = used.get(node, 0) + pod_memory_request(pod)
    return used


def node_info(node: Mapping[str, Any], requested_memory: int = 0) -> NodeInfo:
    meta = node.get("metadata", {}) or {}
    labels = dict(meta.get("labels") or {})
    status = node.get("status", {}) or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    key = node_type_key(labels)
    try:
        memory = parse_bytes(alloc.get("memory", 0))
    except ValueError:
        memory = 0
    spec = node.get("spec", {}) or {}
    return NodeInfo(
        name=meta.get("name", ""),
        labels=labels,
        key=key,
        type_name=node_type_name(key) if key else "",
        allocatable_memory=memory,
        allocatable_gpus=_int(alloc[GPU_RESOURCE]) if GPU_RESOURCE in alloc else None,
        ready=ready,
        unschedulable=bool(spec.get("unschedulable")),
        taints=tuple(spec.get("taints") or ()),
        requested_memory=requested_memory,
    )


def tolerates(tolerations: Sequence[Toleration], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' toleration matching for one taint."""
    for tol in tolerations:
        if tol.effect and tol.effect != taint.get("effect"):
            continue
        if (tol.operator or "Equal") == "Exists":
            if not tol.key or tol.key == taint.get("key"):
                return True
        elif tol.key == taint.get("key") and (tol.value or "") == (taint.get("value") or ""):
            return True
    return False


def node_fits(node: NodeInfo, node_selector: Mapping[str, str], tolerations: Sequence[Toleration],
              gpus_per_node: int, *, cordoned_ok: bool = False) -> bool:
    """Could a node pod of this deployment run here (ignoring other pods)? ``cordoned_ok``: judge a
    cordoned node as if it were not (it may still run the group's pods)."""
    if node.key is None or (node.unschedulable and not cordoned_ok):
        return False
    if any(node.labels.get(k) != v for k, v in node_selector.items()):
        return False
    # allocatable wins when the device plugin reports it (0 = every GPU unhealthy); the label otherwise
    gpus = node.allocatable_gpus if node.allocatable_gpus is not None else node.key.gpu_count
    if gpus < gpus_per_node:
        return False
    hard = [t for t in node.taints if t.get("effect") in ("NoSchedule", "NoExecute")]
    return all(tolerates(tolerations, t) for t in hard)


@dataclass
class NodeType:
    """All nodes of one type that a deployment can land on: ``nodes`` schedulable, ``cordoned`` not
    (new pods cannot land there, the group's running pods may still be there)."""

    name: str
    key: NodeTypeKey  # the identity (no GPU memory): what affinity, profiles and the runtime config carry
    nodes: list[NodeInfo] = field(default_factory=list)
    cordoned: list[NodeInfo] = field(default_factory=list)

    @property
    def ready_nodes(self) -> int:
        """Ready, schedulable nodes: where a (re-)formed group can start now."""
        return sum(1 for n in self.nodes if n.ready)

    @property
    def min_allocatable_memory(self) -> int:
        # Cordoned nodes count: cordoning changes no node's memory.
        values = [n.allocatable_memory for n in (*self.nodes, *self.cordoned) if n.allocatable_memory > 0]
        return min(values) if values else 0

    @property
    def gpu_memory_mib(self) -> int:
        """The smallest GPU memory a node of the type reports (0: unknown)."""
        values = [n.gpu_memory_mib for n in (*self.nodes, *self.cordoned) if n.gpu_memory_mib > 0]
        return min(values) if values else 0

    def memory_fit(self, needed_nodes: int, headroom: int) -> MemoryFit | None:
        """The memory figure a node pod is sized from: the node with the ``needed_nodes``-th most
        free memory (allocatable minus other pods' requests), so that ``needed_nodes`` nodes of the
        type can hold the group; the scheduler places the pods on those. Cordoned nodes count only
        when there are not enough others (the group's pods may still run there). None: no node
        reports memory."""
        pool = [n for n in self.nodes if n.allocatable_memory > 0]
        if len(pool) < needed_nodes:
            pool += [n for n in self.cordoned if n.allocatable_memory > 0]
        if not pool:
            return None
        ranked = sorted(pool, key=lambda n: (-n.free_memory, n.name))
        node = ranked[min(needed_nodes, len(ranked)) - 1]
        return MemoryFit(node=node.name, allocatable=node.allocatable_memory, requested=node.requested_memory,
                         headroom=headroom)


def candidate_types(nodes: Iterable[NodeInfo], node_selector: Mapping[str, str],
                    tolerations: Sequence[Toleration], gpus_per_node: int) -> dict[str, NodeType]:
    """Group the nodes a deployment fits on by type (name → NodeType), sorted by name. A type
    exists if one of its fitting nodes is schedulable (it can be calibrated and started on)."""
    found: dict[str, NodeType] = {}
    cordoned: list[NodeInfo] = []
    for node in nodes:
        if node.key is None or not node_fits(node, node_selector, tolerations, gpus_per_node, cordoned_ok=True):
            continue
        if node.unschedulable:
            cordoned.append(node)
            continue
        entry = found.setdefault(node.type_name, NodeType(name=node.type_name, key=identity(node.key)))
        entry.nodes.append(node)
    for node in cordoned:
        if node.type_name in found:
            found[node.type_name].cordoned.append(node)
    return dict(sorted(found.items()))


def choose_node_type(candidates: Mapping[str, NodeType], needed_nodes: int, current: str = "") -> str | None:
    """The type the group is pinned to. None if there is none.

    Keep the current type while its nodes (cordoned ones included: they may run the group's pods)
    can hold the group, and also when no other type could (moving would roll the group for
    nothing). Otherwise the type with the most Ready schedulable nodes (then most nodes, then name).
    """
    if not candidates:
        return None
    held = candidates.get(current)
    if held is not None and len(held.nodes) + len(held.cordoned) >= needed_nodes:
        return current
    best = min(candidates.values(), key=lambda t: (-t.ready_nodes, -len(t.nodes), t.name))
    if held is not None and best.ready_nodes < needed_nodes:
        return current
    return best.name
