"""Operator-wide settings from the environment (``VEXPERT_OPERATOR_*``), read at start-up."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import __version__

PREFIX = "VEXPERT_OPERATOR_"


class OperatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reconcile_interval_s: float = Field(30.0, gt=0, description="Level-triggered re-reconcile period per deployment")
    metrics_port: int = Field(8080, ge=0, le=65535, description="Operator /metrics port (0 = off)")
    scrape_timeout_s: float = Field(3.0, gt=0, description="Timeout of one runtime metrics scrape")
    scrape_max_bytes: int = Field(512 * 1024, gt=0, description="Largest runtime metrics body accepted")
    group_stable_s: float = Field(600.0, ge=0, description="A group formed this long resets its restart backoff")
    watch_reconnect_s: float = Field(0.5, gt=0, description="kopf: delay before re-opening a closed watch")
    leader_election: bool = Field(False, description="Run kopf only while holding the Lease (several replicas)")
    lease_namespace: str = Field("", description="Namespace of the Lease (default: the pod's own)")
    lease_duration_s: float = Field(15.0, ge=3, description="A standby takes over a Lease not renewed this long")
    # Calibration is the installer's business, not the tenants': hardware calibration is one Job per
    # node type for the whole cluster, in this namespace, whatever deployment asked for it.
    calibration_namespace: str = Field("vexpert-system", min_length=1,
                                       description="Namespace of the hardware calibration Jobs (the operator's)")
    calibration_image: str = Field(f"ghcr.io/vexpert/vexpert-runtime:{__version__}", min_length=1,
                                   description="Image of every calibration Job (hardware and model)")
    calibration_image_pull_policy: str = Field("IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    calibration_cpu: str = Field("8", description="CPU request = limit of a hardware calibration pod")
    calibration_memory: str = Field("64Gi", description="Memory request = limit of a hardware calibration pod")
    calibration_shm_size: str = Field("16Gi", description="/dev/shm of a hardware calibration pod")
    calibration_timeout_s: int = Field(1800, ge=60, description="activeDeadlineSeconds of a calibration Job")
    calibration_max_attempts: int = Field(5, ge=1, le=100, description="Failed attempts before giving up")
    calibration_retry_backoff_s: float = Field(30.0, gt=0, description="First retry delay after a failed Job")
    calibration_max_retry_backoff_s: float = Field(600.0, gt=0, description="Retry delay cap (doubles per failure)")
    calibration_runtime_class: str = Field("", description="RuntimeClass of hardware calibration pods")
    calibration_tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Tolerations of hardware calibration pods (JSON in the environment)",
    )

    @field_validator("calibration_tolerations", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if env is None else env
        values = {}
        for name in cls.model_fields:
            key = PREFIX + name.upper()
            if key in env:
                values[name] = env[key]
        return cls.model_validate(values)
