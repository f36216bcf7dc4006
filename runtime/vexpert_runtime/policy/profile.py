"""The calibrated parameters of vExpert's performance model (paper §3.2, Eq. 1–5 and 8).

``PerformanceProfile`` is the single API type for every model and hardware coefficient. It is
produced by ``vexpert calibrate``, stored by the operator (node profiles hold the hardware half,
model profiles the load-balance half) and read by the allocator, simulator and runtime via
``--profile FILE``. This module is pure pydantic: the operator imports it without torch.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vexpert_runtime.documents import Document, read_document, validation_error

PROFILE_API_VERSION: Literal["vexpert.io/v1alpha1"] = "vexpert.io/v1alpha1"
COEFFICIENT_LIMIT = 10  # |α|, |β|, |intercept| beyond this is a failed fit, not a model


class LoadBalanceParameters(BaseModel):
    """Model-specific coefficients of the balance-improvement model Δ(L, V) = α·L + β·V + c (Eq. 4).

    The paper calls the intercept ``k``; it is named ``intercept`` here so it cannot be confused
    with the allocation interval ``k`` (iterations between allocations).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    alpha: float = Field(-0.75, description="Δ slope in the current balance ratio L (dimensionless)", ge=-COEFFICIENT_LIMIT, le=COEFFICIENT_LIMIT)
    beta: float = Field(0.53, description="Δ slope in vExperts per GPU V (balance ratio per vExpert)", ge=-COEFFICIENT_LIMIT, le=COEFFICIENT_LIMIT)
    intercept: float = Field(0.1, description="Δ intercept (the paper's k), balance ratio units", ge=-COEFFICIENT_LIMIT, le=COEFFICIENT_LIMIT)


class HardwareParameters(BaseModel):
    """Node-type-specific coefficients: host→device bandwidth and PCIe contention (Eq. 2, 7, 8)."""

    # No inf/NaN: JSON cannot carry them (written as null, the file would not load back).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    h2d_bandwidth_gb_per_s: float = Field(
        26.0, gt=0, le=10_000, description="Achievable pinned host→device bandwidth per GPU under contention, GB/s (1e9 B/s)"
    )
    contention_eta: float = Field(
        0.19, ge=0, le=10, description="η: all-to-all time lost per second of concurrent H2D transfer (dimensionless)"
    )
    compute_bound_tokens_per_expert: float = Field(
        160.0, gt=0, description="Tokens per expert at and above which MoE GEMMs are compute-bound (γ2 = γ1)"
    )
    # Measured costs of the per-iteration control path (issue #14). Defaults: the graphed allocator
    # on an H200 (benchmarks §2: 0.5–0.65 ms), a small NCCL all-reduce over the EP group (a few
    # µs on NVLink, tens across nodes over InfiniBand), the dispatch kernel as measured below.
    allocator_time_s: float = Field(
        0.65e-3, ge=0, le=10, description="One allocation's mapping (the allocator itself, graphed on the GPU), s"
    )
    allreduce_latency_s: float = Field(
        30e-6, ge=0, le=10, description="Latency of one small all-reduce over the EP group, s"
    )
    allreduce_bandwidth_gb_per_s: float = Field(
        40.0, gt=0, le=10_000, description="All-reduce bus bandwidth over the EP group for larger payloads, GB/s"
    )
    # Measured on an H200 (benchmarks/README.md, "Cost per layer"): the counts and the fused kernel at
    # DeepSeek-V3 shape (EP64, 2 slots/GPU) add 14.4-15.2 µs per layer to the replica choice in a CUDA graph.
    dispatch_time_per_layer_s: float = Field(
        15e-6, ge=0, le=10, description="Per-iteration replica dispatch (shares from the batch's counts) per layer, s"
    )
    hbm_gb: float = Field(
        80.0, ge=0, le=100_000, description="HBM per GPU, GB (1e9 B); 0 = do not model the KV cache"
    )


class NodeTypeKey(BaseModel):
    """What makes two GPU nodes the same type for calibration (GPU feature discovery labels)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_product: str = ""
    gpu_count: int = 0
    gpu_memory_mib: int = 0
    driver_version: str = ""
    instance_type: str = ""


class Provenance(BaseModel):
    """Where a profile came from, so a stale or foreign one can be recognised."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["paper-defaults", "hardware-calibration", "model-calibration", "manual"] = "paper-defaults"
    created_at: str = Field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    tool_version: str = ""
    node_type: NodeTypeKey | None = None
    model: str = ""
    model_revision: str = ""
    fit_r2: float | None = Field(None, description="R² of the Δ(L, V) least-squares fit (model calibration)")
    measurements: dict[str, Any] = Field(default_factory=dict, description="Raw measurements (kept small)")


class PerformanceProfile(BaseModel):
    """Every parameter of the performance model, with units, plus provenance.

    Defaults are the paper's H100 figures (α=−0.75, β=0.53, intercept 0.1, BW_H2D=26 GB/s,
    η=0.19, compute-bound threshold 160 tokens per expert).
    """

    model_config = ConfigDict(extra="forbid")

    api_version: Literal["vexpert.io/v1alpha1"] = PROFILE_API_VERSION
    load_balance: LoadBalanceParameters = Field(default_factory=LoadBalanceParameters)
    hardware: HardwareParameters = Field(default_factory=HardwareParameters)
    provenance: Provenance = Field(default_factory=Provenance)

    def with_hardware(self, hardware: HardwareParameters) -> PerformanceProfile:
        return self.model_copy(update={"hardware": hardware})

    def with_load_balance(self, load_balance: LoadBalanceParameters) -> PerformanceProfile:
        return self.model_copy(update={"load_balance": load_balance})

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def parameters_json(self) -> str:
        """The model's parameters alone (no provenance): what a plan depends on, so two profiles with
        the same figures made at different times key the same compiled allocator."""
        return self.model_dump_json(include={"load_balance", "hardware"})


PROFILE_FIX = "pass a JSON file written by `vexpert calibrate … --output FILE`"


def load_profile(path: str | Path) -> PerformanceProfile:
    """Read a ``PerformanceProfile`` JSON file; bad files raise ``VExpertInputError`` naming the
    file, the line and the field."""
    document = read_document(path, "--profile", PROFILE_FIX, fmt="json")
    return parse_profile(document.data, origin=str(document.path), document=document)


def parse_profile(raw: Any, origin: str = "profile", document: Document | None = None) -> PerformanceProfile:
    try:
        return PerformanceProfile.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, origin, "see `PerformanceProfile` in runtime/vexpert_runtime/policy/profile.py",
                               document) from None
