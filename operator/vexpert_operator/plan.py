"""One code path from a deployment spec (+ what the cluster knows) to the manifests of its group.

The operator calls :func:`plan_group` with inputs read from the API server; ``vexpert render``
calls it with inputs read from files. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.policy.profile import NodeTypeKey, PerformanceProfile, Provenance

from . import manifests as mf
from .api import VExpertDeploymentSpec
from .nodetypes import NodeType, node_type_name
from .sizing import MemoryFit, Sizing, memory_headroom, model_shape, size_pod
from .validation import Problem, check_fit

EPOCH = "1970-01-01T00:00:00+00:00"


def default_profile() -> PerformanceProfile:
    """The paper's defaults with a fixed timestamp (a moving one would change the config hash)."""
    return PerformanceProfile(provenance=Provenance(source="paper-defaults", created_at=EPOCH))


def combine_profiles(hardware: PerformanceProfile | None, model: PerformanceProfile | None,
                     node_key: NodeTypeKey | None = None) -> PerformanceProfile:
    """Hardware half from the node profile, load-balance half from the model profile. Deterministic."""
    base = default_profile()
    hw = hardware.hardware if hardware is not None else base.hardware
    lb = model.load_balance if model is not None else base.load_balance
    sources = [p for p in (model, hardware) if p is not None]
    provenance = Provenance(
        source=sources[0].provenance.source if sources else "paper-defaults",
        created_at=max((p.provenance.created_at for p in sources), default=EPOCH),
        tool_version=sources[0].provenance.tool_version if sources else "",
        node_type=(hardware.provenance.node_type if hardware is not None else None) or node_key,
        model=model.provenance.model if model is not None else "",
        model_revision=model.provenance.model_revision if model is not None else "",
        fit_r2=model.provenance.fit_r2 if model is not None else None,
    )
    return PerformanceProfile(load_balance=lb, hardware=hw, provenance=provenance)


@dataclass
class PlanInputs:
    name: str
    namespace: str
    spec: VExpertDeploymentSpec
    uid: str = ""
    node_type: NodeType | None = None
    node_key: NodeTypeKey | None = None
    node_memory_bytes: int | None = None  # offline (render): a node profile's allocatable memory
    keep_cap: int | None = None  # the running group's Np_cap: kept while it fits (sizing.size_pod)
    profile: PerformanceProfile = field(default_factory=default_profile)
    allocation_interval: int | None = None  # current k (tuned); None = the spec's starting value
    pooled_experts: int | None = None  # current Np (tuned); None = the cap
    draining: bool = False  # the group is being re-formed: StatefulSet at 0 replicas until no pod is left
    drained_nodes: tuple[str, ...] = ()  # cordoned nodes running a rank: the PDB lets one rank go


@dataclass
class GroupPlan:
    sizing: Sizing
    allocation_interval: int
    pooled_experts: int
    runtime_config: RuntimeConfig
    config_hash: str
    template_hash: str
    config_map: dict[str, Any]
    service: dict[str, Any]
    api_service: dict[str, Any]
    statefulset: dict[str, Any]
    pdb: dict[str, Any]
    problems: list[Problem]

    @property
    def children(self) -> list[dict[str, Any]]:
        """In apply order: the config and Services before the pods that need them."""
        return [self.config_map, self.service, self.api_service, self.statefulset, self.pdb]


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def plan_group(inputs: PlanInputs) -> GroupPlan:
    """Everything the group needs. The spec must have passed :func:`validate_spec`."""
    spec = inputs.spec
    shape = model_shape(spec)
    if shape is None:
        raise ValueError("spec.model.shape: required when architecture is auto")
    node_key = inputs.node_type.key if inputs.node_type is not None else inputs.node_key
    fit = memory_fit(inputs)
    sizing = size_pod(spec, shape, fit, inputs.keep_cap)

    k_spec = spec.vexpert.allocation_interval
    if k_spec.mode == "fixed" or inputs.allocation_interval is None:
        k = k_spec.value
    else:
        k = clamp(inputs.allocation_interval, k_spec.min, k_spec.max)
    np_spec = spec.vexpert.pinned_experts
    if np_spec.mode == "fixed" and np_spec.value is not None:
        pooled = np_spec.value
    elif inputs.pooled_experts is None:
        pooled = sizing.pooled_experts_cap
    else:
        pooled = clamp(inputs.pooled_experts, min(np_spec.min, sizing.pooled_experts_cap), sizing.pooled_experts_cap)

    owner = mf.owner_reference(inputs.name, inputs.uid)
    config = mf.build_runtime_config(spec, inputs.name, inputs.namespace, inputs.profile, k, pooled, sizing)
    cfg_hash = mf.config_hash(config)
    template = mf.build_pod_template(inputs.name, spec, sizing, cfg_hash, node_key)
    return GroupPlan(
        sizing=sizing,
        allocation_interval=k,
        pooled_experts=pooled,
        runtime_config=config,
        config_hash=cfg_hash,
        template_hash=mf.template_hash(template),
        config_map=mf.build_config_map(inputs.name, inputs.namespace, config, owner),
        service=mf.build_service(inputs.name, inputs.namespace, spec, owner),
        api_service=mf.build_api_service(inputs.name, inputs.namespace, spec, owner),
        statefulset=mf.build_statefulset(inputs.name, inputs.namespace, spec, template, owner,
                                         replicas=0 if inputs.draining else None),
        pdb=mf.build_pdb(inputs.name, inputs.namespace, spec, owner, inputs.drained_nodes),
        problems=check_fit(spec, sizing, fit, *_gpu(inputs)),
    )


def memory_fit(inputs: PlanInputs) -> MemoryFit | None:
    """The figure the pod is sized from: the type's nodes as the cluster reports them (operator),
    else the node profile's allocatable memory with nothing known to run there (render)."""
    headroom = memory_headroom(inputs.spec)
    if inputs.node_type is not None:
        return inputs.node_type.memory_fit(inputs.spec.parallelism.num_nodes, headroom)
    if inputs.node_memory_bytes:
        return MemoryFit(node="", allocatable=inputs.node_memory_bytes, requested=0, headroom=headroom)
    return None


def _gpu(inputs: PlanInputs) -> tuple[int, str, str]:
    """(GPU memory MiB, GPU product, type name) for the GPU-memory check; zeros when unknown."""
    if inputs.node_type is not None:
        return inputs.node_type.gpu_memory_mib, inputs.node_type.key.gpu_product, inputs.node_type.name
    key = inputs.node_key
    if key is None:
        return 0, "", ""
    return key.gpu_memory_mib, key.gpu_product, node_type_name(key)
