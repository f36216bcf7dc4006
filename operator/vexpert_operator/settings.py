"""Operator-wide settings from the environment (``VEXPERT_OPERATOR_*``), read at start-up."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if env is None else env
        values = {}
        for name in cls.model_fields:
            key = PREFIX + name.upper()
            if key in env:
                values[name] = env[key]
        return cls.model_validate(values)
