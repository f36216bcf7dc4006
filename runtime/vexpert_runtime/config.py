"""``RuntimeConfig``: everything one node pod's ``vexpert node`` needs, as one pydantic model.

The operator renders it into a ConfigMap (``runtime.yaml``); the node runtime reads it at start and
re-reads the ``tuning`` section whenever the file changes (the operator tunes ``k`` and ``Np``
there). Pure pydantic, no torch: the operator imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from vexpert_runtime.documents import Document, read_document, validation_error
from vexpert_runtime.model.families import Architecture
from vexpert_runtime.policy.names import DEFAULT_PLACEMENT_POLICY, PLACEMENT_POLICY_HELP, PlacementPolicyName
from vexpert_runtime.policy.profile import PerformanceProfile

ComputeDtype = Literal["float32", "bfloat16", "float16"]
ExpertFormatChoice = Literal["auto", "dense", "fp8_block"]  # see expert_layout.py
ExpertComputeChoice = Literal["auto", "w8a16", "w8a8"]  # FP8 rows against activations of dtype, or FP8 ones too
LinearFormatChoice = Literal["dense", "fp8_block"]  # a block-FP8 checkpoint's non-expert linears: dequantised or kept
LINEAR_FORMAT_HELP = (
    "A block-FP8 checkpoint's non-expert linear layers (attention projections but MLA's kv_b_proj, shared experts, "
    "dense MLPs): dense = dequantised to the compute dtype at load (the default), fp8_block = kept FP8 with their "
    "block scales (half their HBM: ~14 GB less per DeepSeek-V3 rank, left to the KV cache; the GPU multiplies them "
    "with the expert GEMM's kernel, W8A16 — W8A8 under expert_compute w8a8; CPU ranks dequantise per call). Needs a "
    "block-FP8 checkpoint"
)
EXPERT_COMPUTE_HELP = (
    "How FP8 expert rows are multiplied: w8a16 = against activations of the compute dtype (the weights widened "
    "in the kernel), w8a8 = against activations quantised to FP8 per token and 128 columns (DeepSeek-V3's "
    "activation_scheme dynamic, as vLLM and SGLang serve its FP8 checkpoint; FP8 tensor cores and FP8 dispatch, "
    "13-18% shorter decode steps on an H100, ~5% off w8a16's outputs; GPUs of compute capability 8.9+, emulated on "
    "CPU ranks; needs FP8 rows: expert_format fp8_block, or auto on a block-FP8 checkpoint), auto (the default) = "
    "w8a8 where the rows are FP8 on such a GPU with 32+-column blocks, else w8a16. With linear_format fp8_block the "
    "other FP8 linear layers take the same activations"
)
DispatchChoice = Literal["auto", "plan", "local", "global"]  # see model/dispatch.py
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]  # vLLM's --kv-cache-dtype names; see serve/kv_cache.py
KV_CACHE_DTYPE_HELP = (
    "The serving KV cache's dtype (vLLM's --kv-cache-dtype): auto (the model's compute dtype), fp8 / fp8_e4m3 or "
    "fp8_e5m2 (half the bytes: twice the tokens in the same memory; rows stored unscaled, saturated to the format's "
    "range, as vLLM's FP8 cache without calibrated scales)"
)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GPU_MEMORY_UTILIZATION_HELP = (
    "Share of each GPU's memory a serving rank may fill, in (0, 1]; the paged KV cache gets what the weights, "
    "resident experts, slots and a 2 GiB headroom leave of it"
)


def gpu_memory_utilization_problem(value: Any) -> str:
    """The message for a ``gpu_memory_utilization`` outside (0, 1] (shared with the operator's spec)."""
    return (f"{value!r} is not a share in (0, 1]: set the fraction of each GPU's memory a rank may fill, "
            f"e.g. {DEFAULT_GPU_MEMORY_UTILIZATION} (the default)")


def check_gpu_memory_utilization(value: Any, handler: ValidatorFunctionWrapHandler) -> float:
    """Wrap validator of a ``gt=0, le=1`` float field: any failure (out of range, not a number, a
    boolean) becomes one message that says what the field is and what to set."""
    if isinstance(value, bool):  # YAML `true` would pass as 1.0
        raise ValueError(gpu_memory_utilization_problem(value))
    try:
        result: float = handler(value)
    except ValidationError:
        raise ValueError(gpu_memory_utilization_problem(value)) from None
    return result


class ModelSource(BaseModel):
    """Where the checkpoint lives inside the pod and what it is."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("demo", description="Human-readable model name, e.g. deepseek-ai/DeepSeek-V3")
    checkpoint_path: str = Field("", description="Directory with config.json and *.safetensors ('' = built-in demo model)")
    revision: str = Field("", description="Checkpoint revision (recorded in profiles and status)")
    architecture: Architecture = Field("auto", description="Routing family; auto = read model_type from config.json")
    dtype: ComputeDtype = Field(
        "bfloat16", description="Compute dtype (activations, dequantised weights) and the dtype of dense experts"
    )
    expert_format: ExpertFormatChoice = Field(
        "auto",
        description="Expert rows in pool and slots: auto = as the checkpoint stores them (block FP8 stays FP8 on GPU "
        "nodes; CPU nodes keep dense rows: no CPU kernel reads FP8), dense = in dtype (FP8 dequantised at load), "
        "fp8_block = FP8 (a dense checkpoint's quantised at load, 128x128 blocks)",
    )
    expert_compute: ExpertComputeChoice = Field("auto", description=EXPERT_COMPUTE_HELP)
    linear_format: LinearFormatChoice = Field("dense", description=LINEAR_FORMAT_HELP)


DEFAULT_MASTER_PORT = 29500  # the rendezvous port of a multi-node group whose config pins none


class ParallelismConfig(BaseModel):
    """Expert-parallel layout: EP degree = num_nodes × gpus_per_node."""

    model_config = ConfigDict(extra="forbid")

    expert_parallel_size: int = Field(8, ge=1, description="EP degree (ranks holding experts)")
    gpus_per_node: int = Field(8, ge=1, description="GPUs (worker ranks) per node pod")
    node_rank: int = Field(
        0, ge=0, description="This node's index; env VEXPERT_NODE_RANK, else the ordinal ending VEXPERT_POD_NAME, overrides"
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="Rendezvous host (rank 0's stable DNS name); a single-node group always uses 127.0.0.1",
    )
    master_port: int | None = Field(
        None, ge=1, le=65535,
        description=f"Rendezvous port on rank 0; unset: a free port on a single node, {DEFAULT_MASTER_PORT} across nodes",
    )

    @property
    def num_nodes(self) -> int:
        return self.expert_parallel_size // self.gpus_per_node

    @model_validator(mode="after")
    def _divisible(self) -> ParallelismConfig:
        if self.expert_parallel_size % self.gpus_per_node != 0:
            raise ValueError(
                f"expert_parallel_size {self.expert_parallel_size} is not a multiple of gpus_per_node "
                f"{self.gpus_per_node}; use whole nodes"
            )
        if self.node_rank >= self.expert_parallel_size // self.gpus_per_node:
            raise ValueError(f"node_rank {self.node_rank} ≥ number of nodes {self.num_nodes}")
        return self


class GroupKnobs(BaseModel):
    """vExpert's knobs a deployment sets that are fixed for the lifetime of a node group (changing them
    re-forms the group). Defined once: the runtime's ``vexpert`` section (:class:`VExpertKnobs`) and the
    operator's ``spec.vexpert`` (camelCase on the wire) both extend this class."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(2, ge=1, le=8, description="G: layers sharing one slot budget (ping-pong buffer)")
    vmax: int = Field(1, ge=0, le=8, description="Per-layer vExpert budget per GPU; slots per GPU = G·vmax")
    balance_threshold: float = Field(0.7, ge=0.0, le=1.0, description="τ: layers balanced above it get no vExperts")
    placement_policy: PlacementPolicyName = Field(DEFAULT_PLACEMENT_POLICY, description=PLACEMENT_POLICY_HELP)
    dispatch: DispatchChoice = Field(
        "auto",
        description="How a replicated expert's tokens split over its copies every layer: plan = the plan's shares "
        "(fixed for k iterations), local = water-filled from each rank's own counts of the iteration, global = from "
        "the counts all-reduced over the EP group (one 1 KiB all-reduce per layer); auto = global when that "
        "all-reduce costs less than the balance it gains, else local (plan without slots, and for a placement policy "
        "whose copies split evenly: eplb-redundant)",
    )

    def group_knobs(self) -> dict[str, Any]:
        """The values of :class:`GroupKnobs`' own fields (what the operator renders into ``runtime.yaml``)."""
        return {name: getattr(self, name) for name in GroupKnobs.model_fields}


class VExpertKnobs(GroupKnobs):
    """The runtime config's ``vexpert`` section: the group's knobs and the figures ``dispatch: auto``
    weighs (estimated for the device unless set)."""

    dispatch_allreduce_us: float | None = Field(
        None, ge=0, description="auto: latency of the per-layer counts all-reduce, µs (None = estimate for the device)"
    )
    dispatch_moe_layer_us: float | None = Field(
        None, gt=0, description="auto: an MoE layer's time at perfect balance, µs (None = estimate for the device)"
    )


class TuningConfig(BaseModel):
    """Knobs the operator tunes at run time; the runtime re-reads them when the file changes."""

    model_config = ConfigDict(extra="forbid")

    allocation_interval: int = Field(10, ge=1, le=100_000, description="k: decode iterations between allocations")
    pooled_experts: int | None = Field(
        None, ge=1, description="Np: experts per layer pinned in the host pool (None = all experts)"
    )


class RuntimeSettings(BaseModel):
    """Process-level settings of the node runtime."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cuda", "cpu"] = "cuda"
    cpu_workers: int = Field(0, ge=0, le=64, description="CPU worker processes (0 = one per visible GPU)")
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus endpoint port (0 = disabled)")
    slot_fill_timeout_s: float = Field(
        5.0, gt=0, description="An iteration the coordinator has not announced within it runs without its vExperts"
    )
    workers_per_gpu: int = Field(
        1,
        ge=1,
        le=8,
        description="Worker processes sharing one GPU (> 1 only to run several EP ranks on a host with fewer GPUs, "
        "e.g. to measure; their all-to-all then goes through host memory over gloo)",
    )
    host_memory_limit_bytes: int | None = Field(None, ge=0, description="Pinned pool + slots must fit (None = no check)")
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION, gt=0, le=1,
        description=GPU_MEMORY_UTILIZATION_HELP + " (`vexpert serve --gpu-memory-utilization` overrides it)",
    )

    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description=KV_CACHE_DTYPE_HELP + " (`vexpert serve --kv-cache-dtype` overrides it)")

    _gpu_memory_utilization = field_validator("gpu_memory_utilization", mode="wrap")(check_gpu_memory_utilization)


class RuntimeConfig(BaseModel):
    """The whole node configuration (ConfigMap ``runtime.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    api_version: Literal["vexpert.io/v1alpha1"] = "vexpert.io/v1alpha1"
    model: ModelSource = Field(default_factory=ModelSource)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    vexpert: VExpertKnobs = Field(default_factory=VExpertKnobs)
    tuning: TuningConfig = Field(default_factory=TuningConfig)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    profile: PerformanceProfile = Field(default_factory=PerformanceProfile)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


CONFIG_FIX = "pass the runtime.yaml the operator renders (`vexpert render -f deployment.yaml` prints one)"


def parse_runtime_config(raw: Any, origin: str = "config", document: Document | None = None) -> RuntimeConfig:
    """Validate a mapping into a ``RuntimeConfig``; errors name the field, and the line when
    ``document`` holds the file's text (``VExpertInputError``)."""
    try:
        return RuntimeConfig.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, origin, CONFIG_FIX, document) from None


def load_runtime_config(path: str | Path) -> RuntimeConfig:
    """Read YAML or JSON from ``path`` into a ``RuntimeConfig``."""
    document = read_document(path, "--config", CONFIG_FIX)
    return parse_runtime_config(document.data, origin=str(document.path), document=document)
