"""Pure ``build_*`` functions: spec + decisions in, Kubernetes manifests (plain dicts) out.

Nothing here talks to the API server; :mod:`.plan` strings the builders together and both the
operator and ``vexpert render`` call it, so what you review is what the operator applies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vexpert_runtime.config import (
    ModelSource,
    ParallelismConfig,
    RuntimeConfig,
    RuntimeSettings,
    TuningConfig,
    VExpertKnobs,
)
from vexpert_runtime.policy.profile import NodeTypeKey, PerformanceProfile

from . import naming as nm
from .api import (
    API_VERSION,
    DEPLOYMENT_KIND,
    MODEL_PROFILE_KIND,
    NODE_PROFILE_KIND,
    NodeTypeSpec,
    VExpertDeploymentSpec,
    VExpertModelProfileSpec,
    VExpertNodeProfileSpec,
)
from .nodetypes import GPU_RESOURCE, node_type_terms
from .quantity import format_mebibytes
from .settings import OperatorSettings
from .sizing import Sizing

CONFIG_DIR = "/etc/vexpert"
SHM_DIR = "/dev/shm"
CONFIG_FILE = "runtime.yaml"
TERMINATION_LOG = "/dev/termination-log"
# Used by the operator in node (and calibration) pods; a checkpoint mount may not land on or under them.
OPERATOR_MOUNT_PATHS = (CONFIG_DIR, SHM_DIR, TERMINATION_LOG)
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
CONTAINER = "node"
HTTP_PORT_NAME = "http"  # the API, /health and /metrics of `vexpert serve`
HEALTH_PATH = "/health"
API_KEY_ENV = "VEXPERT_API_KEY"  # `vexpert serve` reads its API key from it (runtime.apiKeySecret)
CALIBRATION_CONTAINER = "calibrate"
JOB_TTL_SECONDS = 7 * 24 * 3600


Manifest = dict[str, Any]


def owner_reference(name: str, uid: str) -> list[dict[str, Any]]:
    """The deployment as controller owner (garbage collection deletes children with it)."""
    if not uid:
        return []
    return [{
        "apiVersion": API_VERSION,
        "kind": DEPLOYMENT_KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }]


def _metadata(name: str, namespace: str, labels: Mapping[str, str], owner: list[dict[str, Any]],
              annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner:
        meta["ownerReferences"] = owner
    return meta


# --------------------------------------------------------------------------------- runtime config


def build_runtime_config(spec: VExpertDeploymentSpec, name: str, namespace: str, profile: PerformanceProfile,
                         allocation_interval: int, pooled_experts: int | None, sizing: Sizing) -> RuntimeConfig:
    """The ``RuntimeConfig`` every node pod reads (rank comes from the pod's env)."""
    return RuntimeConfig(
        model=ModelSource(
            name=spec.model.name,
            checkpoint_path=spec.model.checkpoint.path_in_pod,
            revision=spec.model.revision,
            architecture=spec.model.architecture,
            dtype=spec.model.dtype,
            expert_format=spec.model.expert_format,
            expert_compute=spec.model.expert_compute,
            linear_format=spec.model.linear_format,
        ),
        parallelism=ParallelismConfig(
            expert_parallel_size=spec.parallelism.expert_parallel_size,
            gpus_per_node=spec.parallelism.gpus_per_node,
            node_rank=0,
            master_addr=nm.rank0_address(name, namespace),
            master_port=spec.parallelism.master_port,
        ),
        vexpert=VExpertKnobs(**spec.vexpert.group_knobs()),
        tuning=TuningConfig(allocation_interval=allocation_interval, pooled_experts=pooled_experts),
        runtime=RuntimeSettings(
            device="cuda",
            metrics_port=0,  # no separate node endpoint: `vexpert serve` exports /metrics on the API port
            host_memory_limit_bytes=sizing.pinned_pool_bytes + sizing.overhead_bytes,
            gpu_memory_utilization=spec.runtime.gpu_memory_utilization,
            kv_cache_dtype=spec.runtime.kv_cache_dtype,
        ),
        profile=profile,
    )


def config_hash(config: RuntimeConfig) -> str:
    """Hash of everything but the ``tuning`` section: the runtime hot-reloads tuning, the rest needs a
    new group (a changed hash rolls the pods)."""
    static = config.model_copy(update={"tuning": TuningConfig()})
    return nm.stable_hash(static.model_dump(mode="json"), 16)


def build_config_map(name: str, namespace: str, config: RuntimeConfig, owner: list[dict[str, Any]]) -> Manifest:
    labels = nm.deployment_labels(name) | {nm.LABEL_COMPONENT: "config"}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(nm.config_map_name(name), namespace, labels, owner,
                              {nm.ANNOTATION_CONFIG_HASH: config_hash(config)}),
        "data": {CONFIG_FILE: config.to_yaml()},
    }


# ---------------------------------------------------------------------------------------- service


def build_service(name: str, namespace: str, spec: VExpertDeploymentSpec, owner: list[dict[str, Any]]) -> Manifest:
    """Headless Service: stable DNS per rank for the rendezvous, published before pods are Ready."""
    labels = nm.deployment_labels(name) | {nm.LABEL_COMPONENT: "rendezvous"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(nm.service_name(name), namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": nm.node_selector_labels(name),
            "ports": [
                {"name": "rendezvous", "port": spec.parallelism.master_port,
                 "targetPort": spec.parallelism.master_port, "protocol": "TCP"},
            ],
        },
    }


def build_api_service(name: str, namespace: str, spec: VExpertDeploymentSpec, owner: list[dict[str, Any]]
                      ) -> Manifest:
    """ClusterIP Service of the OpenAI-compatible API: every ready node pod takes requests (a node's
    ranks forward work among themselves), so plain load balancing over all of them is right; a pod
    is in it while ``GET /health`` answers 200."""
    labels = nm.deployment_labels(name) | {nm.LABEL_COMPONENT: "api"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(nm.api_service_name(name), namespace, labels, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": nm.node_selector_labels(name),
            "ports": [{"name": HTTP_PORT_NAME, "port": spec.runtime.http_port, "targetPort": HTTP_PORT_NAME,
                       "protocol": "TCP", "appProtocol": "http"}],
        },
    }


def api_endpoint(name: str, namespace: str, spec: VExpertDeploymentSpec) -> str:
    """The API's URL inside the cluster (through :func:`build_api_service`)."""
    return f"http://{nm.api_service_name(name)}.{namespace}.svc:{spec.runtime.http_port}"


# ------------------------------------------------------------------------------------ statefulset


def _tolerations(spec: VExpertDeploymentSpec) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in spec.runtime.tolerations]


def _node_affinity(terms: list[list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": expressions} for expressions in terms],
        },
    }


def _env(spec: VExpertDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "VEXPERT_NODE_RANK",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}},
        {"name": "VEXPERT_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "VEXPERT_NUM_NODES", "value": str(spec.parallelism.num_nodes)},
        {"name": "VEXPERT_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
    ]
    for item in spec.runtime.env:
        entry: dict[str, Any] = {"name": item.name}
        if item.value_from is not None:
            entry["valueFrom"] = item.value_from
        else:
            entry["value"] = item.value or ""
        env.append(entry)
    secret = spec.runtime.api_key_secret
    if secret is not None:
        # the kubelet reads the Secret; the operator needs no access to it
        env.append({"name": API_KEY_ENV,
                    "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    return env


def _model_volume(spec: VExpertDeploymentSpec) -> dict[str, Any]:
    ckpt = spec.model.checkpoint
    if ckpt.claim_name:
        return {"name": "model", "persistentVolumeClaim": {"claimName": ckpt.claim_name, "readOnly": True}}
    return {"name": "model", "hostPath": {"path": ckpt.host_path, "type": "Directory"}}


def _security_context(spec: VExpertDeploymentSpec) -> dict[str, Any]:
    """Nothing privileged (CUDA IPC stays inside one container); Pod Security "baseline" by default.

    IPC_LOCK only with ``runtime.ipcLock``: RDMA / GPUDirect registers memory with the NIC through
    ibverbs, which is bounded by RLIMIT_MEMLOCK and needs the capability beyond it. CUDA pinned host
    memory (``cudaHostAlloc`` / ``cudaHostRegister``, the runtime's expert pool) is page-locked by the
    driver and does not, so the default adds no capability (baseline forbids IPC_LOCK).
    """
    sc: dict[str, Any] = {"privileged": False, "allowPrivilegeEscalation": False}
    if spec.runtime.ipc_lock:
        sc["capabilities"] = {"add": ["IPC_LOCK"]}
    return sc


def _resources(spec: VExpertDeploymentSpec, sizing: Sizing) -> dict[str, str]:
    """Requests = limits (Guaranteed QoS): a rank evicted under memory pressure stops the whole group."""
    memory = format_mebibytes(sizing.pod_memory_bytes)
    resources = {"cpu": spec.runtime.cpu, "memory": memory, GPU_RESOURCE: str(spec.parallelism.gpus_per_node)}
    resources.update(spec.runtime.extra_resources)
    return resources


def _readiness_probe() -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": HTTP_PORT_NAME},
        "periodSeconds": 5,
        "timeoutSeconds": 3,  # the API shares the server: allow for a busy event loop
        "failureThreshold": 3,
    }


def _serve_args(spec: VExpertDeploymentSpec) -> list[str]:
    """``vexpert serve``'s arguments: the rendered config, the port, and the API knobs set off their defaults."""
    args = ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--port", str(spec.runtime.http_port)]
    if spec.runtime.api_servers != 1:
        args += ["--api-servers", str(spec.runtime.api_servers)]
    if spec.runtime.stream_interval != 1:
        args += ["--stream-interval", str(spec.runtime.stream_interval)]
    if spec.runtime.scheduling_policy != "fcfs":
        args += ["--scheduling-policy", spec.runtime.scheduling_policy]
    if spec.runtime.prefix_caching:
        args.append("--prefix-caching")
    if spec.runtime.seed is not None:
        args += ["--seed", str(spec.runtime.seed)]
    if spec.runtime.enforce_eager:
        args.append("--enforce-eager")
    if spec.runtime.log_requests:
        args.append("--enable-log-requests")
    if spec.runtime.max_model_len is not None:
        args += ["--max-model-len", str(spec.runtime.max_model_len)]
    for flag, value in (("--max-num-seqs", spec.runtime.max_num_seqs),
                        ("--max-num-batched-tokens", spec.runtime.max_num_batched_tokens),
                        ("--max-waiting", spec.runtime.max_waiting)):
        if value is not None:
            args += [flag, str(value)]
    if spec.runtime.tool_call_parser is not None:
        args += ["--tool-call-parser", spec.runtime.tool_call_parser]
    if spec.runtime.reasoning_parser is not None:
        args += ["--reasoning-parser", spec.runtime.reasoning_parser]
    if spec.runtime.chat_template is not None:
        args += ["--chat-template", spec.runtime.chat_template]
    return args


def _node_container(spec: VExpertDeploymentSpec, sizing: Sizing) -> dict[str, Any]:
    """The one container: ``vexpert serve`` on the rendered config, rendezvous and API ports."""
    resources = _resources(spec, sizing)
    return {
        "name": CONTAINER,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["vexpert", "serve"],
        "args": _serve_args(spec),
        "env": _env(spec),
        "ports": [
            {"name": "rendezvous", "containerPort": spec.parallelism.master_port, "protocol": "TCP"},
            {"name": HTTP_PORT_NAME, "containerPort": spec.runtime.http_port, "protocol": "TCP"},
        ],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": _security_context(spec),
        "readinessProbe": _readiness_probe(),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "model", "mountPath": spec.model.checkpoint.mount_path, "readOnly": True},
            {"name": "shm", "mountPath": SHM_DIR},
        ],
    }


def _node_volumes(name: str, spec: VExpertDeploymentSpec) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": nm.config_map_name(name)}},
        _model_volume(spec),
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.runtime.shm_size}},
    ]


def _node_affinities(name: str, node_key: NodeTypeKey | None) -> dict[str, Any]:
    """One rank per host (two ranks on one host would share its GPUs), on nodes of the chosen type."""
    affinity: dict[str, Any] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": nm.node_selector_labels(name)},
                "topologyKey": "kubernetes.io/hostname",
            }],
        },
    }
    if node_key is not None:
        affinity["nodeAffinity"] = _node_affinity(node_type_terms(node_key))
    return affinity


def _optional_pod_fields(spec: VExpertDeploymentSpec) -> dict[str, Any]:
    """The pod fields the spec may set; unset ones are left out (not rendered empty)."""
    runtime = spec.runtime
    fields: dict[str, Any] = {}
    if runtime.node_selector:
        fields["nodeSelector"] = dict(runtime.node_selector)
    if runtime.tolerations:
        fields["tolerations"] = _tolerations(spec)
    if runtime.service_account_name:
        fields["serviceAccountName"] = runtime.service_account_name
    if runtime.priority_class_name:
        fields["priorityClassName"] = runtime.priority_class_name
    if runtime.runtime_class_name:
        fields["runtimeClassName"] = runtime.runtime_class_name
    if runtime.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": s} for s in runtime.image_pull_secrets]
    return fields


def _node_pod_spec(name: str, spec: VExpertDeploymentSpec, sizing: Sizing,
                   node_key: NodeTypeKey | None) -> dict[str, Any]:
    """The pod spec of a node pod: no host namespaces, restarted in place, everything else from the spec."""
    return {
        "affinity": _node_affinities(name, node_key),
        "hostIPC": False,
        "hostNetwork": False,
        "hostPID": False,
        "enableServiceLinks": False,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "containers": [_node_container(spec, sizing)],
        "volumes": _node_volumes(name, spec),
        **_optional_pod_fields(spec),
    }


def _node_pod_annotations(spec: VExpertDeploymentSpec, cfg_hash: str) -> dict[str, str]:
    """The config hash (a changed config rolls the group) and where Prometheus scrapes."""
    return {
        nm.ANNOTATION_CONFIG_HASH: cfg_hash,
        "kubectl.kubernetes.io/default-container": CONTAINER,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.runtime.http_port),
        "prometheus.io/path": "/metrics",
    }


def build_pod_template(name: str, spec: VExpertDeploymentSpec, sizing: Sizing, cfg_hash: str,
                       node_key: NodeTypeKey | None) -> dict[str, Any]:
    """The node pod: one container running ``vexpert serve`` with all of the node's GPUs.

    One port (``runtime.httpPort``, named ``http``) carries the API, ``/health`` and ``/metrics``.
    Readiness only: ``/health`` is 503 until the model is loaded and the group formed, and whenever
    the pod cannot take requests; that takes the pod out of the API Service, nothing more. No liveness
    and hence no startup probe: loading hundreds of GB of experts from a volume has no bound a probe
    could rely on, and the kubelet restarting one rank would break the whole EP group; the operator
    re-forms groups itself (with backoff) when a pod fails or a member is lost.

    The template's own hash goes into its labels: the operator compares it with the running pods'
    to decide when a group must re-form (the StatefulSet is ``OnDelete``).
    """
    labels = nm.deployment_labels(name) | nm.node_selector_labels(name) | {nm.LABEL_COMPONENT: "node"}
    template: dict[str, Any] = {
        "metadata": {"labels": labels, "annotations": _node_pod_annotations(spec, cfg_hash)},
        "spec": _node_pod_spec(name, spec, sizing, node_key),
    }
    template["metadata"]["labels"][nm.LABEL_TEMPLATE_HASH] = nm.stable_hash(template, 10)
    return template


def template_hash(template: Mapping[str, Any]) -> str:
    return str(template["metadata"]["labels"][nm.LABEL_TEMPLATE_HASH])


def build_statefulset(name: str, namespace: str, spec: VExpertDeploymentSpec, template: dict[str, Any],
                      owner: list[dict[str, Any]], replicas: int | None = None) -> Manifest:
    """Stable ranks (ordinals), all pods at once, and ``OnDelete`` so the operator rolls whole groups.

    ``replicas=0`` while a group is drained for re-forming: no new rank starts before every old
    one is gone, so old and new ranks never meet at the rendezvous.
    """
    labels = nm.deployment_labels(name) | {nm.LABEL_COMPONENT: "node"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(nm.statefulset_name(name), namespace, labels, owner),
        "spec": {
            "serviceName": nm.service_name(name),
            "replicas": spec.parallelism.num_nodes if replicas is None else replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": nm.node_selector_labels(name)},
            "template": template,
        },
    }


def build_pdb(name: str, namespace: str, spec: VExpertDeploymentSpec, owner: list[dict[str, Any]],
              drained_nodes: Sequence[str] = ()) -> Manifest:
    """No voluntary disruption of a healthy group (losing one rank stops all: an autoscaler's
    scale-down or a descheduler must not take a serving group down), unless a node of the group
    is cordoned: then an administrator is draining it and one rank may be evicted (the operator
    re-forms the group without it). Unhealthy pods may always go."""
    labels = nm.deployment_labels(name) | {nm.LABEL_COMPONENT: "node"}
    budget: dict[str, Any] = {"maxUnavailable": 1} if drained_nodes else {"minAvailable": spec.parallelism.num_nodes}
    annotations = {nm.ANNOTATION_DRAINED_NODES: ",".join(drained_nodes)} if drained_nodes else None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(nm.pdb_name(name), namespace, labels, owner, annotations),
        "spec": {
            **budget,
            "selector": {"matchLabels": nm.node_selector_labels(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# ------------------------------------------------------------------------------- calibration jobs


def _calibration_labels(kind: str, extra: Mapping[str, str]) -> dict[str, str]:
    return {
        nm.LABEL_NAME: "vexpert",
        nm.LABEL_MANAGED_BY: nm.MANAGED_BY,
        nm.LABEL_PART_OF: "vexpert",
        nm.LABEL_COMPONENT: f"{kind}-calibration",
        nm.LABEL_ROLE: nm.ROLE_CALIBRATION,
        nm.LABEL_CALIBRATION: kind,
        **extra,
    }


def _calibration_job(job_name: str, namespace: str, labels: dict[str, str], annotations: dict[str, str],
                     image: str, pull_policy: str, resources: dict[str, str], timeout_s: int, shm_size: str,
                     args: list[str], owner: list[dict[str, Any]], pod_fields: dict[str, Any],
                     security_context: dict[str, Any], extra_volumes: tuple[dict[str, Any], ...] = (),
                     extra_mounts: tuple[dict[str, Any], ...] = ()) -> Manifest:
    """One attempt: ``backoffLimit: 0`` (the operator counts attempts and backs off itself, bounded by
    ``calibration_max_attempts``) and ``activeDeadlineSeconds`` (a hung measurement fails)."""
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "containers": [{
            "name": CALIBRATION_CONTAINER,
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": ["vexpert", "calibrate"],
            "args": [*args, "--termination-message-path", TERMINATION_LOG],
            "resources": {"requests": dict(resources), "limits": dict(resources)},
            "securityContext": security_context,
            "terminationMessagePath": TERMINATION_LOG,
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [{"name": "shm", "mountPath": SHM_DIR}, *extra_mounts],
        }],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}, *extra_volumes],
        **{k: v for k, v in pod_fields.items() if v},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(job_name, namespace, labels, owner, annotations),
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": timeout_s,
            "ttlSecondsAfterFinished": JOB_TTL_SECONDS,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }


def build_hardware_calibration_job(namespace: str, type_name: str, node_key: NodeTypeKey, attempt: int,
                                   settings: OperatorSettings) -> Manifest:
    """``vexpert calibrate hardware`` on one node of the type, with all its GPUs: one Job per node type
    for the whole cluster, in the operator's namespace, everything from the installer's settings
    (image, resources, deadline, tolerations), nothing from a tenant's spec. No owner: it serves
    every deployment that may land on the type; ``ttlSecondsAfterFinished`` removes it.

    Contract (``vexpert calibrate``): the container writes a ``PerformanceProfile`` JSON to its
    termination message and exits 0, or exits non-zero with a one-line reason there.
    """
    labels = _calibration_labels("hardware", {nm.LABEL_NODE_TYPE: type_name, nm.LABEL_ATTEMPT: str(attempt)})
    key_json = json.dumps(node_key.model_dump(), sort_keys=True)
    gpus = node_key.gpu_count or 1
    args = ["hardware", "--gpus", str(gpus), "--node-type", key_json]
    resources = {"cpu": settings.calibration_cpu, "memory": settings.calibration_memory, GPU_RESOURCE: str(gpus)}
    pod_fields = {
        # GPU measurements: on a node of exactly this type
        "affinity": {"nodeAffinity": _node_affinity(node_type_terms(node_key))},
        "tolerations": list(settings.calibration_tolerations),
        "runtimeClassName": settings.calibration_runtime_class,
    }
    return _calibration_job(nm.hardware_job_name(type_name, attempt), namespace, labels,
                            {nm.ANNOTATION_NODE_TYPE_KEY: key_json}, settings.calibration_image,
                            settings.calibration_image_pull_policy, resources, settings.calibration_timeout_s,
                            settings.calibration_shm_size, args, [], pod_fields,
                            {"privileged": False, "allowPrivilegeEscalation": False})


def trace_paths(spec: VExpertDeploymentSpec) -> list[str]:
    """``calibration.traces`` as paths in the pod (relative ones under the checkpoint directory)."""
    base = spec.model.checkpoint.path_in_pod.rstrip("/")
    return [t if t.startswith("/") else f"{base}/{t}" for t in spec.calibration.traces]


def model_fit_inputs(spec: VExpertDeploymentSpec) -> list[str]:
    """What a model calibration's fit depends on besides the model revision: its Job's trace, EP
    size and vmax arguments (part of the model profile's key, see ``naming.model_key``). Not k: the
    tuner moves it at run time, and a new k must not block the group on a refit."""
    args: list[str] = []
    for path in trace_paths(spec):
        args += ["--trace", path]
    return [
        *args,
        "--gpus", str(spec.parallelism.expert_parallel_size),
        "--vmax", str(max(2, spec.vexpert.vmax)),  # V = 1..2 at least, so β and the intercept separate
    ]


def build_model_calibration_job(namespace: str, key: str, attempt: int, spec: VExpertDeploymentSpec,
                                owner: list[dict[str, Any]], settings: OperatorSettings) -> Manifest:
    """``vexpert calibrate model``: fit α, β, intercept of Δ(L, V) on the expert-load traces (a CPU job
    in the deployment's namespace: it reads the traces from the deployment's checkpoint volume, where
    the deployment may run). The image is the installer's (``settings.calibration_image``)."""
    labels = _calibration_labels("model", {nm.LABEL_MODEL_KEY: key, nm.LABEL_ATTEMPT: str(attempt)})
    args = ["model", *model_fit_inputs(spec), "--k", str(spec.vexpert.allocation_interval.value),
            "--model", spec.model.name, "--revision", spec.model.revision]
    annotations = {nm.ANNOTATION_MODEL: spec.model.name, nm.ANNOTATION_REVISION: spec.model.revision}
    mounts = [{"name": "model", "mountPath": spec.model.checkpoint.mount_path, "readOnly": True}]
    calib = spec.calibration
    pod_fields = {
        # where the deployment may run: its checkpoint volume is reachable there
        "nodeSelector": dict(spec.runtime.node_selector),
        "tolerations": _tolerations(spec),
        "serviceAccountName": spec.runtime.service_account_name,
        "imagePullSecrets": [{"name": s} for s in spec.runtime.image_pull_secrets],
        "runtimeClassName": spec.runtime.runtime_class_name,
    }
    return _calibration_job(nm.model_job_name(key, attempt), namespace, labels, annotations,
                            settings.calibration_image, settings.calibration_image_pull_policy,
                            {"cpu": calib.cpu, "memory": calib.memory}, calib.timeout_seconds, spec.runtime.shm_size,
                            args, owner, pod_fields, {"privileged": False, "allowPrivilegeEscalation": False},
                            (_model_volume(spec),), tuple(mounts))


# --------------------------------------------------------------------------------------- profiles


def build_node_profile(type_name: str, node_key: NodeTypeKey, profile: PerformanceProfile,
                       allocatable_memory: int | None, job: str = "", source_namespace: str = "") -> Manifest:
    spec = VExpertNodeProfileSpec(
        node_type=NodeTypeSpec.from_key(node_key),
        allocatable_memory=str(allocatable_memory) if allocatable_memory else None,
        profile=profile,
    )
    return {
        "apiVersion": API_VERSION,
        "kind": NODE_PROFILE_KIND,
        "metadata": {
            "name": type_name,
            "labels": {nm.LABEL_MANAGED_BY: nm.MANAGED_BY, nm.LABEL_NODE_TYPE: type_name,
                       "nvidia.com/gpu.product": nm.label_value(node_key.gpu_product)},
            "annotations": {nm.ANNOTATION_SOURCE_JOB: f"{source_namespace}/{job}" if job else ""},
        },
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def build_model_profile(namespace: str, key: str, model: str, revision: str, architecture: str,
                        profile: PerformanceProfile, job: str = "") -> Manifest:
    spec = VExpertModelProfileSpec(model=model, revision=revision, architecture=architecture,  # type: ignore[arg-type]
                                   profile=profile)
    return {
        "apiVersion": API_VERSION,
        "kind": MODEL_PROFILE_KIND,
        "metadata": {"name": key, "namespace": namespace,
                     "labels": {nm.LABEL_MANAGED_BY: nm.MANAGED_BY, nm.LABEL_MODEL_KEY: key},
                     "annotations": {nm.ANNOTATION_SOURCE_JOB: f"{namespace}/{job}" if job else ""}},
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
