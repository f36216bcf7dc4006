"""Unit tests of the operator's pure decisions: node typing, validation, calibration, group, tuning."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operator_support.samples import gpu_node, pod, raw_spec, spec
from vexpert_operator import naming as nm
from vexpert_operator.api import GroupStatus, Toleration, VExpertDeploymentStatus
from vexpert_operator.calibration import (
    JobSummary,
    decide_calibration,
    failure_reason,
    parse_result,
    retry_delay,
    summarize_job,
    termination_message,
)
from vexpert_operator.group import decide_group, restart_delay, summarize_pod
from vexpert_operator.nodetypes import (
    candidate_types,
    choose_node_type,
    node_fits,
    node_info,
    node_type_key,
    node_type_name,
    tolerates,
)
from vexpert_operator.settings import OperatorSettings
from vexpert_operator.sizing import KNOWN_SHAPES, size_pod
from vexpert_operator.status import merge_patch_between, set_condition, status_patch
from vexpert_operator.tuning import (
    SERVE_INTER_TOKEN_LATENCY,
    SERVE_TIME_TO_FIRST_TOKEN,
    SERVE_TOKENS_PER_SECOND,
    MetricsError,
    RuntimeSample,
    TuningPolicy,
    TuningState,
    aggregate,
    decide_tuning,
    parse_runtime_metrics,
    serving_rates,
)
from vexpert_operator.validation import check_fit, parse_spec, validate_spec

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)

# ------------------------------------------------------------------------------------------ node types


def test_node_type_key_from_gfd_labels() -> None:
    key = node_type_key(gpu_node("a")["metadata"]["labels"])
    assert key is not None
    assert (key.gpu_product, key.gpu_count, key.gpu_memory_mib, key.driver_version, key.instance_type) == (
        "NVIDIA-H200", 8, 143771, "550.54.15", "p5en.48xlarge")
    parts = {"nvidia.com/gpu.product": "A100", "nvidia.com/cuda.driver-version.major": "535",
             "nvidia.com/cuda.driver-version.minor": "104", "nvidia.com/cuda.driver-version.revision": "05"}
    assert node_type_key(parts).driver_version == "535.104.05"  # type: ignore[union-attr]
    old = {"nvidia.com/gpu.product": "A100", "nvidia.com/cuda.driver.major": "470", "nvidia.com/cuda.driver.minor": "82",
           "nvidia.com/cuda.driver.rev": "01"}
    assert node_type_key(old).driver_version == "470.82.01"  # type: ignore[union-attr]
    assert node_type_key({"kubernetes.io/hostname": "cpu-node"}) is None


def test_a_new_driver_version_is_a_new_type() -> None:
    a = node_type_key(gpu_node("a")["metadata"]["labels"])
    b = node_type_key(gpu_node("b", driver="560.35.03")["metadata"]["labels"])
    same = node_type_key(gpu_node("c")["metadata"]["labels"])
    assert a and b and same
    assert node_type_name(a) != node_type_name(b)
    assert node_type_name(a) == node_type_name(same)
    assert len(node_type_name(a)) <= 63


def test_tolerations_match_like_kubernetes() -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    assert tolerates([Toleration(key="nvidia.com/gpu", operator="Exists")], taint)
    assert tolerates([Toleration(operator="Exists")], taint)
    assert tolerates([Toleration(key="nvidia.com/gpu", value="present")], taint)
    assert not tolerates([Toleration(key="nvidia.com/gpu", value="other")], taint)
    assert not tolerates([Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoExecute")], taint)
    assert not tolerates([], taint)


def test_node_fits_checks_selector_gpus_taints_and_cordon() -> None:
    ok = node_info(gpu_node("a"))
    assert node_fits(ok, {}, [], 8)
    assert not node_fits(ok, {"pool": "x"}, [], 8)
    assert not node_fits(ok, {}, [], 16)
    tainted = node_info(gpu_node("b", taints=[{"key": "gpu", "effect": "NoSchedule"}]))
    assert not node_fits(tainted, {}, [], 8)
    assert node_fits(tainted, {}, [Toleration(key="gpu", operator="Exists")], 8)
    prefer = node_info(gpu_node("c", taints=[{"key": "gpu", "effect": "PreferNoSchedule"}]))
    assert node_fits(prefer, {}, [], 8)
    assert not node_fits(node_info(gpu_node("d", unschedulable=True)), {}, [], 8)
    assert not node_fits(node_info({"metadata": {"name": "cpu"}}), {}, [], 1)


def test_candidate_types_group_nodes_and_choose_is_sticky() -> None:
    nodes = [node_info(gpu_node(f"h{i}")) for i in range(3)] + \
            [node_info(gpu_node(f"n{i}", driver="560.35.03")) for i in range(5)]
    types = candidate_types(nodes, {}, [], 8)
    assert sorted(len(t.nodes) for t in types.values()) == [3, 5]
    new = next(n for n, t in types.items() if len(t.nodes) == 5)
    old = next(n for n, t in types.items() if len(t.nodes) == 3)
    assert choose_node_type(types, 2) == new  # most nodes
    assert choose_node_type(types, 2, current=old) == old  # keep the current type: no needless roll
    assert choose_node_type(types, 4, current=old) == new  # unless it is too small now
    assert choose_node_type({}, 2) is None
    assert types[old].min_allocatable_memory == 2000 * 2**30


def _types(*nodes: dict) -> dict:
    return candidate_types([node_info(n) for n in nodes], {}, [], 8)


def test_cordoning_a_node_neither_moves_nor_resizes_a_running_group() -> None:
    a = [gpu_node(f"a{i}", allocatable="1200Gi") for i in range(3)]
    b = [gpu_node(f"b{i}", driver="560.35.03") for i in range(3)]
    spare = gpu_node("a-spare", allocatable="1190Gi")
    before = _types(*a, spare, *b)
    current = next(n for n, t in before.items() if t.nodes[0].name.startswith("a"))
    assert choose_node_type(before, 3, current) == current
    after = _types(*a[:2], gpu_node("a2", allocatable="1200Gi", unschedulable=True),
                   gpu_node("a-spare", allocatable="1190Gi", unschedulable=True), *b)
    # 2 schedulable + 2 cordoned nodes of the current type: the group stays, at the same size
    assert choose_node_type(after, 3, current) == current
    assert after[current].min_allocatable_memory == before[current].min_allocatable_memory == 1190 * 2**30


def test_no_move_to_a_type_that_cannot_hold_the_group_either() -> None:
    a = [gpu_node(f"a{i}") for i in range(2)]
    b = [gpu_node(f"b{i}", driver="560.35.03") for i in range(3)]
    types = _types(*a, *b)
    current = next(n for n, t in types.items() if t.nodes[0].name.startswith("a"))
    other = next(n for n in types if n != current)
    assert choose_node_type(types, 4, current) == current  # neither holds 4: a move would only roll
    assert choose_node_type(types, 3, current) == other  # the other one does


def test_ready_nodes_rank_the_types() -> None:
    a = [gpu_node(f"a{i}", ready=i < 5) for i in range(8)]  # 8 nodes, 5 Ready
    b = [gpu_node(f"b{i}", driver="560.35.03") for i in range(7)]  # 7 Ready
    types = _types(*a, *b)
    chosen = choose_node_type(types, 6)
    assert chosen is not None and types[chosen].ready_nodes == 7


def test_a_node_reporting_zero_allocatable_gpus_does_not_fit() -> None:
    node = gpu_node("x")
    node["status"]["allocatable"]["nvidia.com/gpu"] = "0"  # every GPU unhealthy
    assert not node_fits(node_info(node), {}, [], 8)
    del node["status"]["allocatable"]["nvidia.com/gpu"]  # not reported: the gpu.count label decides
    assert node_fits(node_info(node), {}, [], 8)


# ------------------------------------------------------------------------------------------ validation


def fields(problems) -> set[str]:
    return {p.field for p in problems}


def test_parse_spec_errors_name_the_camelcase_field() -> None:
    parsed, problems = parse_spec(raw_spec(parallelism__gpusPerNode=0))
    assert parsed is None
    assert fields(problems) == {"spec.parallelism.gpusPerNode"}
    _, problems = parse_spec(raw_spec(runtime__shmSize="lots"))
    assert fields(problems) == {"spec.runtime.shmSize"}
    _, problems = parse_spec(raw_spec(model__checkpoint={"claimName": "a", "hostPath": "/b"}))
    assert fields(problems) == {"spec.model.checkpoint"}
    _, problems = parse_spec(raw_spec(calibration={"mode": "given"}))
    assert "modelProfileRef" in problems[0].message
    _, problems = parse_spec(raw_spec(runtime__tolerations=[{"operator": "Maybe"}]))
    assert fields(problems) == {"spec.runtime.tolerations[0].operator"}


@pytest.mark.parametrize(("overrides", "field"), [
    ({"parallelism__expertParallelSize": 12}, "spec.parallelism.expertParallelSize"),
    ({"parallelism__expertParallelSize": 24, "parallelism__gpusPerNode": 8}, "spec.parallelism.expertParallelSize"),
    ({"model__architecture": "auto"}, "spec.model.shape"),
    ({"vexpert": {"allocationInterval": {"min": 50, "max": 10}}}, "spec.vexpert.allocationInterval.min"),
    ({"vexpert": {"allocationInterval": {"value": 5000}}}, "spec.vexpert.allocationInterval.value"),
    ({"vexpert": {"pinnedExperts": {"mode": "fixed"}}}, "spec.vexpert.pinnedExperts.value"),
    ({"vexpert": {"pinnedExperts": {"mode": "fixed", "value": 300}}}, "spec.vexpert.pinnedExperts.value"),
    ({"vexpert": {"pinnedExperts": {"min": 300}}}, "spec.vexpert.pinnedExperts.min"),
    ({"runtime__httpPort": 29500}, "spec.runtime.httpPort"),
    ({"runtime__env": [{"name": "VEXPERT_NODE_RANK", "value": "3"}]}, "spec.runtime.env[0].name"),
])
def test_validate_spec_names_the_field(overrides: dict, field: str) -> None:
    problems = validate_spec(spec(**overrides), "dsv3")
    assert field in fields(problems), problems


@pytest.mark.parametrize("value", [0, -0.5, 1.5, "most", True])
def test_a_bad_gpu_memory_utilization_names_the_field_and_the_fix(value: object) -> None:
    parsed, problems = parse_spec(raw_spec(runtime__gpuMemoryUtilization=value))
    assert parsed is None and [p.field for p in problems] == ["spec.runtime.gpuMemoryUtilization"]
    assert "is not a share in (0, 1]" in problems[0].message and "e.g. 0.9 (the default)" in problems[0].message
    assert spec().runtime.gpu_memory_utilization == 0.9
    assert spec(runtime__gpuMemoryUtilization=1).runtime.gpu_memory_utilization == 1.0


def test_removed_metrics_port_says_where_metrics_went() -> None:
    parsed, problems = parse_spec(raw_spec(runtime__metricsPort=9400))
    assert parsed is None and fields(problems) == {"spec.runtime"}
    assert "metricsPort was removed" in problems[0].message and "httpPort" in problems[0].message


def test_valid_spec_and_long_name() -> None:
    assert validate_spec(spec(), "dsv3") == []
    assert fields(validate_spec(spec(), "x" * 41)) == {"metadata.name"}


@pytest.mark.parametrize("name", ["1-deepseek", "deepseek.v3", "DSV3", "dsv3-"])
def test_names_the_node_service_and_statefulset_would_refuse(name: str) -> None:
    # a resource name may be any DNS subdomain; "<name>-nodes" (a Service) must be a DNS-1035 label
    problems = validate_spec(spec(), name)
    assert fields(problems) == {"metadata.name"} and "starting with a letter" in problems[0].message


@pytest.mark.parametrize(("toleration", "message"), [
    ({"key": "gpu", "operator": "Exists", "value": "h200"}, "value must be empty"),
    ({"value": "x", "effect": "NoSchedule"}, "empty key needs operator Exists"),
    ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}, "needs effect NoExecute"),
])
def test_tolerations_the_api_server_would_refuse(toleration: dict, message: str) -> None:
    parsed, problems = parse_spec(raw_spec(runtime__tolerations=[{"operator": "Exists"}, toleration]))
    assert parsed is None and fields(problems) == {"spec.runtime.tolerations[1]"}
    assert message in problems[0].message


def test_tolerations_the_api_server_accepts() -> None:
    ok = [{"operator": "Exists"}, {"key": "gpu", "operator": "Equal", "value": "h200", "effect": "NoSchedule"},
          {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
           "tolerationSeconds": 30}]
    parsed, problems = parse_spec(raw_spec(runtime__tolerations=ok))
    assert problems == [] and parsed is not None and len(parsed.runtime.tolerations) == 3


@pytest.mark.parametrize("mount_path", ["/dev/shm", "/dev/shm/models", "/etc/vexpert", "/etc", "/etc/vexpert/../vexpert",
                                        "/dev", "/", "models"])
def test_checkpoint_mount_path_may_not_hide_what_the_operator_mounts(mount_path: str) -> None:
    problems = validate_spec(spec(model__checkpoint__mountPath=mount_path), "dsv3")
    assert fields(problems) == {"spec.model.checkpoint.mountPath"}, problems


@pytest.mark.parametrize(("extra", "message"), [
    ({"memory": "8Gi"}, "sized by the operator"),
    ({"nvidia.com/gpu": "1"}, "sized by the operator"),
    ({"cpu": "4"}, "sized by the operator"),
    ({"rdma/ib": "one"}, "not a Kubernetes quantity"),
    ({"rdma/ib": "500m"}, "whole number"),
])
def test_extra_resources_are_quantities_and_do_not_override_sizing(extra: dict, message: str) -> None:
    key = next(iter(extra))
    problems = validate_spec(spec(runtime__extraResources=extra), "dsv3")
    assert fields(problems) == {f"spec.runtime.extraResources[{key}]"} and message in problems[0].message


def test_extra_resources_and_mount_paths_that_are_fine() -> None:
    s = spec(runtime__extraResources={"rdma/ib": "1", "hugepages-2Mi": "2Gi", "ephemeral-storage": "50Gi"},
             model__checkpoint__mountPath="/models/")
    assert validate_spec(s, "dsv3") == []


def test_check_fit_host_and_gpu_memory() -> None:
    shape = KNOWN_SHAPES["deepseek_v3"]
    small = next(iter(candidate_types([node_info(gpu_node("a", allocatable="100Gi"))], {}, [], 8).values()))
    fixed = spec(vexpert={"pinnedExperts": {"mode": "fixed", "value": 64}})
    fit = small.memory_fit(1, 8 * 2**30)
    problems = check_fit(fixed, size_pod(fixed, shape, fit), fit)
    assert fields(problems) == {"spec.vexpert.pinnedExperts.value"}
    assert "does not fit" in problems[0].message and "node a" in problems[0].message
    auto = spec(vexpert={"pinnedExperts": {"min": 64}})
    assert fields(check_fit(auto, size_pod(auto, shape, fit), fit)) == {"spec.vexpert.pinnedExperts.min"}
    big = next(iter(candidate_types([node_info(gpu_node("b"))], {}, [], 8).values()))
    big_fit = big.memory_fit(1, 8 * 2**30)
    assert check_fit(spec(), size_pod(spec(), shape, big_fit), big_fit) == []
    h100 = next(iter(candidate_types([node_info(gpu_node("c", memory_mib=81559))], {}, [], 8).values()))
    ep16 = spec(parallelism__expertParallelSize=16)
    assert fields(check_fit(ep16, size_pod(ep16, shape, None), None, h100.gpu_memory_mib, "H100")) == \
        {"spec.vexpert.vmax"}


def test_experts_and_slots_must_fit_under_the_gpu_memory_utilization() -> None:
    shape = KNOWN_SHAPES["deepseek_v3"]
    h200 = next(iter(candidate_types([node_info(gpu_node("c"))], {}, [], 8).values()))
    ep64 = spec()
    gpu_bytes = size_pod(ep64, shape, None).gpu_bytes_per_gpu
    share = gpu_bytes / (h200.gpu_memory_mib * 2**20)  # what the experts and slots fill of one GPU
    roomy = spec(runtime__gpuMemoryUtilization=round(share + 0.01, 2))
    assert check_fit(roomy, size_pod(roomy, shape, None), None, h200.gpu_memory_mib, "H200") == []
    tight = spec(runtime__gpuMemoryUtilization=round(share - 0.01, 2))
    problems = check_fit(tight, size_pod(tight, shape, None), None, h200.gpu_memory_mib, "H200")
    assert fields(problems) == {"spec.vexpert.vmax"}
    assert "runtime.gpuMemoryUtilization" in problems[0].message and "raise runtime.gpuMemoryUtilization" in \
        problems[0].message


# ----------------------------------------------------------------------------------------- calibration


def job(name: str, attempt: int, condition: str | None = None, when: str = "2026-11-30T11:59:00Z",
        message: str = "", harvest_error: str = "") -> dict:
    obj: dict = {"metadata": {"name": name, "labels": {nm.LABEL_ATTEMPT: str(attempt)}, "annotations": {}},
                 "status": {}}
    if condition:
        obj["status"]["conditions"] = [{"type": condition, "status": "True", "lastTransitionTime": when,
                                        "message": message}]
        if condition == "Complete":
            obj["status"]["completionTime"] = when
    if harvest_error:
        obj["metadata"]["annotations"][nm.ANNOTATION_HARVEST_ERROR] = harvest_error
    return obj


def test_summarize_job_states() -> None:
    assert summarize_job(job("a", 1)).state == "active"
    done = summarize_job(job("a", 1, "Complete"))
    assert done.state == "succeeded" and done.finished_at == dt.datetime(2026, 11, 30, 11, 59, tzinfo=dt.timezone.utc)
    failed = summarize_job(job("a", 2, "Failed", message="BackoffLimitExceeded"))
    assert failed.state == "failed" and failed.attempt == 2 and "BackoffLimit" in failed.message
    bad = summarize_job(job("a", 1, "Complete", harvest_error="not JSON"))
    assert bad.state == "failed" and bad.message == "not JSON"


def test_decide_calibration_create_wait_harvest_backoff_retry() -> None:
    assert decide_calibration([], NOW, 30, 600).action == "create"
    running = [JobSummary("j1", 1, "active", None)]
    assert decide_calibration(running, NOW, 30, 600).action == "wait"
    failed_at = NOW - dt.timedelta(seconds=10)
    one_failure = [JobSummary("j1", 1, "failed", failed_at, "exit 3")]
    step = decide_calibration(one_failure, NOW, 30, 600)
    assert step.action == "backoff" and step.retry_at == failed_at + dt.timedelta(seconds=30)
    retry = decide_calibration(one_failure, NOW + dt.timedelta(seconds=25), 30, 600)
    assert retry.action == "create" and retry.attempt == 2
    two_failures = [*one_failure, JobSummary("j2", 2, "failed", NOW, "exit 3")]
    assert decide_calibration(two_failures, NOW, 30, 600).retry_at == NOW + dt.timedelta(seconds=60)
    done = [*two_failures, JobSummary("j3", 3, "succeeded", NOW)]
    assert decide_calibration(done, NOW, 30, 600).action == "harvest"


def test_old_failed_attempts_are_pruned_and_the_backoff_keeps_growing() -> None:
    from vexpert_operator.calibration import stale_attempts

    failed = [JobSummary(f"j{i}", i, "failed", NOW - dt.timedelta(seconds=100 - i), "exit 3") for i in range(1, 9)]
    assert stale_attempts(failed) == ["j1", "j2", "j3", "j4", "j5"]  # the last 3 stay for inspection
    assert stale_attempts([*failed[:2], JobSummary("j3", 3, "active", None)]) == []
    kept = failed[5:]
    # the delay follows the attempt number, not how many failed Jobs are left: 8 failures → the cap
    step = decide_calibration(kept, NOW, 30, 600)
    assert step.action == "backoff" and step.attempt == 8
    assert step.retry_at == kept[-1].finished_at + dt.timedelta(seconds=600)
    assert decide_calibration(kept, NOW + dt.timedelta(seconds=700), 30, 600).attempt == 9


def test_retry_delay_doubles_up_to_the_cap() -> None:
    assert [retry_delay(n, 30, 200) for n in range(5)] == [0, 30, 60, 120, 200]


PROFILE = ('{"api_version": "vexpert.io/v1alpha1", "hardware": {"h2d_bandwidth_gb_per_s": 50.0, '
           '"contention_eta": 0.05, "compute_bound_tokens_per_expert": 160}}')


def test_parse_result_accepts_profiles_and_rejects_the_rest() -> None:
    assert parse_result(PROFILE).hardware.h2d_bandwidth_gb_per_s == 50.0
    for bad, why in (("", "empty"), ("{", "not JSON"), ('{"hardware": {"contention_eta": -1}}', "contention_eta"),
                     ('{"bogus": 1}', "bogus"), ("x" * 5000, "4096")):
        with pytest.raises(ValueError, match=why):
            parse_result(bad)


def test_termination_message_and_failure_reason() -> None:
    pod_obj = {"status": {"containerStatuses": [{"name": "calibrate", "state": {"terminated": {
        "exitCode": 3, "message": "cudaErrorNoDevice\n"}}}]}}
    assert termination_message(pod_obj) == (3, "cudaErrorNoDevice\n")
    assert termination_message({"status": {}}) == (None, "")
    summary = JobSummary("j", 1, "failed", NOW, "BackoffLimitExceeded")
    assert failure_reason(pod_obj, summary) == "exit 3: cudaErrorNoDevice"
    assert failure_reason(None, summary) == "BackoffLimitExceeded"


# ----------------------------------------------------------------------------------------------- group


def pods(n: int, hash_: str = "h1", **kw) -> list:
    return [summarize_pod(pod(f"d-node-{i}", f"u{i}", hash_, **kw)) for i in range(n)]


def test_group_formed_when_every_rank_is_ready() -> None:
    decision = decide_group(pods(3), "h1", 3, GroupStatus(), NOW, 10, 300)
    assert decision.action == "none" and decision.formed and decision.members == ["u0", "u1", "u2"]
    partial = decide_group(pods(3, ready=False), "h1", 3, GroupStatus(), NOW, 10, 300)
    assert not partial.formed and partial.ready_nodes == 0


def test_a_template_change_rolls_every_rank_at_once() -> None:
    mixed = [*pods(2, "old"), summarize_pod(pod("d-node-2", "u2", "new"))]
    decision = decide_group(mixed, "new", 3, GroupStatus(), NOW, 10, 300)
    assert decision.action == "reform" and not decision.is_failure
    assert decision.delete == ["d-node-0", "d-node-1", "d-node-2"]


def test_a_failed_rank_reforms_the_group_with_backoff() -> None:
    crashed = [*pods(2), summarize_pod(pod("d-node-2", "u2", "h1", restarts=1))]
    first = decide_group(crashed, "h1", 3, GroupStatus(), NOW, 10, 300)
    assert first.action == "reform" and first.is_failure and len(first.delete) == 3
    assert "d-node-2" in first.reason and "NCCL timeout" in first.reason
    recent = GroupStatus(restarts=2, last_restart_time="2026-11-30T11:59:50Z")
    waiting = decide_group(crashed, "h1", 3, recent, NOW, 10, 300)
    assert waiting.action == "backoff"
    assert waiting.retry_at == dt.datetime(2026, 11, 30, 12, 0, 10, tzinfo=dt.timezone.utc)
    failed_phase = [summarize_pod(pod("d-node-0", "u0", "h1", phase="Failed", ready=False))]
    assert decide_group(failed_phase, "h1", 1, GroupStatus(), NOW, 10, 300).is_failure


def test_a_lost_member_reforms_the_group_and_terminating_pods_are_ignored() -> None:
    formed = GroupStatus(members=["u0", "u1", "u2"])
    replaced = [*pods(2), summarize_pod(pod("d-node-2", "u9", "h1", ready=False))]
    decision = decide_group(replaced, "h1", 3, formed, NOW, 10, 300)
    assert decision.action == "reform" and decision.is_failure
    assert "gone" in decision.reason
    going = pods(3, terminating=True)
    assert decide_group(going, "h1", 3, GroupStatus(), NOW, 10, 300).action == "none"


def test_restart_delay_doubles() -> None:
    assert [restart_delay(n, 10, 60) for n in range(5)] == [0, 10, 20, 40, 60]


# ---------------------------------------------------------------------------------------------- tuning

METRICS = """# HELP vexpert_balance_ratio mean/max GPU load
# TYPE vexpert_balance_ratio gauge
vexpert_balance_ratio{layer_group="0"} 0.7
vexpert_balance_ratio{layer_group="1"} 0.8
# TYPE vexpert_tokens_per_second gauge
vexpert_tokens_per_second 1000
# TYPE vexpert_allocation_interval gauge
vexpert_allocation_interval 10
# TYPE vexpert_unrelated_total counter
vexpert_unrelated_total 5
# TYPE vexpert_step_seconds gauge
vexpert_step_seconds NaN
"""


def test_parse_runtime_metrics_means_labels_and_drops_the_rest() -> None:
    values = parse_runtime_metrics(METRICS)
    assert values["vexpert_balance_ratio"] == pytest.approx(0.75)
    assert values["vexpert_tokens_per_second"] == 1000
    assert "vexpert_unrelated_total" not in values
    assert "vexpert_step_seconds" not in values  # NaN dropped


def test_parse_runtime_metrics_reads_the_runtimes_histograms() -> None:
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    alloc = Histogram("vexpert_allocator_seconds", "allocator", registry=reg)
    step = Histogram("vexpert_step_seconds", "step", registry=reg)
    balance = Gauge("vexpert_balance_ratio", "balance", ["layer"], registry=reg)
    for value in (0.01, 0.03):
        alloc.observe(value)
    step.observe(0.2)
    balance.labels(layer="0").set(0.6)
    balance.labels(layer="1").set(0.8)
    values = parse_runtime_metrics(generate_latest(reg))
    assert values["vexpert_allocator_seconds"] == pytest.approx(0.02)
    assert values["vexpert_step_seconds"] == pytest.approx(0.2)
    assert values["vexpert_balance_ratio"] == pytest.approx(0.7)


def test_skipped_allocations_count_as_free_windows_of_the_allocator() -> None:
    """The runtime skips an allocation that would not change the plan (vexpert_allocations_skipped_total):
    the allocator's time per window then includes those windows, and a node that skipped every one
    costs 0 — not "no data", which would leave the k tuner without its allocator share."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    alloc = Histogram("vexpert_allocator_seconds", "allocator", registry=reg)
    skipped = Counter("vexpert_allocations_skipped", "skipped", registry=reg)
    skipped.inc(3)
    assert parse_runtime_metrics(generate_latest(reg))["vexpert_allocator_seconds"] == 0.0
    alloc.observe(0.04)
    assert parse_runtime_metrics(generate_latest(reg))["vexpert_allocator_seconds"] == pytest.approx(0.01)


def test_parse_runtime_metrics_is_bounded() -> None:
    with pytest.raises(MetricsError, match="bytes"):
        parse_runtime_metrics(b"x" * 2000, max_bytes=1000)
    many = "".join(f"vexpert_balance_ratio{{l=\"{i}\"}} 0.5\n" for i in range(6000))
    with pytest.raises(MetricsError, match="samples"):
        parse_runtime_metrics(many, max_bytes=10**7)
    with pytest.raises(MetricsError):
        parse_runtime_metrics("vexpert_balance_ratio{ 1\n")


def test_aggregate_folds_pods() -> None:
    sample = aggregate([
        {"vexpert_balance_ratio": 0.7, "vexpert_balance_ratio_after_allocation": 0.8, "vexpert_tokens_per_second": 10,
         "vexpert_allocator_seconds": 0.01, "vexpert_step_seconds": 0.1, "vexpert_allocation_interval": 10},
        {"vexpert_balance_ratio": 0.9, "vexpert_balance_decay": 0.02, "vexpert_tokens_per_second": 30,
         "vexpert_degraded": 1, "vexpert_allocation_interval": 10},
    ])
    assert sample.pods == 2
    assert sample.balance_ratio == pytest.approx(0.8)
    assert sample.balance_decay == pytest.approx(0.125)  # worst pod
    assert sample.tokens_per_second == 40
    assert sample.allocator_share == pytest.approx(0.01)
    assert sample.degraded_pods == 1
    assert sample.reported_k == {10}


def state(**kw) -> TuningState:
    base = {"allocation_interval": 10, "pooled_experts": 100, "k_mode": "auto", "k_min": 2, "k_max": 200,
            "np_mode": "auto", "np_min": 10, "np_cap": 100}
    base.update(kw)
    return TuningState(**base)


def sample(**kw) -> RuntimeSample:
    base = {"pods": 2, "reported_k": {10}, "reported_np": {100}}
    base.update(kw)
    return RuntimeSample(**base)


def serve_metrics(generated: int, itl: list[float], ttft: list[float], running: int = 3, waiting: int = 1,
                  ok: int = 5, errors: int = 1) -> bytes:
    """What `vexpert serve` adds to /metrics: counters, histograms and gauges (prometheus_client)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    requests = Counter("vexpert_serve_requests", "requests", ["status"], registry=reg)
    requests.labels(status="ok").inc(ok)
    requests.labels(status="error").inc(errors)
    Counter("vexpert_serve_generated_tokens", "generated", registry=reg).inc(generated)
    Counter("vexpert_serve_prompt_tokens", "prompt", registry=reg).inc(2 * generated)
    itl_h = Histogram("vexpert_serve_inter_token_latency_seconds", "itl", registry=reg)
    ttft_h = Histogram("vexpert_serve_time_to_first_token_seconds", "ttft", registry=reg)
    for value in itl:
        itl_h.observe(value)
    for value in ttft:
        ttft_h.observe(value)
    Gauge("vexpert_serve_requests_running", "running", registry=reg).set(running)
    Gauge("vexpert_serve_requests_waiting", "waiting", registry=reg).set(waiting)
    Gauge("vexpert_serve_kv_cache_usage_ratio", "kv", registry=reg).set(0.4)
    Gauge("vexpert_step_seconds", "step", registry=reg).set(0.02)
    return generate_latest(reg)


def test_parse_runtime_metrics_reads_the_serving_series() -> None:
    values = parse_runtime_metrics(serve_metrics(100, [0.02, 0.04], [0.5]))
    assert values["vexpert_serve_requests_total"] == 6  # summed over status
    assert values["vexpert_serve_generated_tokens_total"] == 100
    assert values["vexpert_serve_prompt_tokens_total"] == 200
    assert values["vexpert_serve_inter_token_latency_seconds_sum"] == pytest.approx(0.06)
    assert values["vexpert_serve_inter_token_latency_seconds_count"] == 2
    assert values["vexpert_serve_time_to_first_token_seconds_count"] == 1
    assert values["vexpert_serve_requests_running"] == 3 and values["vexpert_serve_requests_waiting"] == 1
    assert values["vexpert_serve_kv_cache_usage_ratio"] == pytest.approx(0.4)
    assert values["vexpert_step_seconds"] == pytest.approx(0.02)
    assert not any(name.endswith(("_bucket", "_created")) for name in values)


def test_serving_rates_are_taken_between_two_scrapes_of_a_pod() -> None:
    before = parse_runtime_metrics(serve_metrics(100, [0.02, 0.04], [0.5]))
    after = parse_runtime_metrics(serve_metrics(700, [0.02, 0.04, 0.05, 0.05, 0.05], [0.5, 0.3]))
    rates = serving_rates(after, before, 60.0)
    assert rates[SERVE_TOKENS_PER_SECOND] == pytest.approx(10.0)  # 600 tokens in 60 s
    assert rates[SERVE_INTER_TOKEN_LATENCY] == pytest.approx(0.05)  # the 3 new observations only
    assert rates[SERVE_TIME_TO_FIRST_TOKEN] == pytest.approx(0.3)
    assert serving_rates(after, None, 60.0) == {}  # first scrape: no rate yet
    assert serving_rates(before, after, 60.0) == {}  # counters went down: the container restarted
    idle = serving_rates(before, before, 60.0)
    assert idle == {SERVE_TOKENS_PER_SECOND: 0.0}  # no new latency observations: no latency
    assert serving_rates({"vexpert_step_seconds": 0.1}, {"vexpert_step_seconds": 0.1}, 60.0) == {}  # `vexpert node`


def test_aggregate_reads_serving_rates_and_takes_the_allocator_share_of_inter_token_latency() -> None:
    pod = {"vexpert_allocator_seconds": 0.06, "vexpert_step_seconds": 0.05, "vexpert_allocation_interval": 10,
           "vexpert_tokens_per_second": 999, "vexpert_serve_requests_running": 3, "vexpert_serve_requests_waiting": 1}
    served = aggregate([
        pod | {SERVE_TOKENS_PER_SECOND: 100.0, SERVE_INTER_TOKEN_LATENCY: 0.1, SERVE_TIME_TO_FIRST_TOKEN: 0.4},
        pod | {SERVE_TOKENS_PER_SECOND: 50.0, SERVE_INTER_TOKEN_LATENCY: 0.2, SERVE_TIME_TO_FIRST_TOKEN: 0.2},
    ])
    assert served.generated_tokens_per_second == 150
    assert served.inter_token_latency == pytest.approx(0.15) and served.time_to_first_token == pytest.approx(0.3)
    assert served.requests_running == 6 and served.requests_waiting == 2
    assert served.allocator_share == pytest.approx(0.06) and served.share_basis == "inter-token latency"
    assert not served.serving  # the counters themselves were not in these dicts
    assert aggregate([pod | {"vexpert_serve_generated_tokens_total": 5.0}]).serving
    old = aggregate([pod, pod])  # no serving rates (`vexpert node`, or the first scrape): step time as before
    assert old.generated_tokens_per_second is None and old.inter_token_latency is None
    assert old.allocator_share == pytest.approx(0.12) and old.share_basis == "step time"


def test_k_is_tuned_on_inter_token_latency_while_serving() -> None:
    # The step gauge alone (12 %) would lengthen k; what clients wait per token is 4x the step, so
    # the allocator's share of it (3 %) is within the dead band.
    step_only = decide_tuning(state(), sample(allocator_share=0.12, balance_decay=0.01))
    assert step_only.allocation_interval == 15 and "of step time" in step_only.reason
    serving = decide_tuning(state(), sample(allocator_share=0.03, share_basis="inter-token latency",
                                            balance_decay=0.01, generated_tokens_per_second=500.0))
    assert not serving.k_changed and "allocator 3.0% of inter-token latency" in serving.reason
    costly = decide_tuning(state(), sample(allocator_share=0.12, share_basis="inter-token latency",
                                           generated_tokens_per_second=500.0))
    assert costly.allocation_interval == 15 and "12.0% of inter-token latency" in costly.reason


def test_k_is_held_while_the_server_is_idle() -> None:
    idle = decide_tuning(state(), sample(allocator_share=0.5, balance_decay=0.01, generated_tokens_per_second=0.0,
                                         memory_pressure=0.995))
    assert not idle.k_changed and "idle" in idle.reason
    assert idle.np_changed and idle.pooled_experts == 80  # memory pressure does not wait for traffic
    first = decide_tuning(state(), sample(allocator_share=0.5, balance_decay=0.01, serving=True))
    assert not first.k_changed and "second scrape" in first.reason  # serving, no rate yet: not on the step gauge
    node = decide_tuning(state(), sample(allocator_share=0.5, balance_decay=0.01))  # no serving series: as before
    assert node.k_changed


def test_tuning_holds_while_a_ready_pod_cannot_be_scraped() -> None:
    assert decide_tuning(state(), sample(allocator_share=0.12, balance_decay=0.01)).changed  # all answered: k moves
    held = decide_tuning(state(), sample(allocator_share=0.12, balance_decay=0.01, unscraped_pods=1))
    assert not held.changed and "could not be scraped" in held.reason


def test_k_lengthens_when_the_allocator_is_costly_and_shortens_when_balance_decays() -> None:
    longer = decide_tuning(state(), sample(allocator_share=0.12, balance_decay=0.01))
    assert longer.allocation_interval == 15 and longer.k_changed and "allocator" in longer.reason
    shorter = decide_tuning(state(), sample(allocator_share=0.005, balance_decay=0.2))
    assert shorter.allocation_interval == 6 and "decays" in shorter.reason
    held = decide_tuning(state(), sample(allocator_share=0.03, balance_decay=0.07))
    assert not held.changed and "dead band" in held.reason
    conflict = decide_tuning(state(), sample(allocator_share=0.12, balance_decay=0.2))
    assert not conflict.k_changed


def test_k_respects_bounds_fixed_mode_and_cooldown() -> None:
    assert decide_tuning(state(k_max=12), sample(allocator_share=0.5)).allocation_interval == 12
    at_max = decide_tuning(state(allocation_interval=12, k_max=12), sample(allocator_share=0.5, reported_k={12}))
    assert not at_max.changed and "upper bound" in at_max.reason
    assert decide_tuning(state(allocation_interval=3, k_min=3), sample(balance_decay=0.5, reported_k={3})
                         ).allocation_interval == 3
    assert not decide_tuning(state(k_mode="fixed"), sample(allocator_share=0.5)).changed
    cooling = decide_tuning(state(decisions_since_k_change=1), sample(allocator_share=0.5))
    assert not cooling.changed and "cooldown" in cooling.reason


def test_np_shrinks_under_pressure_and_grows_back_on_misses() -> None:
    shrink = decide_tuning(state(), sample(memory_pressure=0.995))
    assert shrink.pooled_experts == 80 and shrink.np_changed
    grow = decide_tuning(state(pooled_experts=60), sample(pool_hit_ratio=0.8, memory_pressure=0.5,
                                                          reported_np={60}))
    assert grow.pooled_experts == 75
    assert decide_tuning(state(pooled_experts=90), sample(pool_hit_ratio=0.8, reported_np={90})
                         ).pooled_experts == 100  # capped
    full = decide_tuning(state(), sample(pool_hit_ratio=0.99))
    assert not full.np_changed and "node memory allows" in full.reason
    over = decide_tuning(state(pooled_experts=120), sample(reported_np={120}))
    assert over.pooled_experts == 100


def test_tuning_holds_without_data_while_degraded_or_before_the_last_change_applies() -> None:
    assert not decide_tuning(state(), RuntimeSample(pods=0)).changed
    degraded = decide_tuning(state(), sample(degraded_pods=1, allocator_share=0.5))
    assert not degraded.changed and "degraded" in degraded.reason
    stale = decide_tuning(state(allocation_interval=15), sample(reported_k={10}, allocator_share=0.5))
    assert not stale.changed and "waiting for the runtime" in stale.reason


def at(st_: TuningState, **kw) -> RuntimeSample:
    """A sample from pods that run ``st_``'s k and Np."""
    return sample(reported_k={st_.allocation_interval}, reported_np={st_.pooled_experts}, **kw)


def test_shorten_k_fires_past_the_dead_band_only() -> None:
    s0 = state()
    shorter = decide_tuning(s0, at(s0, balance_decay=0.101, allocator_share=0.01))
    assert shorter.k_changed and shorter.allocation_interval == 6 and "decays 10.1%" in shorter.reason
    assert not decide_tuning(s0, at(s0, balance_decay=0.10, allocator_share=0.01)).k_changed  # at the threshold
    assert not decide_tuning(s0, at(s0, balance_decay=0.2, allocator_share=0.02)).k_changed  # allocator not cheap
    assert decide_tuning(s0, at(s0, balance_decay=0.2)).allocation_interval == 6  # no allocator data: decay decides
    # Hysteresis: what k=6 would then show (decay ∝ k, share ∝ 1/k) does not lengthen it again.
    s1 = state(allocation_interval=6, decisions_since_k_change=1_000)
    assert decide_tuning(s1, at(s1, balance_decay=0.101 * 6 / 10, allocator_share=0.01 * 10 / 6)).allocation_interval <= 6


def test_shorten_k_stops_where_the_allocator_would_become_costly() -> None:
    s0 = state(allocation_interval=20)
    policy = TuningPolicy(k_step=4)
    d = decide_tuning(s0, at(s0, balance_decay=0.5, allocator_share=0.019), policy)
    assert d.allocation_interval == 8  # 20 / 4 = 5 would make the allocator 7.6% of step time
    assert 0.019 * 20 / d.allocation_interval <= policy.share_high
    s1 = state(allocation_interval=3)
    held = decide_tuning(s1, at(s1, balance_decay=0.5, allocator_share=0.019), TuningPolicy(share_high=0.021))
    assert not held.k_changed and "allocator" in held.reason


def test_lengthen_k_fires_past_the_dead_band_only() -> None:
    s0 = state()
    longer = decide_tuning(s0, at(s0, allocator_share=0.051, balance_decay=0.01))
    assert longer.k_changed and longer.allocation_interval == 15 and "allocator is 5.1%" in longer.reason
    assert not decide_tuning(s0, at(s0, allocator_share=0.05, balance_decay=0.01)).k_changed
    assert not decide_tuning(s0, at(s0, allocator_share=0.2, balance_decay=0.05)).k_changed  # balance decays
    assert decide_tuning(s0, at(s0, allocator_share=0.2)).allocation_interval == 15  # no decay data yet
    s1 = state(allocation_interval=15)
    assert decide_tuning(s1, at(s1, allocator_share=0.051 * 10 / 15, balance_decay=0.01 * 15 / 10)
                         ).allocation_interval >= 15


def test_lengthen_k_stops_where_the_balance_would_decay_too_much() -> None:
    s0 = state()
    policy = TuningPolicy(k_step=4)
    d = decide_tuning(s0, at(s0, allocator_share=0.2, balance_decay=0.045), policy)
    assert d.allocation_interval == 22  # 40 would let the balance decay 18%
    assert 0.045 * d.allocation_interval / 10 <= policy.decay_high
    held = decide_tuning(s0, at(s0, allocator_share=0.2, balance_decay=0.04), TuningPolicy(decay_high=0.041))
    assert not held.k_changed and "decay" in held.reason


def test_shrink_np_fires_past_the_dead_band_only() -> None:
    s0 = state()
    shrink = decide_tuning(s0, at(s0, memory_pressure=0.991))
    assert shrink.np_changed and shrink.pooled_experts == 80 and "pressure 99%" in shrink.reason
    assert not decide_tuning(s0, at(s0, memory_pressure=0.99)).np_changed
    # DeepSeek-V3 at its cap sits at ≈0.97 by design: that is not pressure.
    assert not decide_tuning(s0, at(s0, memory_pressure=0.974)).np_changed
    assert not decide_tuning(s0, at(s0, memory_pressure=0.96, pool_hit_ratio=0.5)).np_changed  # in the band
    floor = state(pooled_experts=10)
    at_min = decide_tuning(floor, at(floor, memory_pressure=0.999))
    assert not at_min.np_changed and "lower bound" in at_min.reason


def test_grow_np_fires_past_the_dead_band_only() -> None:
    s0 = state(pooled_experts=60)
    grow = decide_tuning(s0, at(s0, pool_hit_ratio=0.94, memory_pressure=0.5))
    assert grow.np_changed and grow.pooled_experts == 75 and "hit ratio 94%" in grow.reason
    assert decide_tuning(s0, at(s0, pool_hit_ratio=0.94)).pooled_experts == 75  # no pressure data
    assert not decide_tuning(s0, at(s0, pool_hit_ratio=0.95, memory_pressure=0.5)).np_changed
    assert not decide_tuning(s0, at(s0, pool_hit_ratio=0.5, memory_pressure=0.95)).np_changed
    # Not so far that the grown pool would count as pressure: 60 × 0.99 / 0.94 = 63.19.
    guarded = decide_tuning(s0, at(s0, pool_hit_ratio=0.5, memory_pressure=0.94))
    assert guarded.pooled_experts == 63 and 0.94 * 63 / 60 <= 0.99


def _closed_loop(start: TuningState, observe, steps: int = 40) -> list[tuple[int, int]]:
    """Decide, let the runtime apply the decision, observe again: the (k, Np) trajectory."""
    from dataclasses import replace

    current, path = start, [(start.allocation_interval, start.pooled_experts)]
    for _ in range(steps):
        d = decide_tuning(current, at(current, **observe(current.allocation_interval, current.pooled_experts)))
        current = replace(
            current, allocation_interval=d.allocation_interval, pooled_experts=d.pooled_experts,
            decisions_since_k_change=0 if d.k_changed else current.decisions_since_k_change + 1,
            decisions_since_np_change=0 if d.np_changed else current.decisions_since_np_change + 1,
        )
        path.append((current.allocation_interval, current.pooled_experts))
    return path


def _monotone(values: list[int]) -> bool:
    steps = [b - a for a, b in itertools.pairwise(values) if b != a]
    return all(x > 0 for x in steps) or all(x < 0 for x in steps)


@pytest.mark.parametrize("k0", [2, 40])
def test_k_settles_without_flapping(k0: int) -> None:
    # decay grows with k, the allocator's share of step time shrinks with it
    path = _closed_loop(state(allocation_interval=k0), lambda k, n: {"balance_decay": 0.012 * k,
                                                                    "allocator_share": 0.16 / k})
    ks = [k for k, _ in path]
    assert len(set(ks)) > 1 and _monotone(ks)
    k = ks[-1]
    assert ks[-10:] == [k] * 10 and 0.012 * k <= 0.10 and 0.16 / k <= 0.05  # settled inside the dead band


def test_np_settles_without_flapping() -> None:
    # pressure ∝ Np, the pool always misses: without the grow guard 100 → 80 → 100 → 80 …
    path = _closed_loop(state(), lambda k, n: {"memory_pressure": 0.999 * n / 100, "pool_hit_ratio": 0.8})
    nps = [n for _, n in path]
    final = nps[-1]
    assert nps[:4] == [100, 80, 80, 80] and 80 < final < 100 and nps[-10:] == [final] * 10  # 2 decisions of cooldown
    assert sum(1 for a, b in itertools.pairwise(nps) if b < a) == 1  # shrunk once, never again
    assert 0.999 * final / 100 <= 0.99


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 1000), k_min=st.integers(1, 50), span=st.integers(0, 500), n=st.integers(1, 256),
       cap=st.integers(1, 256), share=st.none() | st.floats(0, 1), decay=st.none() | st.floats(0, 1),
       pressure=st.none() | st.floats(0, 1.5), hits=st.none() | st.floats(0, 1))
def test_tuning_always_stays_within_bounds(k: int, k_min: int, span: int, n: int, cap: int, share: float | None,
                                           decay: float | None, pressure: float | None, hits: float | None) -> None:
    k_max = k_min + span
    k = max(k_min, min(k_max, k))
    n_min = min(5, cap)
    n = max(n_min, min(cap, n))
    st_ = state(allocation_interval=k, k_min=k_min, k_max=k_max, pooled_experts=n, np_min=n_min, np_cap=cap)
    decision = decide_tuning(st_, sample(allocator_share=share, balance_decay=decay, memory_pressure=pressure,
                                         pool_hit_ratio=hits, reported_k={k}, reported_np={n}))
    assert k_min <= decision.allocation_interval <= k_max
    assert n_min <= decision.pooled_experts <= cap
    # Hysteresis: a changed k would not be reversed by the same observation right after.
    if decision.k_changed:
        again = decide_tuning(state(allocation_interval=decision.allocation_interval, k_min=k_min, k_max=k_max,
                                    pooled_experts=n, np_min=n_min, np_cap=cap, decisions_since_k_change=0),
                              sample(allocator_share=share, balance_decay=decay,
                                     reported_k={decision.allocation_interval}, reported_np={n}))
        assert not again.k_changed


def test_default_policy_has_dead_bands() -> None:
    p = TuningPolicy()
    assert p.decay_low < p.decay_high and p.share_low < p.share_high and p.pressure_low < p.pressure_high


# ---------------------------------------------------------------------------------------------- status


def test_condition_transition_time_moves_only_on_change() -> None:
    conds = set_condition([], "Ready", False, "NodesNotReady", "0/2", "t1", 1)
    conds = set_condition(conds, "Ready", False, "NodesNotReady", "1/2", "t2", 1)
    assert conds[0].last_transition_time == "t1" and conds[0].message == "1/2"
    conds = set_condition(conds, "Ready", True, "GroupReady", "2/2", "t3", 2)
    assert conds[0].last_transition_time == "t3" and conds[0].observed_generation == 2
    conds = set_condition(conds, "Invalid", False, "Valid", "", "t3", 2)
    assert [c.type for c in conds] == ["Invalid", "Ready"]
    VExpertDeploymentStatus(conditions=conds)


def test_status_patch_clears_values_that_became_null() -> None:
    from operator_support.emulator import merge_patch

    stored = status_patch(VExpertDeploymentStatus.model_validate({
        "phase": "Running", "runtime": {"balanceRatio": 0.81, "tokensPerSecond": 1234.5, "scrapedPods": 2},
    }))
    new = VExpertDeploymentStatus.model_validate({"phase": "Running", "runtime": {"scrapedPods": 0}})
    patch = merge_patch_between(stored, status_patch(new))
    # only what changed, and the vanished values as explicit nulls (a merge patch keeps what it omits)
    assert patch == {"runtime": {"balanceRatio": None, "tokensPerSecond": None, "scrapedPods": 0}}
    assert merge_patch(stored, patch) == status_patch(new)
    assert merge_patch_between(status_patch(new), status_patch(new)) == {}


def test_operator_settings_from_env() -> None:
    cfg = OperatorSettings.from_env({"VEXPERT_OPERATOR_RECONCILE_INTERVAL_S": "2.5", "UNRELATED": "x"})
    assert cfg.reconcile_interval_s == 2.5 and cfg.metrics_port == 8080
    with pytest.raises(ValueError):
        OperatorSettings.from_env({"VEXPERT_OPERATOR_METRICS_PORT": "-1"})
