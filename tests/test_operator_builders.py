"""Unit tests of the operator's pure builders: quantities, names, sizing, manifests and the plan."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
import yaml

from operator_support.samples import gpu_node, raw_spec, spec
from vexpert_operator import manifests as mf
from vexpert_operator import naming as nm
from vexpert_operator.nodetypes import candidate_types, node_info, node_type_key, node_type_terms
from vexpert_operator.plan import PlanInputs, combine_profiles, default_profile, plan_group
from vexpert_operator.quantity import GIB, MIB, format_mebibytes, parse_bytes, parse_quantity
from vexpert_operator.settings import OperatorSettings
from vexpert_operator.sizing import (
    KNOWN_SHAPES,
    MemoryFit,
    model_shape,
    np_bounds,
    pinned_pool_bytes,
    size_pod,
)
from vexpert_operator.validation import parse_spec, validate_spec
from vexpert_runtime.config import parse_runtime_config
from vexpert_runtime.policy.profile import (
    HardwareParameters,
    LoadBalanceParameters,
    NodeTypeKey,
    PerformanceProfile,
    Provenance,
)

K8S = "1.32"


def h200_type(nodes: int = 8, allocatable: str = "2000Gi"):
    infos = [node_info(gpu_node(f"n{i}", allocatable=allocatable)) for i in range(nodes)]
    return next(iter(candidate_types(infos, {}, [], 8).values()))


# ------------------------------------------------------------------------------------------ quantities


@pytest.mark.parametrize(("text", "value"), [
    ("64Gi", 64 * GIB), ("1.5G", 1_500_000_000), ("500m", 0.5), ("128", 128), ("1Ki", 1024), ("2Ti", 2 * 1024 * GIB),
])
def test_parse_quantity(text: str, value: float) -> None:
    assert float(parse_quantity(text)) == pytest.approx(value)


def test_parse_bytes_rounds_up_and_rejects_garbage() -> None:
    assert parse_bytes("1.5") == 2
    with pytest.raises(ValueError, match="quantity"):
        parse_bytes("lots")


def test_format_mebibytes_rounds_up() -> None:
    assert format_mebibytes(MIB) == "1Mi"
    assert format_mebibytes(MIB + 1) == "2Mi"


# --------------------------------------------------------------------------------------------- naming


def test_bounded_names_are_dns_labels_and_unique() -> None:
    a = nm.bounded_name("NVIDIA H100 80GB HBM3 with a very long product name " * 3, {"driver": "1"})
    b = nm.bounded_name("NVIDIA H100 80GB HBM3 with a very long product name " * 3, {"driver": "2"})
    assert a != b
    for name in (a, b):
        assert len(name) <= 63
        assert name == name.lower() and not name.startswith("-") and not name.endswith("-")


def test_label_value_is_valid_and_bounded() -> None:
    assert nm.label_value("NVIDIA-H100-80GB-HBM3") == "NVIDIA-H100-80GB-HBM3"
    long = nm.label_value("x" * 100)
    assert len(long) <= 63
    assert nm.label_value("a b/c") == "a-b-c"


def test_model_key_is_stable_and_distinguishes_revisions() -> None:
    assert nm.model_key("deepseek-ai/DeepSeek-V3", "r1") == nm.model_key("deepseek-ai/DeepSeek-V3", "r1")
    assert nm.model_key("deepseek-ai/DeepSeek-V3", "r1") != nm.model_key("deepseek-ai/DeepSeek-V3", "r2")
    assert nm.model_key("deepseek-ai/DeepSeek-V3", "r1").startswith("deepseek-v3-r1-")


def test_deployments_fitted_differently_do_not_share_a_model_profile() -> None:
    # the fit depends on the EP size, vmax and traces, not only on the model revision (k is tuned
    # at run time: a new k must not force a refit)
    ep64 = spec(calibration={"traces": ["t.npz"]})
    ep8 = spec(calibration={"traces": ["t.npz"]}, parallelism__expertParallelSize=8)
    other_traces = spec(calibration={"traces": ["u.npz"]})

    def key(s: Any) -> str:
        return nm.model_key(s.model.name, s.model.revision, mf.model_fit_inputs(s))

    assert key(ep64) == key(spec(calibration={"traces": ["t.npz"]}, vexpert={"allocationInterval": {"value": 25}}))
    assert len({key(ep64), key(ep8), key(other_traces)}) == 3
    job = mf.build_model_calibration_job("ns", key(ep8), 1, ep8, [], OperatorSettings())
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--gpus") + 1] == "8" and job["metadata"]["labels"][nm.LABEL_MODEL_KEY] == key(ep8)


# --------------------------------------------------------------------------------------------- sizing


def test_model_shape_known_scaled_given_and_unknown() -> None:
    assert model_shape(spec()) == KNOWN_SHAPES["deepseek_v3"]
    fp32 = model_shape(spec(model__dtype="float32"))
    assert fp32 is not None and fp32.expert_bytes == 2 * KNOWN_SHAPES["deepseek_v3"].expert_bytes
    given = model_shape(spec(model__architecture="auto",
                             model__shape={"numExperts": 64, "numMoeLayers": 4, "expertBytes": 1000}))
    assert given is not None and given.num_experts == 64
    assert model_shape(spec(model__architecture="auto")) is None


def test_np_cap_is_as_large_as_node_memory_allows() -> None:
    s = spec()
    shape = KNOWN_SHAPES["deepseek_v3"]
    per_expert = shape.expert_bytes * shape.num_moe_layers
    memory = 56 * GIB + 100 * per_expert + per_expert // 2  # shm 16Gi + overhead 32Gi + headroom 8Gi + 100.5
    fit = MemoryFit(node="n", allocatable=memory, requested=0, headroom=8 * GIB)
    sizing = size_pod(s, shape, fit)
    assert sizing.pooled_experts_cap == 100
    assert sizing.pod_memory_bytes == 100 * per_expert + 48 * GIB <= memory - 8 * GIB
    assert sizing.pinned_pool_bytes == pinned_pool_bytes(100, shape)
    # Unknown memory: the upper bound (all experts); fixed Np: exactly that.
    assert size_pod(s, shape, None).pooled_experts_cap == 256
    assert size_pod(spec(vexpert={"pinnedExperts": {"mode": "fixed", "value": 7}}), shape, fit
                    ).pooled_experts_cap == 7
    # Bounds clip it.
    assert size_pod(spec(vexpert={"pinnedExperts": {"max": 50}}), shape, fit).pooled_experts_cap == 50
    assert np_bounds(spec(vexpert={"pinnedExperts": {"min": 10, "max": 50}}), shape) == (10, 50)


def test_gpu_bytes_count_base_experts_and_slots() -> None:
    shape = KNOWN_SHAPES["deepseek_v3"]
    sizing = size_pod(spec(vexpert={"groupSize": 2, "vmax": 3}), shape, None)
    # base experts + one buffer of G·vmax = 6 slots (what the runtime allocates)
    assert sizing.gpu_bytes_per_gpu == (4 * 58 + 6) * shape.expert_bytes


# ------------------------------------------------------------------------------------------ manifests


def _plan(**kw):
    node_type = h200_type()
    inputs = PlanInputs(name="dsv3", namespace="inference", spec=kw.pop("s", spec()), uid="u-1",
                        node_type=node_type, **kw)
    return plan_group(inputs)


def test_statefulset_pod_is_one_container_per_node_guaranteed_and_unprivileged() -> None:
    plan = _plan()
    sts = plan.statefulset
    assert sts["spec"]["replicas"] == 8
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["serviceName"] == "dsv3-nodes"
    pod = sts["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    c = pod["containers"][0]
    assert c["command"] == ["vexpert", "serve"]
    assert c["args"] == ["--config", "/etc/vexpert/runtime.yaml", "--port", "8000"]
    # Guaranteed QoS: requests == limits, memory = pinned pool + /dev/shm + overhead.
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert c["resources"]["limits"]["memory"] == format_mebibytes(plan.sizing.pod_memory_bytes)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert parse_bytes(c["resources"]["limits"]["memory"]) >= plan.sizing.pinned_pool_bytes + 48 * GIB
    assert "capabilities" not in c["securityContext"]  # IPC_LOCK only with runtime.ipcLock (RDMA)
    assert c["securityContext"]["privileged"] is False
    assert pod["hostIPC"] is False and pod["hostNetwork"] is False and pod["hostPID"] is False
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    rank = next(e for e in c["env"] if e["name"] == "VEXPERT_NODE_RANK")
    assert rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == nm.node_selector_labels("dsv3")
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": e} for e in node_type_terms(h200_type().key)]
    assert sts["metadata"]["ownerReferences"][0] == {
        "apiVersion": "vexpert.io/v1alpha1", "kind": "VExpertDeployment", "name": "dsv3", "uid": "u-1",
        "controller": True, "blockOwnerDeletion": True}
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_service_pdb_and_configmap() -> None:
    plan = _plan()
    svc = plan.service
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert [p["name"] for p in svc["spec"]["ports"]] == ["rendezvous"]  # /metrics moved to the API port
    assert plan.pdb["spec"]["minAvailable"] == 8
    assert plan.pdb["spec"]["selector"]["matchLabels"] == nm.node_selector_labels("dsv3")
    config = parse_runtime_config(yaml.safe_load(plan.config_map["data"]["runtime.yaml"]))
    assert config.parallelism.expert_parallel_size == 64
    assert config.parallelism.master_addr == "dsv3-node-0.dsv3-nodes.inference.svc"
    assert config.tuning.allocation_interval == 10
    assert config.tuning.pooled_experts == plan.pooled_experts == plan.sizing.pooled_experts_cap
    assert config.model.checkpoint_path == "/models/DeepSeek-V3"
    assert config.runtime.metrics_port == 0  # no second endpoint: `vexpert serve` has /metrics on --port


def test_kv_cache_dtype_reaches_the_node_pods_runtime_yaml() -> None:
    default = parse_runtime_config(yaml.safe_load(_plan().config_map["data"]["runtime.yaml"]))
    assert default.runtime.kv_cache_dtype == "auto"
    plan = _plan(s=spec(runtime__kvCacheDtype="fp8"))
    raw = yaml.safe_load(plan.config_map["data"]["runtime.yaml"])
    assert raw["runtime"]["kv_cache_dtype"] == "fp8" and parse_runtime_config(raw).runtime.kv_cache_dtype == "fp8"
    assert "--kv-cache-dtype" not in plan.statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    hashes = [p.config_map["metadata"]["annotations"][nm.ANNOTATION_CONFIG_HASH] for p in (plan, _plan())]
    assert hashes[0] != hashes[1]  # a new cache dtype needs new ranks


def test_gpu_memory_utilization_reaches_the_node_pods_runtime_yaml() -> None:
    default = parse_runtime_config(yaml.safe_load(_plan().config_map["data"]["runtime.yaml"]))
    assert default.runtime.gpu_memory_utilization == 0.9
    plan = _plan(s=spec(runtime__gpuMemoryUtilization=0.75))
    raw = yaml.safe_load(plan.config_map["data"]["runtime.yaml"])
    assert raw["runtime"]["gpu_memory_utilization"] == 0.75
    assert parse_runtime_config(raw).runtime.gpu_memory_utilization == 0.75
    # `vexpert serve --config` reads it from the file: no flag on the container
    args = plan.statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--gpu-memory-utilization" not in args
    # a new share needs new ranks: it is part of the config hash that rolls the group
    hashes = [p.config_map["metadata"]["annotations"][nm.ANNOTATION_CONFIG_HASH] for p in (plan, _plan())]
    assert hashes[0] != hashes[1]


def test_the_batch_limits_reach_the_node_pods_command_and_a_budget_below_the_batch_is_refused() -> None:
    """spec.runtime.maxNumSeqs / maxNumBatchedTokens / maxWaiting (vLLM's names) become `vexpert serve`'s flags; unset,
    none is passed (the runtime's defaults); a token budget smaller than the batch — every running sequence decodes a
    token each iteration — is refused naming the field, before any pod starts."""
    args = _plan(s=spec(runtime__maxNumSeqs=64, runtime__maxNumBatchedTokens=1024, runtime__maxWaiting=32)
                 ).statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64" and args[args.index("--max-num-batched-tokens") + 1] == "1024"
    assert args[args.index("--max-waiting") + 1] == "32"
    default = _plan().statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {"--max-num-seqs", "--max-num-batched-tokens", "--max-waiting"} & set(default)
    for overrides in ({"runtime__maxNumSeqs": 64, "runtime__maxNumBatchedTokens": 32},
                      {"runtime__maxNumBatchedTokens": 128}):  # (unset maxNumSeqs: the GPU default, 256)
        parsed, problems = parse_spec(raw_spec(**overrides))
        assert parsed is None and len(problems) == 1 and problems[0].field.startswith("spec.runtime"), problems
        assert "maxNumBatchedTokens" in problems[0].message and "maxNumSeqs" in problems[0].message
    parsed, problems = parse_spec(raw_spec(runtime__maxNumSeqs=0))
    assert parsed is None and [p.field for p in problems] == ["spec.runtime.maxNumSeqs"]


@pytest.mark.parametrize("dispatch", ["auto", "plan", "local", "global"])
def test_the_replica_dispatch_reaches_the_runtime_config(dispatch: str) -> None:
    plan = _plan(s=spec(vexpert__dispatch=dispatch))
    config = parse_runtime_config(yaml.safe_load(plan.config_map["data"]["runtime.yaml"]))
    assert config.vexpert.dispatch == dispatch


def test_an_unknown_dispatch_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="dispatch"):
        spec(vexpert__dispatch="round-robin")


def test_node_pod_serves_the_api_health_and_metrics_on_one_named_port() -> None:
    s = spec(runtime__httpPort=8080)
    template = _plan(s=s).statefulset["spec"]["template"]
    c = template["spec"]["containers"][0]
    assert c["args"][-2:] == ["--port", "8080"]
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert [p["name"] for p in c["ports"]] == ["rendezvous", "http"]
    probe = c["readinessProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": "http"}
    assert probe["periodSeconds"] == 5 and probe["failureThreshold"] == 3
    # no liveness, hence no startup probe: the kubelet must not restart one rank of a group (see the builder)
    assert "livenessProbe" not in c and "startupProbe" not in c
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8080" and annotations["prometheus.io/path"] == "/metrics"


def test_api_key_secret_reaches_the_serving_container_as_a_secret_key_ref() -> None:
    def env_of(s):
        return _plan(s=s).statefulset["spec"]["template"]["spec"]["containers"][0]["env"]

    assert all(e["name"] != "VEXPERT_API_KEY" for e in env_of(spec()))
    env = env_of(spec(runtime__apiKeySecret={"name": "vexpert-api-key", "key": "token"}))
    entries = [e for e in env if e["name"] == "VEXPERT_API_KEY"]
    assert entries == [{"name": "VEXPERT_API_KEY",
                        "valueFrom": {"secretKeyRef": {"name": "vexpert-api-key", "key": "token"}}}]
    assert "optional" not in entries[0]["valueFrom"]["secretKeyRef"]  # a missing Secret keeps the pod from starting
    default_key = env_of(spec(runtime__apiKeySecret={"name": "k"}))
    assert {"name": "VEXPERT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "api-key"}}} in default_key


@pytest.mark.parametrize("field, ref", [
    ("name", {"name": "My_Secret"}),
    ("name", {"name": "-x"}),
    ("name", {"name": "a" * 254}),
    ("key", {"name": "ok", "key": "bad/key"}),
])
def test_a_bad_api_key_secret_is_refused_naming_the_field(field: str, ref: dict[str, str]) -> None:
    parsed, problems = parse_spec(raw_spec(runtime__apiKeySecret=ref))
    assert parsed is None
    assert [p.field for p in problems] == [f"spec.runtime.apiKeySecret.{field}"]
    assert "e.g." in problems[0].message


def test_api_key_env_clashes_with_api_key_secret() -> None:
    s = spec(runtime__apiKeySecret={"name": "k"}, runtime__env=[{"name": "VEXPERT_API_KEY", "value": "x"}])
    assert [p.field for p in validate_spec(s, "dsv3")] == ["spec.runtime.env[0].name"]
    assert validate_spec(spec(runtime__env=[{"name": "VEXPERT_API_KEY", "value": "x"}]), "dsv3") == []


def test_api_service_load_balances_over_every_ready_node_pod() -> None:
    plan = _plan()
    svc = plan.api_service
    assert svc["metadata"]["name"] == nm.api_service_name("dsv3") == "dsv3-api"
    assert svc["metadata"]["namespace"] == "inference"
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert svc["metadata"]["labels"][nm.LABEL_COMPONENT] == "api"
    assert svc["spec"]["type"] == "ClusterIP"
    assert "clusterIP" not in svc["spec"] and "publishNotReadyAddresses" not in svc["spec"]  # ready pods only
    assert svc["spec"]["selector"] == nm.node_selector_labels("dsv3")
    assert svc["spec"]["selector"].items() <= plan.statefulset["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]
    assert mf.api_endpoint("dsv3", "inference", spec()) == "http://dsv3-api.inference.svc:8000"
    kinds = [(c["kind"], c["metadata"]["name"]) for c in plan.children]
    assert kinds.index(("Service", "dsv3-api")) < kinds.index(("StatefulSet", "dsv3-node"))


def test_all_children_validate_against_kubernetes_schemas() -> None:
    plan = _plan()
    for child in plan.children:
        kubernetes_validate.validate(child, K8S, strict=True)
    key = h200_type().key
    job = mf.build_hardware_calibration_job("inference", "t", key, 2, OperatorSettings())
    kubernetes_validate.validate(job, K8S, strict=True)
    model_job = mf.build_model_calibration_job("inference", "k", 1, spec(calibration={"traces": ["t.npz"]}), [], OperatorSettings())
    kubernetes_validate.validate(model_job, K8S, strict=True)


def test_tuning_changes_configmap_but_not_the_pod_template() -> None:
    base = _plan()
    tuned = _plan(allocation_interval=37, pooled_experts=100)
    assert tuned.allocation_interval == 37 and tuned.pooled_experts == 100
    assert tuned.template_hash == base.template_hash
    assert tuned.config_hash == base.config_hash
    assert tuned.config_map["data"] != base.config_map["data"]  # the runtime reloads it


def test_image_or_model_changes_change_the_template() -> None:
    base = _plan()
    assert _plan(s=spec(runtime__image="other:1")).template_hash != base.template_hash
    other_model = _plan(s=spec(model__revision="r2"))
    assert other_model.template_hash != base.template_hash
    assert other_model.config_hash != base.config_hash


def test_plan_is_deterministic() -> None:
    a, b = _plan(), _plan()
    assert json.dumps(a.children, sort_keys=True) == json.dumps(b.children, sort_keys=True)


def test_tuned_values_are_clamped_to_bounds_and_cap() -> None:
    s = spec(vexpert={"allocationInterval": {"min": 5, "max": 50}, "pinnedExperts": {"max": 100}})
    plan = _plan(s=s, allocation_interval=500, pooled_experts=999)
    assert plan.allocation_interval == 50
    assert plan.pooled_experts == 100
    fixed = _plan(s=spec(vexpert={"allocationInterval": {"mode": "fixed", "value": 12}}), allocation_interval=40)
    assert fixed.allocation_interval == 12


def test_calibration_jobs_follow_the_contract() -> None:
    key = NodeTypeKey(gpu_product="NVIDIA-H200", gpu_count=8, gpu_memory_mib=143771, driver_version="550.54.15")
    job = mf.build_hardware_calibration_job("ns", "type-a", key, 3, OperatorSettings())
    assert job["metadata"]["name"] == nm.hardware_job_name("type-a", 3)
    assert job["spec"]["backoffLimit"] == 0  # the operator retries, with backoff, as new attempts
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vexpert", "calibrate"]
    assert c["args"][:3] == ["hardware", "--gpus", "8"]
    assert json.loads(c["args"][4]) == key.model_dump()
    assert c["args"][-2:] == ["--termination-message-path", "/dev/termination-log"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["metadata"]["labels"][nm.LABEL_ATTEMPT] == "3"
    traced = spec(calibration={"traces": ["traces/a.npz", "/data/b.npz"]}, vexpert={"vmax": 1})
    mjob = mf.build_model_calibration_job("ns", "k", 1, traced, [], OperatorSettings())
    mpod = mjob["spec"]["template"]["spec"]
    args = mpod["containers"][0]["args"]
    assert args[:5] == ["model", "--trace", "/models/DeepSeek-V3/traces/a.npz", "--trace", "/data/b.npz"]
    assert args[args.index("--gpus") + 1] == "64"  # the EP degree the plans are made for
    assert args[args.index("--vmax") + 1] == "2"  # V = 1..2 so β and the intercept separate
    assert args[args.index("--k") + 1] == "10"
    assert "nvidia.com/gpu" not in mpod["containers"][0]["resources"]["limits"]  # a CPU job
    assert "affinity" not in mpod
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in mpod["containers"][0]["volumeMounts"]
    # it mounts the checkpoint (maybe a hostPath only the GPU nodes have): it goes where the deployment may run
    placed = spec(calibration={"traces": ["t.npz"]}, runtime__nodeSelector={"pool": "gpu"},
                  runtime__tolerations=[{"operator": "Exists"}])
    ppod = mf.build_model_calibration_job("ns", "k", 1, placed, [], OperatorSettings())["spec"]["template"]["spec"]
    assert ppod["nodeSelector"] == {"pool": "gpu"} and ppod["tolerations"] == [{"operator": "Exists"}]


def test_profiles_combine_halves_deterministically() -> None:
    hw = PerformanceProfile(hardware=HardwareParameters(h2d_bandwidth_gb_per_s=55.0, contention_eta=0.03),
                            provenance=Provenance(source="hardware-calibration", created_at="2026-01-02T00:00:00"))
    model = PerformanceProfile(load_balance=LoadBalanceParameters(alpha=-0.5, beta=0.4, intercept=0.2),
                               provenance=Provenance(source="model-calibration", created_at="2026-01-01T00:00:00",
                                                     model="m", model_revision="r"))
    combined = combine_profiles(hw, model)
    assert combined.hardware.h2d_bandwidth_gb_per_s == 55.0
    assert combined.load_balance.alpha == -0.5
    assert combined.provenance.created_at == "2026-01-02T00:00:00"
    assert combined == combine_profiles(hw, model)
    assert combine_profiles(None, None) == default_profile()
    assert default_profile().provenance.created_at == default_profile().provenance.created_at


def test_node_and_model_profile_builders_round_trip() -> None:
    key = NodeTypeKey(gpu_product="NVIDIA-H200", gpu_count=8)
    obj = mf.build_node_profile("t", key, default_profile(), 2 * 1024 * GIB, "job-1", "ns")
    assert obj["spec"]["nodeType"]["gpuProduct"] == "NVIDIA-H200"
    assert obj["spec"]["profile"]["hardware"]["h2d_bandwidth_gb_per_s"] == 26.0
    assert obj["metadata"]["annotations"][nm.ANNOTATION_SOURCE_JOB] == "ns/job-1"
    PerformanceProfile.model_validate(obj["spec"]["profile"])
    model = mf.build_model_profile("ns", "k", "m", "r", "deepseek_v3", default_profile())
    assert model["spec"]["model"] == "m" and model["metadata"]["namespace"] == "ns"



def _affinity_matches(terms: list[list[dict[str, Any]]], labels: dict[str, str]) -> bool:
    """Kubernetes' required node affinity: any term whose expressions all hold."""
    def holds(e: dict[str, Any]) -> bool:
        if e["operator"] == "In":
            return labels.get(e["key"]) in e["values"]
        assert e["operator"] == "DoesNotExist"
        return e["key"] not in labels
    return any(all(holds(e) for e in term) for term in terms)


BASE_LABELS = {"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "143771"}


@pytest.mark.parametrize("labels", [
    {"nvidia.com/cuda.driver-version.full": "550.54.15", "node.kubernetes.io/instance-type": "p5en.48xlarge"},
    {"nvidia.com/cuda.driver-version.major": "550", "nvidia.com/cuda.driver-version.minor": "54",
     "nvidia.com/cuda.driver-version.revision": "15", "node.kubernetes.io/instance-type": "p5en.48xlarge"},
    {"nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "54", "nvidia.com/cuda.driver.rev": "15",
     "beta.kubernetes.io/instance-type": "p5en.48xlarge"},
    {"nvidia.com/cuda.driver-version.full": "550.54.15"},  # no instance type (on-premises)
])
def test_a_type_pins_its_own_nodes_whichever_labels_carry_it(labels: dict[str, str]) -> None:
    node = {**BASE_LABELS, **labels}
    key = node_type_key(node)
    assert key is not None and key.driver_version == "550.54.15"
    assert _affinity_matches(node_type_terms(key), node)


def test_a_type_without_an_instance_type_does_not_match_other_types_nodes() -> None:
    onprem = {**BASE_LABELS, "nvidia.com/cuda.driver-version.full": "550.54.15"}
    cloud = {**onprem, "node.kubernetes.io/instance-type": "p5en.48xlarge"}
    newer = {**onprem, "nvidia.com/cuda.driver-version.full": "560.35.03"}
    onprem_key, cloud_key = node_type_key(onprem), node_type_key(cloud)
    assert onprem_key is not None and cloud_key is not None
    assert not _affinity_matches(node_type_terms(onprem_key), cloud)
    assert not _affinity_matches(node_type_terms(cloud_key), onprem)
    assert not _affinity_matches(node_type_terms(onprem_key), newer)
