"""Admission-style validation of a VExpertDeployment. Pure functions; every problem names its field.

Two layers: :func:`parse_spec` + :func:`validate_spec` need only the object (permanent errors: the
deployment is ``Invalid`` until its spec changes); :func:`check_fit` also needs the node type the
group is pinned to (pinned pool, /dev/shm and overhead within node memory; experts and slots
within GPU memory).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .api import QUANTITY_PATTERN, VExpertDeploymentSpec
from .manifests import API_KEY_ENV, OPERATOR_MOUNT_PATHS
from .naming import MAX_DEPLOYMENT_NAME
from .nodetypes import GPU_RESOURCE
from .quantity import MIB, format_bytes_human
from .sizing import MemoryFit, Sizing, model_shape

RESERVED_ENV = {"VEXPERT_NODE_RANK", "VEXPERT_CONFIG", "VEXPERT_POD_NAME", "VEXPERT_NUM_NODES"}
# Sized by the operator from the spec (pinned pool, GPUs per node, runtime.cpu); extraResources may not override.
SIZED_RESOURCES = ("cpu", "memory", GPU_RESOURCE)
# The Service and StatefulSet take the deployment's name as a prefix: a DNS-1035 label
# (a resource name alone may also contain dots or start with a digit, which they refuse).
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(QUANTITY_PATTERN)


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _loc(loc: tuple[Any, ...]) -> str:
    out = "spec"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def parse_spec(raw: Mapping[str, Any]) -> tuple[VExpertDeploymentSpec | None, list[Problem]]:
    """Parse ``.spec`` (camelCase) into the model; schema errors become problems naming the field."""
    try:
        return VExpertDeploymentSpec.model_validate(dict(raw)), []
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(Problem(_loc(tuple(err["loc"])), msg))
        return None, problems


def validate_spec(spec: VExpertDeploymentSpec, name: str) -> list[Problem]:
    """Checks that need only the object itself."""
    problems: list[Problem] = []
    par = spec.parallelism
    if len(name) > MAX_DEPLOYMENT_NAME:
        problems.append(Problem("metadata.name", f"at most {MAX_DEPLOYMENT_NAME} characters (pod names derive from it)"))
    if not DNS_1035_LABEL.match(name):
        problems.append(Problem("metadata.name", (
            f"{name!r}: use lower-case letters, digits and '-', starting with a letter "
            "(the node Service and StatefulSet are named after it)"
        )))
    if par.expert_parallel_size % par.gpus_per_node:
        problems.append(Problem(
            "spec.parallelism.expertParallelSize",
            f"{par.expert_parallel_size} is not a multiple of gpusPerNode {par.gpus_per_node}; use whole nodes",
        ))
    shape = model_shape(spec)
    if shape is None:
        problems.append(Problem(
            "spec.model.shape",
            "required when architecture is auto: the operator sizes memory before the checkpoint is read",
        ))
    elif shape.num_experts % par.expert_parallel_size:
        problems.append(Problem(
            "spec.parallelism.expertParallelSize",
            f"{shape.num_experts} experts per layer cannot be spread evenly over {par.expert_parallel_size} GPUs",
        ))

    k = spec.vexpert.allocation_interval
    if k.min > k.max:
        problems.append(Problem("spec.vexpert.allocationInterval.min", f"min {k.min} > max {k.max}"))
    elif not k.min <= k.value <= k.max:
        problems.append(Problem("spec.vexpert.allocationInterval.value", f"{k.value} outside [{k.min}, {k.max}]"))

    npx = spec.vexpert.pinned_experts
    if npx.mode == "fixed" and npx.value is None:
        problems.append(Problem("spec.vexpert.pinnedExperts.value", "required when mode is fixed"))
    if npx.max is not None and npx.min > npx.max:
        problems.append(Problem("spec.vexpert.pinnedExperts.min", f"min {npx.min} > max {npx.max}"))
    if shape is not None:
        e = shape.num_experts
        if npx.value is not None and npx.value > e:
            problems.append(Problem("spec.vexpert.pinnedExperts.value", f"Np {npx.value} > {e} experts per layer"))
        if npx.min > e:
            problems.append(Problem("spec.vexpert.pinnedExperts.min", f"Np min {npx.min} > {e} experts per layer"))
        if npx.max is not None and npx.max > e:
            problems.append(Problem("spec.vexpert.pinnedExperts.max", f"Np max {npx.max} > {e} experts per layer"))

    if spec.runtime.http_port == par.master_port:
        problems.append(Problem("spec.runtime.httpPort", f"clashes with parallelism.masterPort {par.master_port}"))
    for i, env in enumerate(spec.runtime.env):
        if env.name in RESERVED_ENV:
            problems.append(Problem(f"spec.runtime.env[{i}].name", f"{env.name} is set by the operator"))
        if env.value is not None and env.value_from is not None:
            problems.append(Problem(f"spec.runtime.env[{i}]", "set value or valueFrom, not both"))
        if env.name == API_KEY_ENV and spec.runtime.api_key_secret is not None:
            problems.append(Problem(f"spec.runtime.env[{i}].name", (
                f"{API_KEY_ENV} is set from runtime.apiKeySecret; remove this entry or apiKeySecret"
            )))
    problems += _mount_problems(spec.model.checkpoint.mount_path)
    problems += _extra_resource_problems(spec.runtime.extra_resources)
    calib = spec.calibration
    if calib.max_retry_backoff_seconds < calib.retry_backoff_seconds:
        problems.append(Problem("spec.calibration.maxRetryBackoffSeconds", "smaller than retryBackoffSeconds"))
    return problems


def _mount_problems(mount_path: str) -> list[Problem]:
    field = "spec.model.checkpoint.mountPath"
    if not mount_path.startswith("/"):
        return [Problem(field, f"{mount_path!r} is not an absolute path; use e.g. /models")]
    path = posixpath.normpath(mount_path)
    if path == "/":
        return [Problem(field, "'/' would hide the image's own files; use e.g. /models")]
    for reserved in OPERATOR_MOUNT_PATHS:
        if path == reserved or path.startswith(reserved + "/") or reserved.startswith(path + "/"):
            return [Problem(field, f"{mount_path!r} overlaps {reserved}, which the operator mounts; use e.g. /models")]
    return []


def _extra_resource_problems(extra: Mapping[str, str]) -> list[Problem]:
    problems = []
    for key, value in extra.items():
        field = f"spec.runtime.extraResources[{key}]"
        if key in SIZED_RESOURCES:
            problems.append(Problem(field, (
                f"{key} is sized by the operator (runtime.cpu, the pinned pool, parallelism.gpusPerNode); "
                "remove it here"
            )))
        elif not _QUANTITY.match(value):
            problems.append(Problem(field, f"{value!r} is not a Kubernetes quantity (e.g. '1', '500m', '2Gi')"))
        elif "/" in key and not value.isdigit():
            problems.append(Problem(field, f"{value!r}: an extended resource takes a whole number, e.g. '1'"))
    return problems


def check_fit(spec: VExpertDeploymentSpec, sizing: Sizing, fit: MemoryFit | None, gpu_memory_mib: int = 0,
              gpu_product: str = "", type_name: str = "") -> list[Problem]:
    """Does the pod fit the node's memory with headroom, and do experts + slots fit a GPU?

    The memory message names the fit: what the pod needs (pool + /dev/shm + overhead) against what
    the node has (allocatable − other pods' requests − headroom), and which node. A kept Np_cap
    (the running group's) needs only the free memory: the headroom is there to be used up.
    """
    problems: list[Problem] = []
    where = f"node type {type_name}" if type_name else "the node type"
    limit = (fit.free if sizing.kept else fit.available) if fit is not None else None
    if limit is not None and fit is not None and sizing.pod_memory_bytes > limit:
        npx = spec.vexpert.pinned_experts
        field = "spec.vexpert.pinnedExperts.value" if npx.mode == "fixed" else "spec.vexpert.pinnedExperts.min"
        problems.append(Problem(field, (
            f"the node pod does not fit {where}: it needs pinned pool "
            f"{format_bytes_human(sizing.pinned_pool_bytes)} (Np={sizing.pooled_experts_cap}) + /dev/shm "
            f"{format_bytes_human(sizing.shm_bytes)} + overhead {format_bytes_human(sizing.overhead_bytes)} = "
            f"{format_bytes_human(sizing.pod_memory_bytes)}, {fit.describe()}; lower Np, shmSize, memoryOverhead "
            "or runtime.memoryHeadroom, or use nodes with more memory"
        )))
    gpu_mem = gpu_memory_mib * MIB
    usable = spec.runtime.gpu_memory_utilization  # the rest of it is the weights', KV cache's and headroom's
    if gpu_mem and sizing.gpu_bytes_per_gpu > gpu_mem * usable:
        raise_it = " or raise runtime.gpuMemoryUtilization" if usable < 1 else ""
        problems.append(Problem("spec.vexpert.vmax", (
            f"base experts + G·Vmax slots need {format_bytes_human(sizing.gpu_bytes_per_gpu)} per GPU, more than "
            f"{usable:.0%} (runtime.gpuMemoryUtilization) of {format_bytes_human(gpu_mem)} on {gpu_product}; "
            f"raise expertParallelSize, lower vmax/groupSize{raise_it}"
        )))
    return problems


def format_problems(problems: list[Problem]) -> str:
    return "; ".join(str(p) for p in problems)
