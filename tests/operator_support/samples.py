"""Small builders of specs, nodes and pods for the operator's unit tests."""

from __future__ import annotations

import copy
from typing import Any

from vexpert_operator.api import VExpertDeploymentSpec

BASE_SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V3", "revision": "r1", "architecture": "deepseek_v3",
              "checkpoint": {"claimName": "weights", "subPath": "DeepSeek-V3"}},
    "parallelism": {"expertParallelSize": 64, "gpusPerNode": 8},
    "runtime": {"image": "ghcr.io/vexpert/vexpert-runtime:0.1.0", "memoryOverhead": "32Gi", "shmSize": "16Gi"},
}


def raw_spec(**overrides: Any) -> dict[str, Any]:
    """BASE_SPEC with ``section__field=value`` overrides (``None`` deletes the key)."""
    spec = copy.deepcopy(BASE_SPEC)
    for path, value in overrides.items():
        node = spec
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return spec


def spec(**overrides: Any) -> VExpertDeploymentSpec:
    return VExpertDeploymentSpec.model_validate(raw_spec(**overrides))


def gpu_node(name: str, product: str = "NVIDIA-H200", count: int = 8, memory_mib: int = 143771,
             driver: str = "550.54.15", instance: str = "p5en.48xlarge", allocatable: str = "2000Gi",
             ready: bool = True, taints: list[dict[str, Any]] | None = None, unschedulable: bool = False,
             extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count),
              "nvidia.com/gpu.memory": str(memory_mib), "nvidia.com/cuda.driver-version.full": driver,
              "node.kubernetes.io/instance-type": instance, **(extra_labels or {})}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints or [], "unschedulable": unschedulable},
        "status": {"allocatable": {"memory": allocatable, "nvidia.com/gpu": str(count)},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pod(name: str, uid: str, template_hash: str, phase: str = "Running", ready: bool = True, restarts: int = 0,
        terminating: bool = False, ip: str = "10.0.0.1") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid, "labels": {"vexpert.io/template-hash": template_hash}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase, "podIP": ip,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "node", "restartCount": restarts, "state": {"running": {}}}],
    }
    if restarts:
        status["containerStatuses"][0]["lastState"] = {
            "terminated": {"exitCode": 1, "reason": "Error", "message": "NCCL timeout"}}
    return {"metadata": meta, "status": status}
