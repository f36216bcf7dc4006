"""The custom resources of group ``vexpert.io``, version ``v1alpha1``, as pydantic models.

These models are the single definition of the API: ``crds/*.yaml`` are generated from them
(``python -m vexpert_operator.crdgen``), the handlers parse ``spec`` with them, and ``vexpert render``
reads deployment files with them. Field names are snake_case in Python and camelCase in the API.

The performance model's coefficients are not redefined here: profiles embed
``vexpert_runtime.policy.profile.PerformanceProfile`` verbatim (snake_case JSON, exactly what
``vexpert calibrate`` writes and ``--profile FILE`` reads), so ``kubectl get vxnp NAME -o
jsonpath='{.spec.profile}'`` is a valid profile file.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from vexpert_runtime.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EXPERT_COMPUTE_HELP,
    GPU_MEMORY_UTILIZATION_HELP,
    KV_CACHE_DTYPE_HELP,
    LINEAR_FORMAT_HELP,
    ComputeDtype,
    ExpertComputeChoice,
    ExpertFormatChoice,
    GroupKnobs,
    KVCacheDtype,
    LinearFormatChoice,
    check_gpu_memory_utilization,
)
from vexpert_runtime.model.families import Architecture
from vexpert_runtime.policy.profile import NodeTypeKey, PerformanceProfile
from vexpert_runtime.serve.reasoning import ReasoningParser
from vexpert_runtime.serve.tool_calls import ToolCallParser
from vexpert_runtime.serve.waiting_queue import SchedulingPolicy

GROUP = "vexpert.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DEPLOYMENT_KIND = "VExpertDeployment"
DEPLOYMENT_PLURAL = "vexpertdeployments"
NODE_PROFILE_KIND = "VExpertNodeProfile"
NODE_PROFILE_PLURAL = "vexpertnodeprofiles"
MODEL_PROFILE_KIND = "VExpertModelProfile"
MODEL_PROFILE_PLURAL = "vexpertmodelprofiles"

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class CamelModel(BaseModel):
    """Base for API types: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# --------------------------------------------------------------------------------------------- model


class CheckpointSource(CamelModel):
    """Where the checkpoint is: a PersistentVolumeClaim (preferred) or a host path, mounted read-only."""

    claim_name: str | None = Field(None, description="PersistentVolumeClaim holding the checkpoint")
    host_path: str | None = Field(None, description="Host directory holding the checkpoint (instead of a claim)")
    sub_path: str = Field("", description="Directory inside the volume with config.json and *.safetensors")
    mount_path: str = Field("/models", description="Where the volume is mounted in the node pod")

    @model_validator(mode="after")
    def _one_source(self) -> CheckpointSource:
        if bool(self.claim_name) == bool(self.host_path):
            raise ValueError("set exactly one of claimName or hostPath")
        return self

    @property
    def path_in_pod(self) -> str:
        return f"{self.mount_path.rstrip('/')}/{self.sub_path}".rstrip("/") if self.sub_path else self.mount_path


class ModelShape(CamelModel):
    """The MoE shape the operator sizes memory from (the runtime reads the real one from config.json)."""

    num_experts: int = Field(..., ge=1, le=4096, description="Routed experts per MoE layer (E)")
    num_moe_layers: int = Field(..., ge=1, le=1024, description="MoE layers (L)")
    expert_bytes: int = Field(..., ge=1, description="Bytes of one routed expert's weights")
    top_k: int = Field(8, ge=1, le=64, description="Routed experts per token")


class ModelSpec(CamelModel):
    """The model: name, revision, checkpoint and routing family."""

    name: str = Field(..., min_length=1, max_length=253, description="Model name, e.g. deepseek-ai/DeepSeek-V3")
    revision: str = Field("main", min_length=1, max_length=128, description="Checkpoint revision (keys model profiles)")
    checkpoint: CheckpointSource
    architecture: Architecture = Field(
        "auto", description="Routing family; auto = the runtime reads model_type from config.json (then set shape)"
    )
    shape: ModelShape | None = Field(None, description="MoE shape; defaults to the architecture's known shape")
    dtype: ComputeDtype = Field(
        "bfloat16", description="Compute dtype, and the dtype of dense (unquantised) experts"
    )
    expert_format: ExpertFormatChoice = Field(
        "auto",
        description="Expert storage in pool and slots: fp8_block = FP8 rows (~half the bytes of bf16), a block-FP8 "
        "checkpoint's own (DeepSeek-V3/R1, Kimi-K2) or a dense checkpoint's experts quantised at load in 128x128 "
        "blocks; dense = dtype; auto follows the checkpoint but is sized as dense",
    )
    expert_compute: ExpertComputeChoice = Field("auto", description=EXPERT_COMPUTE_HELP)
    linear_format: LinearFormatChoice = Field("dense", description=LINEAR_FORMAT_HELP)

    @model_validator(mode="after")
    def _w8a8_needs_fp8_rows(self) -> ModelSpec:
        if self.expert_compute == "w8a8" and self.expert_format == "dense":
            raise ValueError("model.expertCompute: w8a8 multiplies FP8 expert rows and model.expertFormat is dense; "
                             "set expertFormat to fp8_block (or auto on a block-FP8 checkpoint), or expertCompute to w8a16")
        return self


# --------------------------------------------------------------------------------------- parallelism


class ParallelismSpec(CamelModel):
    """Expert-parallel layout. Node count = expertParallelSize / gpusPerNode (one pod per GPU node)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.expertParallelSize % self.gpusPerNode == 0",
                    "message": "expertParallelSize must be a multiple of gpusPerNode (whole nodes)",
                    "fieldPath": ".expertParallelSize",
                }
            ]
        }
    )

    expert_parallel_size: int = Field(..., ge=1, le=4096, description="EP degree (GPUs holding experts)")
    gpus_per_node: int = Field(8, ge=1, le=16, description="GPUs per node pod")
    master_port: int = Field(29500, ge=1024, le=65535, description="Rendezvous port on rank 0")

    @property
    def num_nodes(self) -> int:
        return max(1, self.expert_parallel_size // self.gpus_per_node)


# ------------------------------------------------------------------------------------------- vexpert


class AllocationIntervalSpec(CamelModel):
    """k: decode iterations between allocations. auto = tuned from runtime metrics within [min, max]."""

    mode: Literal["auto", "fixed"] = "auto"
    value: int = Field(10, ge=1, le=100_000, description="Fixed k, or the starting k when auto")
    min: int = Field(2, ge=1, le=100_000, description="Lower bound for auto")
    max: int = Field(1000, ge=1, le=100_000, description="Upper bound for auto")


class PinnedExpertsSpec(CamelModel):
    """Np: experts per layer pinned in host memory. auto = as many as node memory allows, within bounds."""

    mode: Literal["auto", "fixed"] = "auto"
    value: int | None = Field(None, ge=1, le=4096, description="Fixed Np (required when mode is fixed)")
    min: int = Field(1, ge=1, le=4096, description="Lower bound for auto")
    max: int | None = Field(None, ge=1, le=4096, description="Upper bound for auto (default: all experts)")


class VExpertSpec(CamelModel, GroupKnobs):
    """vExpert's knobs (paper §3): G, Vmax, τ are fixed for a group's lifetime; k and Np are tunable."""

    # groupSize, vmax, balanceThreshold, dispatch: the runtime's GroupKnobs, defined there once
    allocation_interval: AllocationIntervalSpec = Field(default_factory=AllocationIntervalSpec)
    pinned_experts: PinnedExpertsSpec = Field(default_factory=PinnedExpertsSpec)
    tuning_interval_seconds: int = Field(60, ge=1, le=86_400, description="Seconds between tuning decisions")


# --------------------------------------------------------------------------------------- calibration


class CalibrationSpec(CamelModel):
    """How the performance profile is obtained.

    auto: have every candidate node type without a VExpertNodeProfile calibrated (one hardware Job per
    node type for the whole cluster, run by the operator in its own namespace with the installer's
    image and retry policy), and run a model calibration Job in this namespace when no
    VExpertModelProfile exists for the model revision.
    skip: run nothing; use profiles that exist, else the paper's defaults.
    given: run nothing; use ``profile`` and/or ``modelProfileRef`` (and node profiles that exist).
    """

    mode: Literal["auto", "skip", "given"] = "auto"
    traces: list[str] = Field(
        default_factory=list,
        description="Expert-load traces the model calibration fits on (.npz from `vexpert trace build`, or SGLang "
                    "expert-statistics .json); paths in "
                    "the pod, relative ones under the checkpoint directory. None: the paper's load-balance "
                    "coefficients are used and no model calibration Job runs",
    )
    profile: PerformanceProfile | None = Field(None, description="A full profile (mode given)")
    model_profile_ref: str | None = Field(None, description="Name of a VExpertModelProfile in this namespace (mode given)")
    timeout_seconds: int = Field(1800, ge=60, le=86_400,
                                 description="activeDeadlineSeconds of the model calibration Job")
    retry_backoff_seconds: int = Field(30, ge=1, le=86_400,
                                       description="First retry delay after a failed model calibration Job")
    max_retry_backoff_seconds: int = Field(600, ge=1, le=86_400, description="Retry delay cap (doubles per failure)")
    memory: str = Field("64Gi", pattern=QUANTITY_PATTERN, description="Memory of the model calibration pod")
    cpu: str = Field("4", pattern=QUANTITY_PATTERN, description="CPU of the model calibration pod (request = limit)")

    @model_validator(mode="before")
    @classmethod
    def _image_removed(cls, data: Any) -> Any:
        # v1alpha1 let tenants pick the calibration image; hardware calibration now runs once per
        # node type for the whole cluster, so the installer sets it (the API server prunes the
        # stored field, files given to `vexpert render` get this message instead)
        if isinstance(data, dict) and "image" in data:
            raise ValueError("image was removed: calibration images are set by the operator's installer (chart "
                             "value calibration.image, VEXPERT_OPERATOR_CALIBRATION_IMAGE); delete this field")
        return data

    @model_validator(mode="after")
    def _given_needs_a_source(self) -> CalibrationSpec:
        if self.mode == "given" and self.profile is None and not self.model_profile_ref:
            raise ValueError("mode given needs profile or modelProfileRef")
        return self


# ------------------------------------------------------------------------------------------- runtime


class Toleration(CamelModel):
    """As in a Pod's tolerations[], with the API server's cross-field rules checked up front."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _as_the_api_server_requires(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is Exists")
        if not self.key and self.operator != "Exists":
            raise ValueError("an empty key needs operator Exists (it tolerates every taint)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self


class EnvVar(CamelModel):
    name: str = Field(..., min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, description="As in a Pod's env[].valueFrom")


# A Secret's name: a DNS-1123 subdomain; a key in its data: letters, digits, '-', '_' and '.'.
DNS_1123_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SECRET_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")


class SecretKeyRef(CamelModel):
    """A key in a Secret of the deployment's namespace (read by the kubelet, not by the operator)."""

    # the schema carries the same rules for the API server; the validators give the messages
    name: str = Field(
        ..., description="Secret name (in the deployment's namespace)",
        json_schema_extra={"pattern": DNS_1123_SUBDOMAIN_RE.pattern, "maxLength": 253},
    )
    key: str = Field(
        "api-key", description="Key in the Secret's data",
        json_schema_extra={"pattern": SECRET_KEY_RE.pattern, "maxLength": 253},
    )

    @field_validator("name")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        if len(value) > 253 or not DNS_1123_SUBDOMAIN_RE.match(value):
            raise ValueError(
                f"{value!r} is not a Kubernetes Secret name: use at most 253 lower-case letters, digits, "
                "'-' and '.', starting and ending with a letter or digit (e.g. vexpert-api-key)"
            )
        return value

    @field_validator("key")
    @classmethod
    def _secret_key(cls, value: str) -> str:
        if len(value) > 253 or not SECRET_KEY_RE.match(value) or value in (".", ".."):
            raise ValueError(
                f"{value!r} is not a valid Secret key: use at most 253 letters, digits, '-', '_' and '.' "
                "(e.g. api-key, the default)"
            )
        return value


class RuntimeSpec(CamelModel):
    """The node pods: image, resources and placement."""

    image: str = Field(..., min_length=1, description="Image with the `vexpert` CLI (runtime extra installed)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names for pulling the image")
    service_account_name: str | None = None
    priority_class_name: str | None = None
    cpu: str = Field("16", pattern=QUANTITY_PATTERN, description="CPU request = limit per node pod")
    memory_overhead: str = Field(
        "32Gi", pattern=QUANTITY_PATTERN, description="Host memory besides the pinned pool and /dev/shm"
    )
    shm_size: str = Field("16Gi", pattern=QUANTITY_PATTERN, description="/dev/shm size (counts toward the memory limit)")
    memory_headroom: str = Field(
        "8Gi", pattern=QUANTITY_PATTERN,
        description="Node memory left free when sizing the node pod, besides what other pods bound to the node "
        "already request (DaemonSets arriving later, requests that grow). The pod is sized into allocatable − "
        "requested − headroom, or the deployment is Invalid with the figures",
    )
    runtime_class_name: str | None = Field(
        None, description="RuntimeClass of the node pods and the model calibration Job (e.g. nvidia, where the "
        "NVIDIA container runtime is not the node's default)",
    )
    extra_resources: dict[str, str] = Field(
        default_factory=dict, description="More requests = limits per pod, e.g. rdma/ib: '1'"
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)
    http_port: int = Field(
        8000, ge=1, le=65535,
        description="The one port of `vexpert serve` in every node pod: the OpenAI-compatible API (/v1/...), "
        "GET /health (the readiness probe) and GET /metrics (Prometheus; the tuning loop reads it). The "
        "deployment's API Service forwards this port",
    )
    ipc_lock: bool = Field(
        False,
        description="Add the IPC_LOCK capability to node and calibration pods (outside Pod Security "
        "'baseline'). Only RDMA / GPUDirect (ibverbs memory registration beyond RLIMIT_MEMLOCK) needs it; "
        "CUDA pinned host memory (cudaHostAlloc / cudaHostRegister) does not",
    )
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION, gt=0, le=1,
        description=GPU_MEMORY_UTILIZATION_HELP + " (runtime.yaml's runtime.gpu_memory_utilization). Experts and "
        "slots must fit under it",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description=KV_CACHE_DTYPE_HELP + " (runtime.yaml's runtime.kv_cache_dtype; a change rolls the group)",
    )
    api_servers: int = Field(
        1, ge=1, le=64,
        description="API server processes of `vexpert serve` sharing httpPort (--api-servers; SO_REUSEPORT): each "
        "parses, tokenizes and streams its own connections' requests in its own interpreter. One is what a few "
        "dozen streams need; hundreds of streams per pod are bounded by one API process's CPU",
    )
    stream_interval: int = Field(
        1, ge=1, le=1024,
        description="A stream's tokens go out every N-th token (--stream-interval; the first at once, the rest "
        "with the finish): fewer, larger SSE chunks cost the API servers less CPU, streams get chunkier",
    )
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="The order each rank admits waiting requests and preempts running ones in "
        "(--scheduling-policy, vLLM's): fcfs, first come first served (a request's priority must be 0), or "
        "priority: by the request's priority field (lower first), then arrival",
    )
    seed: int | None = Field(
        None,
        description="The engine seed (--seed, vLLM's): a request without a seed of its own takes the next of a "
        "stream this starts on each rank, so a restarted group sent the same requests in the same order samples "
        "the same tokens. Unset: fresh entropy per such request (vLLM's default is 0)",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly (--enforce-eager, vLLM's): no CUDA graphs and no torch.compile, so a "
        "rank starts without their captures and compiles and steps slower; for debugging a graph or compile "
        "failure",
    )
    log_requests: bool = Field(
        False,
        description="Log one line per generation request as it is queued: its id, route, prompt lengths and token "
        "ids, and sampling (--enable-log-requests, vLLM's). Off: prompts stay out of the pods' logs",
    )
    max_model_len: int | None = Field(
        None, ge=2,
        description="The longest sequence (prompt + output) `vexpert serve` accepts (--max-model-len), at most the "
        "checkpoint's max_position_embeddings (checked at start). Unset: that. A request's max_tokens defaults to "
        "what it leaves; every rank's KV cache must hold one such sequence",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, le=4096,
        description="Sequences per rank in one batch (--max-num-seqs, vLLM's name; `vexpert serve --max-running`). "
        "Unset: 256 on GPUs. CUDA graphs are captured for batch buckets up to it",
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1,
        description="Tokens per rank per iteration, prompt chunks and decodes (--max-num-batched-tokens, vLLM's "
        "name). At least maxNumSeqs (every running sequence decodes a token each iteration). Unset: "
        "max(512, maxNumSeqs) on GPUs; a larger budget prefills faster and stalls the decodes longer",
    )
    max_waiting: int | None = Field(
        None, ge=0,
        description="Requests queued per rank beyond which `vexpert serve` answers 429 with Retry-After "
        "(--max-waiting). Unset: 128",
    )
    prefix_caching: bool = Field(
        False,
        description="Reuse the KV cache of prompt prefixes computed before (--prefix-caching): requests that start "
        "with the same whole 16-token blocks (a shared system prompt) skip their prefill",
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="Read tool calls out of chat replies (--tool-call-parser; vLLM's parser of that name): 'hermes' "
        "for Qwen2.5 / Qwen3(-MoE) / Hermes models, 'deepseek_v3' for DeepSeek-V3 / R1, 'deepseek_v31' for "
        "DeepSeek-V3.1, 'kimi_k2' for Kimi K2, 'qwen3_coder' for Qwen3-Coder (its arguments typed by the "
        "request's tools). Unset: requests with tools and tool_choice 'auto' are refused "
        "('required' and a named function need no parser)",
    )
    chat_template: str | None = Field(
        None, min_length=1, max_length=65536,
        description="The Jinja chat template chats render with instead of the checkpoint's (--chat-template, vLLM's "
        "flag), the template itself: e.g. vLLM's tool_chat_template_deepseekv3.jinja for DeepSeek-V3's tool calls. "
        "Checked when the node pod starts. Unset: the checkpoint's",
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description="Split chat replies into their reasoning (between <think> and </think>) and their content "
        "(--reasoning-parser; vLLM's parser of that name): 'deepseek_r1', 'deepseek_v3' (DeepSeek-V3.1: thinking "
        "when the request's chat_template_kwargs ask), 'qwen3', 'kimi_k2'. Unset: the reply is all content",
    )
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="Secret holding the API key of `vexpert serve` ({name, key: api-key by default}): passed "
        "as env VEXPERT_API_KEY, so /v1/* needs `Authorization: Bearer <key>` (/health and /metrics stay open). "
        "Unset: no authentication",
    )
    group_restart_backoff_seconds: int = Field(10, ge=0, le=3600, description="Delay before re-forming after a failure")
    max_group_restart_backoff_seconds: int = Field(300, ge=0, le=86_400, description="Cap of the doubling delay")

    @model_validator(mode="before")
    @classmethod
    def _metrics_port_removed(cls, data: Any) -> Any:
        # v1alpha1 had a separate runtime.metricsPort; /metrics is now on httpPort (the API server
        # prunes the stored field, files given to `vexpert render` get this message instead)
        if isinstance(data, dict) and ("metricsPort" in data or "metrics_port" in data):
            raise ValueError("metricsPort was removed: node pods serve /metrics on httpPort (default 8000)")
        return data

    _gpu_memory_utilization = field_validator("gpu_memory_utilization", mode="wrap")(check_gpu_memory_utilization)

    @model_validator(mode="after")
    def _batch_fits_its_sequences(self) -> RuntimeSpec:
        tokens = self.max_num_batched_tokens
        if tokens is not None and tokens < (self.max_num_seqs or 256):
            raise ValueError(f"maxNumBatchedTokens {tokens} < maxNumSeqs {self.max_num_seqs or '(unset: 256)'}: every "
                             "running sequence decodes a token each iteration; raise maxNumBatchedTokens or lower "
                             "maxNumSeqs")
        return self

    @field_validator("node_selector")
    @classmethod
    def _label_values(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not LABEL_VALUE_RE.match(val) or len(val) > 63:
                raise ValueError(f"nodeSelector[{key}]: {val!r} is not a valid label value")
        return value


class VExpertDeploymentSpec(CamelModel):
    model: ModelSpec
    parallelism: ParallelismSpec
    vexpert: VExpertSpec = Field(default_factory=VExpertSpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    runtime: RuntimeSpec


# -------------------------------------------------------------------------------------------- status


class Condition(CamelModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int | None = None


class TuningStatus(CamelModel):
    allocation_interval: int | None = Field(None, description="Current k")
    pooled_experts: int | None = Field(None, description="Current Np")
    pooled_experts_cap: int | None = Field(None, description="Largest Np the node memory allows")
    reason: str = ""
    last_decision_time: str = ""
    last_k_change_time: str = ""
    last_np_change_time: str = ""
    changes: int = 0


class RuntimeReport(CamelModel):
    balance_ratio: float | None = None
    tokens_per_second: float | None = Field(
        None, description="Generated tokens/s served (rate of vexpert_serve_generated_tokens_total between two "
        "scrapes), else the runtime's decode-throughput gauge"
    )
    inter_token_latency_seconds: float | None = Field(None, description="Mean inter-token latency between two scrapes")
    time_to_first_token_seconds: float | None = Field(None, description="Mean time to first token between two scrapes")
    requests_running: int | None = Field(None, description="Requests being decoded, all node pods")
    requests_waiting: int | None = Field(None, description="Requests queued, all node pods")
    allocator_share: float | None = Field(None, description="Allocator time / step time, amortised over k")
    degraded_ranks: int = 0
    scraped_pods: int = 0
    updated_at: str = ""


class GroupStatus(CamelModel):
    template_hash: str = ""
    draining: bool = Field(False, description="Re-forming: the StatefulSet is at 0 until every old rank is gone")
    members: list[str] = Field(default_factory=list, description="Pod UIDs of the formed group")
    formed_at: str = ""
    restarts: int = 0
    last_restart_time: str = ""
    last_restart_reason: str = ""


class NodeTypeCalibration(CamelModel):
    name: str
    state: Literal["Profiled", "Running", "Failed", "Waiting", "Pending"]
    attempts: int = 0
    job: str = ""
    message: str = ""


class CalibrationStatus(CamelModel):
    node_types: list[NodeTypeCalibration] = Field(default_factory=list)
    model_profile: str = ""
    model_state: str = ""
    model_message: str = ""


class VExpertDeploymentStatus(CamelModel):
    phase: Literal["Pending", "Calibrating", "Deploying", "Running", "Degraded", "Invalid"] = "Pending"
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    nodes: int | None = Field(None, description="Node pods the group needs")
    ready_nodes: int = 0
    node_type: str = Field("", description="The node type the group is pinned to")
    endpoint: str = Field(
        "", description="The OpenAI-compatible API inside the cluster (the deployment's Service), e.g. "
        "http://NAME-api.NAMESPACE.svc:8000; it answers once the group is Ready"
    )
    tuning: TuningStatus = Field(default_factory=TuningStatus)
    runtime: RuntimeReport = Field(default_factory=RuntimeReport)
    group: GroupStatus = Field(default_factory=GroupStatus)
    calibration: CalibrationStatus = Field(default_factory=CalibrationStatus)


# ------------------------------------------------------------------------------------------ profiles


class NodeTypeSpec(CamelModel):
    """NodeTypeKey in camelCase (GPU feature discovery labels)."""

    gpu_product: str = ""
    gpu_count: int = 0
    gpu_memory_mib: int = 0
    driver_version: str = ""
    instance_type: str = ""

    @classmethod
    def from_key(cls, key: NodeTypeKey) -> NodeTypeSpec:
        return cls(**key.model_dump())

    def to_key(self) -> NodeTypeKey:
        return NodeTypeKey(**self.model_dump())


class VExpertNodeProfileSpec(CamelModel):
    node_type: NodeTypeSpec
    allocatable_memory: str | None = Field(
        None, pattern=QUANTITY_PATTERN, description="Smallest allocatable memory of a node of this type when profiled"
    )
    profile: PerformanceProfile = Field(..., description="The hardware half is what matters for a node type")


class VExpertModelProfileSpec(CamelModel):
    model: str = Field(..., min_length=1)
    revision: str = Field(..., min_length=1)
    architecture: Architecture = "auto"
    profile: PerformanceProfile = Field(..., description="The load_balance half is what matters for a model")


class ResourceInfo(BaseModel):
    """What crdgen needs to write one CRD."""

    kind: str
    plural: str
    singular: str
    short_names: list[str]
    scope: Literal["Namespaced", "Cluster"]
    spec_model: type[BaseModel]
    status_model: type[BaseModel] | None
    printer_columns: list[dict[str, Any]]
    description: str


RESOURCES: list[ResourceInfo] = [
    ResourceInfo(
        kind=DEPLOYMENT_KIND,
        plural=DEPLOYMENT_PLURAL,
        singular="vexpertdeployment",
        short_names=["vxd"],
        scope="Namespaced",
        spec_model=VExpertDeploymentSpec,
        status_model=VExpertDeploymentStatus,
        description="A calibrated, balanced expert-parallel MoE decode group (one pod per GPU node).",
        printer_columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
            {"name": "EP", "type": "integer", "jsonPath": ".spec.parallelism.expertParallelSize"},
            {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyNodes"},
            {"name": "K", "type": "integer", "jsonPath": ".status.tuning.allocationInterval"},
            {"name": "Np", "type": "integer", "jsonPath": ".status.tuning.pooledExperts"},
            {"name": "Balance", "type": "number", "jsonPath": ".status.runtime.balanceRatio"},
            {"name": "Tokens/s", "type": "number", "jsonPath": ".status.runtime.tokensPerSecond"},
            {"name": "Node-Type", "type": "string", "jsonPath": ".status.nodeType", "priority": 1},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
    ResourceInfo(
        kind=NODE_PROFILE_KIND,
        plural=NODE_PROFILE_PLURAL,
        singular="vexpertnodeprofile",
        short_names=["vxnp"],
        scope="Cluster",
        spec_model=VExpertNodeProfileSpec,
        status_model=None,
        description="The hardware PerformanceProfile of one GPU node type (product, count, memory, driver, instance).",
        printer_columns=[
            {"name": "GPU", "type": "string", "jsonPath": ".spec.nodeType.gpuProduct"},
            {"name": "Count", "type": "integer", "jsonPath": ".spec.nodeType.gpuCount"},
            {"name": "Driver", "type": "string", "jsonPath": ".spec.nodeType.driverVersion"},
            {"name": "H2D-GB/s", "type": "number", "jsonPath": ".spec.profile.hardware.h2d_bandwidth_gb_per_s"},
            {"name": "Source", "type": "string", "jsonPath": ".spec.profile.provenance.source"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
    ResourceInfo(
        kind=MODEL_PROFILE_KIND,
        plural=MODEL_PROFILE_PLURAL,
        singular="vexpertmodelprofile",
        short_names=["vxmp"],
        scope="Namespaced",
        spec_model=VExpertModelProfileSpec,
        status_model=None,
        description="The fitted load-balance coefficients (α, β, intercept) of one model revision.",
        printer_columns=[
            {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
            {"name": "Revision", "type": "string", "jsonPath": ".spec.revision"},
            {"name": "Alpha", "type": "number", "jsonPath": ".spec.profile.load_balance.alpha"},
            {"name": "Beta", "type": "number", "jsonPath": ".spec.profile.load_balance.beta"},
            {"name": "Source", "type": "string", "jsonPath": ".spec.profile.provenance.source"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
]
