"""Issue #15: node pods that fit real GPU nodes, stable node types, cluster-wide calibration, Pending
pods explained, and `vexpert render` of the DeepSeek-V3 example against 1000/1500/2000Gi nodes.

Emulator tests run the real operator (see ``tests/operator_support``); the rest are pure.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from operator_support.harness import Cluster, cluster_session, profile_json, running_operator
from operator_support.samples import gpu_node, spec
from test_operator_api import add_nodes, bring_up, calibrate, deployment, hw_jobs, node_pods, wait_phase
from vexpert_operator import kube
from vexpert_operator import naming as nm
from vexpert_operator.calibration import JobSummary, decide_calibration
from vexpert_operator.conditions import claim_blockers, failed_create_blockers, pod_blockers
from vexpert_operator.nodetypes import candidate_types, memory_requested_by_node, node_info, node_type_name
from vexpert_operator.quantity import GIB, parse_bytes
from vexpert_operator.render import render_file
from vexpert_operator.sizing import KNOWN_SHAPES, MemoryFit, size_pod
from vexpert_operator.validation import parse_spec
from vexpert_runtime.errors import VExpertInputError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "deepseek-v3-ep64.yaml"
PROFILE = REPO / "examples" / "profiles" / "h200-node-profile.yaml"


@pytest.fixture
def cluster(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    with cluster_session(tmp_path, monkeypatch) as c:
        yield c


def sts_memory(cluster: Cluster, name: str = "dsv3") -> int:
    sts = cluster.wait_for(lambda: cluster.get(kube.STATEFULSETS, nm.statefulset_name(name)), what="the StatefulSet")
    return parse_bytes(sts["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"])


def daemon_pod(cluster: Cluster, node: str, memory: str, name: str = "") -> None:
    """A pod bound to the node that is not the deployment's (as a DaemonSet's would be)."""
    cluster.create({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name or f"ds-{node}", "labels": {"app": "node-agent"}},
                    "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "agent:1", "resources": {
                        "requests": {"memory": memory}, "limits": {"memory": memory}}}]}})


# ----------------------------------------------------------------------------- 1: sizing with headroom


def test_memory_requested_by_node_counts_other_pods_not_ours_nor_finished() -> None:
    def p(node: str, mem: str, ns: str = "a", labels: dict[str, str] | None = None, phase: str = "Running",
          init: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"metadata": {"namespace": ns, "labels": labels or {}},
                                "spec": {"nodeName": node, "containers": [
                                    {"resources": {"requests": {"memory": mem}}}, {"resources": {"limits": {"memory": mem}}}]},
                                "status": {"phase": phase}}
        if init:
            body["spec"]["initContainers"] = [{"resources": {"requests": {"memory": init}}}]
        return body

    ours = nm.node_selector_labels("dsv3")
    used = memory_requested_by_node([
        p("n1", "1Gi"), p("n1", "2Gi", init="10Gi"), p("n1", "100Gi", labels=ours), p("n1", "100Gi", "b", ours),
        p("n1", "50Gi", phase="Succeeded"), p("", "7Gi")], ours, "a")
    assert used == {"n1": (2 + 10 + 200) * GIB}  # 2×1Gi, max(2×2Gi, 10Gi), another namespace's "dsv3"


def test_pod_is_sized_into_the_nodes_free_memory_less_headroom() -> None:
    shape = KNOWN_SHAPES["deepseek_v3"]
    per_expert = shape.expert_bytes * shape.num_moe_layers
    nodes = [node_info(gpu_node(f"n{i}", allocatable="1000Gi"), requested_memory=(i + 1) * 10 * GIB)
             for i in range(3)]
    node_type = next(iter(candidate_types(nodes, {}, [], 8).values()))
    fit = node_type.memory_fit(2, 8 * GIB)
    assert fit is not None and fit.node == "n1"  # the 2nd most free: 2 nodes of the type can hold the group
    sizing = size_pod(spec(), shape, fit)
    assert sizing.pod_memory_bytes <= 1000 * GIB - 20 * GIB - 8 * GIB
    assert sizing.pod_memory_bytes + per_expert > fit.available  # as large as it may be
    # The running group's Np_cap is kept while the pod fits into what is free (headroom or not) …
    tighter = MemoryFit("n1", 1000 * GIB, 20 * GIB + 4 * GIB, 8 * GIB)
    assert size_pod(spec(), shape, tighter, keep_cap=sizing.pooled_experts_cap).pooled_experts_cap == \
        sizing.pooled_experts_cap
    # … and shrinks when it does not.
    full = MemoryFit("n1", 1000 * GIB, 100 * GIB, 8 * GIB)
    assert size_pod(spec(), shape, full, keep_cap=sizing.pooled_experts_cap).pooled_experts_cap < \
        sizing.pooled_experts_cap


def test_emulator_pod_memory_leaves_what_runs_on_the_node_plus_headroom(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    suffix = cluster.namespace[-6:]
    names = [f"gpu-{suffix}-{i}" for i in range(2)]
    for name in names:
        cluster.add_gpu_node(name, instance_type=cluster.test_instance_type, allocatable_memory="1000Gi")
        daemon_pod(cluster, name, "24Gi")
    type_name = node_type_name(node_info(cluster.get(kube.NODES, names[0]) or {}).key)  # type: ignore[arg-type]
    cluster.add_node_profile(type_name)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(calibration__mode="skip", runtime__memoryHeadroom="16Gi"))
        memory = sts_memory(cluster)
        assert memory <= 1000 * GIB - 24 * GIB - 16 * GIB
        assert memory > 1000 * GIB - 24 * GIB - 16 * GIB - 6 * GIB  # not less than one expert row short

        # Every expert pinned does not fit: a clear refusal, naming the node and the figures.
        cluster.patch(kube.DEPLOYMENTS, "dsv3", {"spec": {"vexpert": {"pinnedExperts": {"mode": "fixed",
                                                                                        "value": 256}}}})
        status = wait_phase(cluster, "dsv3", "Invalid")
        message = status["message"]
        assert "does not fit" in message and "spec.vexpert.pinnedExperts.value" in message
        assert "allocatable 1000.0 GiB" in message and "requested by other pods 24.0 GiB" in message
        assert "headroom 16.0 GiB" in message and any(f"node {n}" in message for n in names)
        assert cluster.condition("dsv3", "Invalid")["reason"] == "DoesNotFitNodeType"


# --------------------------------------------------------------------------- 2: stable node-type identity


def test_gpu_memory_is_no_part_of_the_node_type() -> None:
    a = node_info(gpu_node("a", memory_mib=143771))
    b = node_info(gpu_node("b", memory_mib=143767))
    assert a.type_name == b.type_name
    types = candidate_types([a, b], {}, [], 8)
    assert len(types) == 1 and next(iter(types.values())).gpu_memory_mib == 143767
    assert node_info(gpu_node("c", driver="570.1.1")).type_name != a.type_name  # a new driver still is


def test_emulator_no_roll_when_a_node_of_the_type_changes(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    for node in cluster.list(kube.NODES):
        cluster.patch(kube.NODES, node["metadata"]["name"], {"status": {"allocatable": {"memory": "1000Gi"}}},
                      subresource="status")
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(calibration__traces=[]))
        calibrate(cluster, type_name, model=False)
        bring_up(cluster, "dsv3")
        wait_phase(cluster, "dsv3", "Running")
        before = cluster.status("dsv3")["group"]["templateHash"]
        memory = sts_memory(cluster)
        pods = {p["metadata"]["uid"] for p in node_pods(cluster, "dsv3")}

        # A node with 3 GiB less memory (and a GPU memory label a few MiB lower) joins the type …
        cluster.add_gpu_node(f"gpu-{cluster.namespace[-6:]}-late", instance_type=cluster.test_instance_type,
                             allocatable_memory="997Gi", memory_mib=143767)
        # … a group node loses 3 GiB to a new DaemonSet pod beyond the headroom's share …
        node = node_pods(cluster, "dsv3")[0]["spec"].get("nodeName") or cluster.created_nodes[0]
        daemon_pod(cluster, node, "3Gi")
        # … and another node reports 3 GiB less allocatable memory.
        cluster.patch(kube.NODES, cluster.created_nodes[1], {"status": {"allocatable": {"memory": "997Gi"}}},
                      subresource="status")
        for _ in range(3):  # a few reconcile rounds
            cluster.wait_for(lambda: cluster.status("dsv3").get("phase") == "Running", what="Running")
            time.sleep(0.5)
        assert cluster.status("dsv3")["group"]["templateHash"] == before
        assert sts_memory(cluster) == memory
        assert {p["metadata"]["uid"] for p in node_pods(cluster, "dsv3")} == pods
        assert cluster.status("dsv3")["nodeType"] == type_name


# ------------------------------------------------------------------- 3: calibration per node type, cluster-wide


def test_three_namespaces_on_a_new_type_make_exactly_one_calibration_job(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    others = [f"{cluster.namespace}-b", f"{cluster.namespace}-c"]
    for ns in others:
        cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    with running_operator(cluster, monkeypatch, namespaces=[cluster.namespace, *others]):
        for ns in (cluster.namespace, *others):
            body = deployment(calibration__traces=[])
            body["metadata"]["namespace"] = ns
            cluster.create(body)
        for ns in (cluster.namespace, *others):
            cluster.wait_for(lambda ns=ns: (cluster.get(kube.DEPLOYMENTS, "dsv3", ns) or {}).get("status", {})
                             .get("phase") == "Calibrating", what=f"{ns} calibrating")
        time.sleep(1.5)  # several reconcile rounds of all three
        jobs = [j for ns in (cluster.namespace, *others) for j in cluster.list_by(
            kube.JOBS, {nm.LABEL_CALIBRATION: "hardware"}, ns)]
        assert len(jobs) == 1 and jobs[0]["metadata"]["namespace"] == cluster.namespace  # the operator's
        job = jobs[0]
        assert job["spec"]["activeDeadlineSeconds"] == 1800 and job["spec"]["backoffLimit"] == 0
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["image"].startswith("ghcr.io/vexpert/vexpert-runtime:")  # the installer's
        assert container["resources"]["requests"]["cpu"] == "8"
        cluster.finish_job(job["metadata"]["name"], profile_json())
        for ns in (cluster.namespace, *others):
            cluster.wait_for(lambda ns=ns: cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3"), ns),
                             what=f"the group in {ns}")
        assert len(hw_jobs(cluster)) == 1 and cluster.get(kube.NODE_PROFILES, type_name) is not None


def test_calibration_gives_up_after_max_attempts(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch, env={"VEXPERT_OPERATOR_CALIBRATION_MAX_ATTEMPTS": "2"}):
        cluster.create(deployment(calibration__traces=[]))
        for attempt in (1, 2):
            job = cluster.wait_for(lambda a=attempt: [j for j in hw_jobs(cluster) if j["metadata"]["labels"][
                nm.LABEL_ATTEMPT] == str(a)], timeout=15, what=f"attempt {attempt}")[0]
            cluster.finish_job(job["metadata"]["name"], "cudaErrorNoDevice", exit_code=3)
        cond = cluster.wait_for(lambda: (lambda c: c if "no more attempts" in c.get("message", "") else None)(
            cluster.condition("dsv3", "Calibrated")), what="the final failure in status")
        assert "attempt 2 of 2" in cond["message"] and "cudaErrorNoDevice" in cond["message"]
        assert "kubectl delete jobs" in cond["message"]
        time.sleep(3)  # past the retry delay: still no third attempt
        assert len(hw_jobs(cluster)) == 2


def test_decide_calibration_is_bounded() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    failed = [JobSummary(f"j{i}", i, "failed", now - dt.timedelta(hours=1), "boom") for i in (1, 2, 3)]
    assert decide_calibration(failed, now, 1, 2, max_attempts=3).action == "exhausted"
    assert decide_calibration(failed, now, 1, 2, max_attempts=4).action == "create"


def test_tenants_cannot_pick_the_calibration_image() -> None:
    _, problems = parse_spec({**spec().model_dump(by_alias=True, exclude_none=True),
                              "calibration": {"image": "evil:1"}})
    assert [p.field for p in problems] == ["spec.calibration"]
    assert "set by the operator's installer" in problems[0].message


# ------------------------------------------------------------------------- 4: Pending pods explained


def test_blockers_from_pods_events_and_claims() -> None:
    pending = {"metadata": {"name": "p0"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/9 nodes are available: 9 Insufficient memory."}]}}
    pulling = {"metadata": {"name": "p1"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "node", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling x:1"}}}]}}
    found = pod_blockers([pending, pulling])
    assert [b.reason for b in found] == ["Unschedulable", "ImagePullBackOff"]
    assert "Insufficient memory" in found[0].message and "x:1" in found[1].message
    event = {"reason": "FailedCreate", "involvedObject": {"name": "d-node"}, "lastTimestamp": "2026-01-01T00:00:00Z",
             "message": "create Pod d-node-0 failed: violates PodSecurity \"restricted:latest\""}
    assert failed_create_blockers([event], "d-node")[0].reason == "FailedCreate"
    assert failed_create_blockers([event], "other-node") == []
    rwo = {"spec": {"accessModes": ["ReadWriteOnce"]}}
    assert claim_blockers(rwo, "w", 2)[0].reason == "ClaimNotShareable"
    assert claim_blockers(rwo, "w", 1) == [] and claim_blockers({"spec": {"accessModes": ["ReadOnlyMany"]}}, "w", 2) == []


def test_emulator_pending_pod_reason_in_status(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    cluster.add_node_profile(type_name)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(calibration__mode="skip"))
        pods = cluster.wait_for(lambda: (lambda ps: ps if len(ps) == 2 else None)(node_pods(cluster, "dsv3")),
                                what="2 node pods")
        cluster.set_pod_running(pods[0]["metadata"]["name"])
        cluster.patch(kube.PODS, pods[1]["metadata"]["name"], {"status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient rdma/ib."}]}}, subresource="status")
        cond = cluster.wait_for(lambda: (lambda c: c if c.get("reason") == "Unschedulable" else None)(
            cluster.condition("dsv3", "Ready")), what="Ready=False/Unschedulable")
        assert cond["status"] == "False" and "Insufficient rdma/ib" in cond["message"]
        status = cluster.status("dsv3")
        assert status["phase"] == "Deploying" and "Insufficient rdma/ib" in status["message"]
        assert cluster.condition("dsv3", "Progressing")["reason"] == "Unschedulable"

        # A ReadWriteOnce checkpoint claim cannot serve two nodes: said so as well.
        cluster.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights"},
                        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Ti"}}}})
        cluster.wait_for(lambda: "ReadWriteOnce" in cluster.status("dsv3").get("message", ""),
                         what="the claim's access mode in status")
        bring_up(cluster, "dsv3")
        with contextlib.suppress(AssertionError):
            wait_phase(cluster, "dsv3", "Running", timeout=5)
        assert cluster.condition("dsv3", "Ready")["status"] == "True"


# -------------------------------------------------------------------------- 6: render at 1000/1500/2000Gi


@pytest.mark.parametrize("allocatable", ["1000Gi", "1500Gi", "2000Gi"])
def test_render_deepseek_v3_fits_with_headroom(tmp_path: Path, allocatable: str) -> None:
    profile = yaml.safe_load(PROFILE.read_text())
    profile["spec"]["allocatableMemory"] = allocatable
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    result = render_file(EXAMPLE, node_profile_file=str(path))
    sts = next(m for m in result.manifests if m["kind"] == "StatefulSet")
    memory = parse_bytes(sts["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"])
    deployment_doc = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "VExpertDeployment")
    headroom = parse_bytes(deployment_doc["spec"]["runtime"].get("memoryHeadroom", "8Gi"))
    assert memory <= parse_bytes(allocatable) - headroom
    assert any("fits with headroom" in note for note in result.notes)


def test_render_refuses_clearly_when_it_does_not_fit(tmp_path: Path) -> None:
    profile = yaml.safe_load(PROFILE.read_text())
    profile["spec"]["allocatableMemory"] = "300Gi"
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    with pytest.raises(VExpertInputError) as info:
        render_file(EXAMPLE, node_profile_file=str(path))
    message = str(info.value)
    assert "does not fit" in message and "allocatable 300.0 GiB" in message and "headroom" in message
