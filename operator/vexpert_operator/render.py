"""``vexpert render``: the manifests the operator would create for a VExpertDeployment, offline.

Same code path as the operator (:func:`vexpert_operator.plan.plan_group`); the cluster's knowledge
comes from files instead: ``--node-profile`` (a VExpertNodeProfile YAML or a bare PerformanceProfile
JSON with ``provenance.node_type``) pins the node type and its hardware coefficients,
``--model-profile`` (a VExpertModelProfile or a PerformanceProfile) the load-balance ones. Profiles
in the ``-f`` file itself are used the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vexpert_runtime.documents import read_document, read_documents
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.profile import NodeTypeKey, PerformanceProfile, parse_profile

from . import manifests as mf
from . import naming as nm
from .api import (
    API_VERSION,
    DEPLOYMENT_KIND,
    MODEL_PROFILE_KIND,
    NODE_PROFILE_KIND,
    VExpertModelProfileSpec,
    VExpertNodeProfileSpec,
)
from .nodetypes import node_type_name
from .plan import PlanInputs, combine_profiles, memory_fit, plan_group
from .quantity import format_bytes_human, parse_bytes
from .settings import OperatorSettings
from .validation import format_problems, parse_spec, validate_spec


@dataclass
class NodeProfileInput:
    key: NodeTypeKey | None
    profile: PerformanceProfile
    allocatable_memory: int | None = None
    origin: str = ""


@dataclass
class RenderResult:
    manifests: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_yaml(self) -> str:
        head = "".join(f"# {note}\n" for note in self.notes)
        return head + yaml.safe_dump_all(self.manifests, sort_keys=False, width=120)


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    return read_documents(path, "-f", "pass a VExpertDeployment manifest such as examples/qwen-moe-small.yaml")


def _node_profile_from_doc(doc: Mapping[str, Any], origin: str) -> NodeProfileInput:
    if doc.get("kind") == NODE_PROFILE_KIND:
        try:
            spec = VExpertNodeProfileSpec.model_validate(doc.get("spec") or {})
        except ValidationError as exc:
            raise VExpertInputError(f"{origin}: spec", str(exc.errors()[0]["msg"])) from None
        memory = parse_bytes(spec.allocatable_memory) if spec.allocatable_memory else None
        return NodeProfileInput(spec.node_type.to_key(), spec.profile, memory, origin)
    profile = parse_profile(doc, origin=origin)
    return NodeProfileInput(profile.provenance.node_type, profile, None, origin)


def _model_profile_from_doc(doc: Mapping[str, Any], origin: str) -> PerformanceProfile:
    if doc.get("kind") == MODEL_PROFILE_KIND:
        try:
            return VExpertModelProfileSpec.model_validate(doc.get("spec") or {}).profile
        except ValidationError as exc:
            raise VExpertInputError(f"{origin}: spec", str(exc.errors()[0]["msg"])) from None
    return parse_profile(doc, origin=origin)


def load_profile_file(path: str | Path, field: str = "--node-profile") -> dict[str, Any]:
    """A profile file, JSON or YAML (a ``VExpertNodeProfile``/``VExpertModelProfile`` or a bare profile)."""
    data: dict[str, Any] = read_document(path, field, "pass a profile written by `vexpert calibrate … --output FILE` "
                                         "or a VExpertNodeProfile such as examples/profiles/h200-node-profile.yaml").data
    return data


def render_deployment(doc: Mapping[str, Any], namespace: str | None, node_profile: NodeProfileInput | None,
                      model_profile: PerformanceProfile | None, model_profile_name: str = "") -> RenderResult:
    meta = doc.get("metadata") or {}
    name = meta.get("name") or ""
    if not name:
        raise VExpertInputError("metadata.name", "required")
    ns = namespace or meta.get("namespace") or "default"
    spec, problems = parse_spec(doc.get("spec") or {})
    if spec is not None:
        problems = validate_spec(spec, name)
    if problems or spec is None:
        raise VExpertInputError(f"{DEPLOYMENT_KIND} {name}", format_problems(problems))
    result = RenderResult()
    calib = spec.calibration
    hardware = node_profile.profile if node_profile else None
    if calib.mode == "given" and calib.profile is not None:
        hardware = hardware or calib.profile
        model_profile = model_profile or calib.profile
    node_key = node_profile.key if node_profile else None
    memory = node_profile.allocatable_memory if node_profile else None
    profile = combine_profiles(hardware, model_profile, node_key)
    inputs = PlanInputs(name=name, namespace=ns, spec=spec, node_key=node_key, node_memory_bytes=memory,
                        profile=profile)
    plan = plan_group(inputs)
    fit = memory_fit(inputs)
    result.notes.append(f"vexpert render: {DEPLOYMENT_KIND} {ns}/{name} ({spec.parallelism.num_nodes} node pods, "
                        f"k={plan.allocation_interval}, Np={plan.pooled_experts}, "
                        f"Np cap {plan.sizing.pooled_experts_cap}, pod memory "
                        f"{mf.format_mebibytes(plan.sizing.pod_memory_bytes)})")
    if node_profile is None:
        result.notes.append("no node profile: not pinned to a node type, hardware coefficients are the paper's "
                            "defaults; the operator calibrates the node type first (pass --node-profile)")
    else:
        type_name = node_type_name(node_key) if node_key else "(unknown type)"
        result.notes.append(f"node type {type_name} from {node_profile.origin}")
        if fit is None:
            result.notes.append("node memory unknown: Np is the spec's upper bound, not fitted to node memory")
        elif not plan.problems:
            result.notes.append(
                f"fits with headroom: pod {format_bytes_human(plan.sizing.pod_memory_bytes)} ≤ {fit.describe()} "
                "(the operator also subtracts what pods already bound to the node request)")
    if model_profile is None:
        result.notes.append("load-balance coefficients: paper defaults" +
                            ("; the operator first runs a model calibration Job (below)"
                             if calib.mode == "auto" and calib.traces else ""))
    else:
        result.notes.append(f"load-balance coefficients from {model_profile_name or 'the given profile'}")
    if plan.problems:
        raise VExpertInputError(f"{DEPLOYMENT_KIND} {name}", format_problems(plan.problems) +
                                " (the operator would set Invalid)")
    result.manifests.extend(plan.children)
    if calib.mode == "auto" and model_profile is None and calib.traces:
        key = nm.model_key(spec.model.name, spec.model.revision, mf.model_fit_inputs(spec))
        # the image and pull policy are the installer's; offline, the operator's defaults
        result.manifests.append(mf.build_model_calibration_job(ns, key, 1, spec, [], OperatorSettings()))
    return result


def render_file(path: str | Path, namespace: str | None = None, node_profile_file: str | None = None,
                model_profile_file: str | None = None) -> RenderResult:
    docs = load_documents(path)
    node_profiles = [_node_profile_from_doc(d, f"{path}: {NODE_PROFILE_KIND} {d.get('metadata', {}).get('name')}")
                     for d in docs if d.get("kind") == NODE_PROFILE_KIND]
    model_docs = [d for d in docs if d.get("kind") == MODEL_PROFILE_KIND]
    if node_profile_file:
        node_profiles.insert(0, _node_profile_from_doc(load_profile_file(node_profile_file), node_profile_file))
    model: PerformanceProfile | None = None
    model_name = ""
    if model_profile_file:
        model = _model_profile_from_doc(load_profile_file(model_profile_file, "--model-profile"), model_profile_file)
        model_name = model_profile_file
    deployments = [d for d in docs if d.get("kind") == DEPLOYMENT_KIND]
    if not deployments:
        raise VExpertInputError("-f", f"{path} holds no {DEPLOYMENT_KIND} ({API_VERSION})")
    out = RenderResult()
    for doc in deployments:
        dep_model, dep_model_name = model, model_name
        ref = ((doc.get("spec") or {}).get("calibration") or {}).get("modelProfileRef")
        if dep_model is None:
            for md in model_docs:
                if md.get("metadata", {}).get("name") == ref or (not ref and _matches_model(md, doc)):
                    dep_model = _model_profile_from_doc(md, str(path))
                    dep_model_name = f"{MODEL_PROFILE_KIND} {md['metadata']['name']}"
        part = render_deployment(doc, namespace, node_profiles[0] if node_profiles else None, dep_model,
                                 dep_model_name)
        out.notes.extend(part.notes)
        out.manifests.extend(part.manifests)
    return out


def _matches_model(model_doc: Mapping[str, Any], deployment: Mapping[str, Any]) -> bool:
    spec = model_doc.get("spec") or {}
    model = ((deployment.get("spec") or {}).get("model") or {})
    return bool(spec.get("model") == model.get("name") and spec.get("revision") == model.get("revision", "main"))


def dump_json(manifests: Iterable[Mapping[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}, indent=2)
