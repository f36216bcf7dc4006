"""API tests: the real operator (kopf.testing.KopfRunner, --standalone) against the API emulator.

With ``KUBECONFIG`` set when pytest starts, the same tests run against that cluster instead (fake
GPU nodes are created and removed; test pods never schedule: the nodes are tainted and the kubelet
is played through pod status patches). See ``tests/operator_support``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml

from operator_support.harness import (
    REAL_KUBECONFIG,
    Cluster,
    MetricsServer,
    cluster_session,
    profile_json,
    running_operator,
)
from vexpert_operator import kube
from vexpert_operator import metrics as operator_metrics
from vexpert_operator import naming as nm
from vexpert_operator.nodetypes import node_type_key, node_type_name
from vexpert_runtime.node.metrics import NodeMetrics


@pytest.fixture(params=[
    "emulator",
    pytest.param("cluster", marks=[pytest.mark.cluster,
                                   pytest.mark.skipif(not REAL_KUBECONFIG, reason="needs KUBECONFIG")]),
])
def cluster(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    with cluster_session(tmp_path, monkeypatch, real=request.param == "cluster") as c:
        try:
            yield c
        finally:
            dump_for_debugging(c)


def dump_for_debugging(cluster: Cluster) -> None:
    """Printed at teardown; pytest shows it only when the test failed."""
    for dep in cluster.list(kube.DEPLOYMENTS):
        print("status", dep["metadata"]["name"], yaml.safe_dump(dep.get("status")))
    if cluster.emulator is not None and cluster.emulator._errors:
        for err in cluster.emulator.errors:
            if getattr(err, "status", 500) not in (404, 409):
                print("emulator error:", repr(err)[:2000])


def deployment(name: str = "dsv3", ep: int = 16, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "deepseek-ai/DeepSeek-V3", "revision": "r1", "architecture": "deepseek_v3",
                  "checkpoint": {"claimName": "weights", "subPath": "DeepSeek-V3"}},
        "parallelism": {"expertParallelSize": ep, "gpusPerNode": 8},
        "vexpert": {"groupSize": 2, "vmax": 1, "tuningIntervalSeconds": 3600},
        "calibration": {"mode": "auto", "retryBackoffSeconds": 1, "maxRetryBackoffSeconds": 2,
                        "traces": ["traces/decode.npz"]},
        "runtime": {
            "image": "ghcr.io/vexpert/vexpert-runtime:0.1.0",
            "memoryOverhead": "32Gi",
            "shmSize": "16Gi",
            "nodeSelector": {"vexpert.io/test-node": "true"},
            "tolerations": [{"operator": "Exists"}],
            "groupRestartBackoffSeconds": 1,
            "maxGroupRestartBackoffSeconds": 2,
        },
    }
    for path, value in overrides.items():
        node = spec
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return {"apiVersion": "vexpert.io/v1alpha1", "kind": "VExpertDeployment", "metadata": {"name": name},
            "spec": spec}


def add_nodes(cluster: Cluster, count: int = 2, driver: str = "550.54.15", prefix: str = "gpu") -> str:
    """GPU nodes of one type; returns the type's name."""
    suffix = cluster.namespace[-6:]
    for i in range(count):
        node = cluster.add_gpu_node(f"{prefix}-{suffix}-{driver.replace('.', '-')}-{i}", driver=driver,
                                    instance_type=cluster.test_instance_type)
    key = node_type_key(node["metadata"]["labels"])
    assert key is not None
    return node_type_name(key)


def hw_jobs(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.list_by(kube.JOBS, {nm.LABEL_CALIBRATION: "hardware"})


def model_jobs(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.list_by(kube.JOBS, {nm.LABEL_CALIBRATION: "model"})


def node_pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    pods = cluster.list_by(kube.PODS, nm.node_selector_labels(name))
    return sorted([p for p in pods if not p["metadata"].get("deletionTimestamp")], key=lambda p: p["metadata"]["name"])


def calibrate(cluster: Cluster, type_name: str, bandwidth: float = 54.7, model: bool = True) -> None:
    """Finish the hardware Job of the type and the model Job, as the real commands would."""
    job = cluster.wait_for(lambda: [j for j in hw_jobs(cluster)
                                    if j["metadata"]["labels"][nm.LABEL_NODE_TYPE] == type_name],
                           what=f"a hardware calibration Job for {type_name}")[0]
    cluster.finish_job(job["metadata"]["name"], profile_json(bandwidth=bandwidth))
    cluster.wait_for(lambda: cluster.get(kube.NODE_PROFILES, type_name), what="the VExpertNodeProfile")
    if not model:
        return
    mjob = cluster.wait_for(lambda: model_jobs(cluster), what="the model calibration Job")[0]
    cluster.finish_job(mjob["metadata"]["name"], profile_json(source="model-calibration", alpha=-0.7, beta=0.6))
    cluster.wait_for(lambda: cluster.list(kube.MODEL_PROFILES), what="the VExpertModelProfile")


def bring_up(cluster: Cluster, name: str, nodes: int = 2, ready: bool = True) -> list[dict[str, Any]]:
    """Play the kubelet: every node pod of the group runs (and is ready)."""
    pods = cluster.wait_for(lambda: (lambda ps: ps if len(ps) == nodes else None)(node_pods(cluster, name)),
                            what=f"{nodes} node pods")
    for pod in pods:
        cluster.set_pod_running(pod["metadata"]["name"], ready=ready)
    return pods


def wait_phase(cluster: Cluster, name: str, phase: str, timeout: float = 20.0) -> dict[str, Any]:
    return cluster.wait_for(lambda: (lambda s: s if s.get("phase") == phase else None)(cluster.status(name)),
                            timeout=timeout, what=f"phase {phase}")


def runtime_config(cluster: Cluster, name: str) -> dict[str, Any]:
    cm = cluster.get(kube.CONFIGMAPS, nm.config_map_name(name))
    assert cm is not None
    return yaml.safe_load(cm["data"]["runtime.yaml"])


# ----------------------------------------------------------------------------------------- tests


def test_create_calibrates_new_node_type_then_deploys_group(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        dep = cluster.create(deployment())
        uid = dep["metadata"]["uid"]

        # A new node type: one hardware calibration Job pinned to it; the deployment waits.
        jobs = cluster.wait_for(lambda: hw_jobs(cluster), what="a hardware calibration Job")
        assert len(jobs) == 1
        job = jobs[0]
        assert job["metadata"]["labels"][nm.LABEL_NODE_TYPE] == type_name
        pod_spec = job["spec"]["template"]["spec"]
        terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        pinned = {e["key"]: e["values"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
        assert pinned["nvidia.com/cuda.driver-version.full"] == ["550.54.15"]
        assert pod_spec["containers"][0]["command"] == ["vexpert", "calibrate"]
        assert pod_spec["containers"][0]["args"][0] == "hardware"
        mjob = cluster.wait_for(lambda: model_jobs(cluster), what="the model calibration Job")[0]
        margs = mjob["spec"]["template"]["spec"]["containers"][0]["args"]
        assert margs[:3] == ["model", "--trace", "/models/DeepSeek-V3/traces/decode.npz"]
        assert not job["metadata"].get("ownerReferences")  # the node type's, not this deployment's
        calibrated = cluster.wait_for(lambda: (lambda c: c if c.get("reason") == "HardwareCalibrating" else None)(
            cluster.condition("dsv3", "Calibrated")), what="Calibrated=False/HardwareCalibrating")
        assert calibrated["status"] == "False"
        assert cluster.status("dsv3")["phase"] == "Calibrating"
        assert not cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3"))

        # The Job ends the way the contract says: PerformanceProfile JSON as the termination message.
        calibrate(cluster, type_name, bandwidth=41.5)
        profile = cluster.get(kube.NODE_PROFILES, type_name)
        assert profile is not None
        assert profile["spec"]["profile"]["hardware"]["h2d_bandwidth_gb_per_s"] == 41.5
        assert profile["spec"]["nodeType"]["driverVersion"] == "550.54.15"

        # Then the group: ConfigMap, headless and API Services, StatefulSet, PDB, all owned by the deployment.
        def children() -> tuple[Any, ...] | None:  # created one after another: wait for all five
            found = (cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3")),
                     cluster.get(kube.CONFIGMAPS, nm.config_map_name("dsv3")),
                     cluster.get(kube.SERVICES, nm.service_name("dsv3")),
                     cluster.get(kube.SERVICES, nm.api_service_name("dsv3")),
                     cluster.get(kube.PDBS, nm.pdb_name("dsv3")))
            return found if all(child is not None for child in found) else None

        sts, cm, svc, api, pdb = cluster.wait_for(children, what="the StatefulSet, ConfigMap, Services and PDB")
        for child in (sts, cm, svc, api, pdb):
            assert child is not None
            assert child["metadata"]["ownerReferences"][0]["uid"] == uid
        assert sts["spec"]["replicas"] == 2
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert svc["spec"]["clusterIP"] == "None"
        assert api["spec"]["type"] == "ClusterIP" and api["spec"]["clusterIP"] not in ("", "None")
        assert api["spec"]["selector"] == nm.node_selector_labels("dsv3")
        assert [(p["name"], p["port"], p["targetPort"]) for p in api["spec"]["ports"]] == [("http", 8000, "http")]
        container = sts["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["vexpert", "serve"] and container["args"][-2:] == ["--port", "8000"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert pdb["spec"]["minAvailable"] == 2
        config = runtime_config(cluster, "dsv3")
        assert config["profile"]["hardware"]["h2d_bandwidth_gb_per_s"] == 41.5
        assert config["profile"]["load_balance"]["beta"] == 0.6
        assert config["parallelism"]["master_addr"] == f"dsv3-node-0.dsv3-nodes.{cluster.namespace}.svc"
        assert cluster.condition("dsv3", "Calibrated")["status"] == "True"

        bring_up(cluster, "dsv3")
        status = wait_phase(cluster, "dsv3", "Running")
        assert status["readyNodes"] == 2
        assert status["nodes"] == 2
        assert status["nodeType"] == type_name
        assert status["observedGeneration"] == cluster.deployment("dsv3")["metadata"]["generation"]
        assert status["tuning"]["allocationInterval"] == 10
        assert status["tuning"]["pooledExperts"] == status["tuning"]["pooledExpertsCap"] > 0
        assert status["endpoint"] == f"http://dsv3-api.{cluster.namespace}.svc:8000"
        assert cluster.condition("dsv3", "Ready")["status"] == "True"
        assert cluster.events("HardwareCalibrationStarted")
        assert len(hw_jobs(cluster)) == 1


def test_failed_calibration_retries_with_backoff_and_new_driver_is_new_type(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    backoff = {"VEXPERT_OPERATOR_CALIBRATION_RETRY_BACKOFF_S": "3", "VEXPERT_OPERATOR_CALIBRATION_MAX_RETRY_BACKOFF_S": "6"}
    with running_operator(cluster, monkeypatch, env=backoff):
        cluster.create(deployment())
        first = cluster.wait_for(lambda: hw_jobs(cluster), what="attempt 1")[0]["metadata"]["name"]
        cluster.finish_job(first, "cudaErrorNoDevice: no CUDA-capable device is detected", exit_code=3)
        cond = cluster.wait_for(lambda: (lambda c: c if c.get("reason") == "HardwareCalibrationFailed" else None)(
            cluster.condition("dsv3", "Calibrated")), what="Calibrated=False/HardwareCalibrationFailed")
        assert "no CUDA-capable device" in cond["message"] and "retry at" in cond["message"]
        assert len(hw_jobs(cluster)) == 1  # backoff: no new attempt at once
        second = cluster.wait_for(lambda: [j for j in hw_jobs(cluster) if j["metadata"]["labels"][nm.LABEL_ATTEMPT]
                                           == "2"], timeout=15, what="attempt 2 after the backoff")[0]

        # Exit 0 with an unusable message is a failed attempt too.
        cluster.finish_job(second["metadata"]["name"], "not json")
        cluster.wait_for(lambda: "not JSON" in cluster.condition("dsv3", "Calibrated").get("message", ""),
                         what="the harvest error in status")
        third = cluster.wait_for(lambda: [j for j in hw_jobs(cluster) if j["metadata"]["labels"][nm.LABEL_ATTEMPT]
                                          == "3"], timeout=15, what="attempt 3")[0]
        cluster.finish_job(third["metadata"]["name"], profile_json())
        cluster.wait_for(lambda: cluster.get(kube.NODE_PROFILES, type_name), what="the profile")

        # A node with a new driver version is a new type: it is calibrated too.
        new_type = add_nodes(cluster, 1, driver="560.35.03", prefix="newdrv")
        assert new_type != type_name
        job = cluster.wait_for(lambda: [j for j in hw_jobs(cluster)
                                        if j["metadata"]["labels"][nm.LABEL_NODE_TYPE] == new_type],
                               what="a Job for the new driver's type")[0]
        assert "560.35.03" in job["metadata"]["annotations"][nm.ANNOTATION_NODE_TYPE_KEY]
        # The group stays on the profiled type with enough nodes.
        assert cluster.status("dsv3")["nodeType"] == type_name
        failures = [e["message"] for e in cluster.events("HardwareCalibrationFailed")]
        assert any("no CUDA-capable device" in m for m in failures), failures
        assert any("not JSON" in m for m in failures), failures


def test_invalid_spec_sets_invalid_posts_event_and_waits_for_a_spec_change(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        bad = deployment(vexpert__pinnedExperts={"mode": "fixed", "value": 300})
        cluster.create(bad)
        cond = cluster.wait_for(lambda: (lambda c: c if c.get("status") == "True" else None)(
            cluster.condition("dsv3", "Invalid")), what="Invalid=True")
        assert cond["reason"] == "InvalidSpec"
        assert "spec.vexpert.pinnedExperts.value" in cond["message"]
        assert "300" in cond["message"]
        assert cluster.status("dsv3")["phase"] == "Invalid"
        events = cluster.wait_for(lambda: cluster.events("Invalid"), what="an Invalid event")
        assert "spec.vexpert.pinnedExperts.value" in events[0]["message"]
        assert events[0]["type"] == "Warning"

        # No retrying while the spec stays the same: nothing is written, no Job starts. kopf's own
        # bookkeeping patch of the handled event may land just after the Invalid event: settle first.
        version = cluster.deployment("dsv3")["metadata"]["resourceVersion"]
        for _ in range(10):
            time.sleep(0.3)
            settled = cluster.deployment("dsv3")["metadata"]["resourceVersion"]
            if settled == version:
                break
            version = settled
        time.sleep(1.5)  # five reconcile periods of the test configuration
        assert cluster.deployment("dsv3")["metadata"]["resourceVersion"] == version
        assert hw_jobs(cluster) == []

        # Fixing the spec resumes work.
        cluster.patch(kube.DEPLOYMENTS, "dsv3", {"spec": {"vexpert": {"pinnedExperts": {"mode": "auto", "value": None}}}})
        cluster.wait_for(lambda: cluster.condition("dsv3", "Invalid").get("status") == "False",
                         what="Invalid=False")
        cluster.wait_for(lambda: hw_jobs(cluster), what="calibration after the fix")


def test_a_child_the_api_server_refuses_shows_in_status_and_a_later_success_clears_it(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    if cluster.emulator is None:
        pytest.skip("injects the API server's refusal (a real cluster accepts this spec)")
    add_nodes(cluster, 2)
    message = 'StatefulSet.apps "dsv3-node" is invalid: spec.template.spec.containers[0].volumeMounts[2]: nope'
    refusal = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422,
               "message": message}
    # the first two applies are refused (two reconciles), the third goes through
    cluster.emulator["patch", f"/apis/apps/v1/namespaces/{cluster.namespace}/statefulsets/dsv3-node"][:2] \
        << 422 << refusal
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(calibration__mode="skip"))
        cond = cluster.wait_for(lambda: (lambda c: c if c.get("status") == "True" else None)(
            cluster.condition("dsv3", "Invalid")), what="Invalid=True")
        assert cond["reason"] == "RejectedByApiServer"
        assert "StatefulSet dsv3-node" in cond["message"] and message in cond["message"]
        assert cluster.status("dsv3")["phase"] == "Invalid"
        events = cluster.wait_for(lambda: cluster.events("Invalid"), what="an Invalid event")
        assert message in events[0]["message"] and events[0]["type"] == "Warning"
        # not permanent: the periodic reconcile applies again, and once accepted the group proceeds
        cluster.wait_for(lambda: cluster.condition("dsv3", "Invalid").get("status") == "False",
                         what="Invalid=False")
        cluster.wait_for(lambda: cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3")),
                         what="the StatefulSet")
        assert len(cluster.events("Invalid")) == 1  # one event per new message, not per retry


def test_too_few_nodes_is_said_in_status_until_nodes_are_added(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    add_nodes(cluster, 1)  # the group needs 2 (EP16, 8 GPUs per node)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(calibration__mode="skip"))
        cond = cluster.wait_for(lambda: (lambda c: c if c.get("reason") == "NotEnoughNodes" else None)(
            cluster.condition("dsv3", "Progressing")), what="Progressing=NotEnoughNodes")
        assert "1 Ready schedulable node(s), the group needs 2" in cond["message"]
        assert cluster.status("dsv3")["phase"] == "Deploying"
        assert "needs 2" in cluster.status("dsv3")["message"]
        add_nodes(cluster, 1, prefix="more")  # same type (same driver and instance type): 2 nodes now
        cluster.wait_for(lambda: cluster.condition("dsv3", "Progressing").get("reason") == "Deploying",
                         what="Progressing=Deploying once the nodes exist")


def test_node_pod_failure_reforms_the_whole_group_with_backoff(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(runtime__groupRestartBackoffSeconds=4, runtime__maxGroupRestartBackoffSeconds=8))
        calibrate(cluster, type_name)
        pods = bring_up(cluster, "dsv3")
        wait_phase(cluster, "dsv3", "Running")
        cluster.wait_for(lambda: len(cluster.status("dsv3")["group"]["members"]) == 2, what="the formed group")
        old = {p["metadata"]["uid"] for p in pods}

        # One rank's container crashes: every rank is replaced (the EP group cannot lose a rank).
        cluster.crash_pod("dsv3-node-1")
        new = cluster.wait_for(lambda: (lambda ps: ps if len(ps) == 2 and not {p["metadata"]["uid"] for p in ps}
                                        & old else None)(node_pods(cluster, "dsv3")), what="a re-formed group")
        status = cluster.status("dsv3")
        assert status["group"]["restarts"] == 1
        assert "dsv3-node-1" in status["group"]["lastRestartReason"]
        assert "NCCL error" in status["group"]["lastRestartReason"]
        assert status["phase"] == "Deploying"
        assert cluster.wait_for(lambda: cluster.events("GroupReformed"), what="a GroupReformed event")

        # It fails again at once: the next re-form waits for the backoff (4 s after the first).
        first_restart = time.mktime(time.strptime(status["group"]["lastRestartTime"], "%Y-%m-%dT%H:%M:%SZ"))
        uids = {p["metadata"]["uid"] for p in new}
        for p in new:
            cluster.set_pod_running(p["metadata"]["name"])
        cluster.crash_pod("dsv3-node-0")
        seen: list[dict[str, Any]] = []

        def reformed_again() -> bool:
            cond = cluster.condition("dsv3", "Degraded")
            if cond.get("reason") == "GroupRestartBackoff" and not seen:
                seen.append({**cond, "phase": cluster.status("dsv3")["phase"],
                             "pods": {p["metadata"]["uid"] for p in node_pods(cluster, "dsv3")}})
            return cluster.status("dsv3")["group"]["restarts"] == 2

        cluster.wait_for(reformed_again, timeout=15, interval=0.02, what="the second re-form")
        cluster.wait_for(lambda: not {p["metadata"]["uid"] for p in node_pods(cluster, "dsv3")} & uids,
                         what="every rank replaced")
        status = cluster.status("dsv3")
        second_restart = time.mktime(time.strptime(status["group"]["lastRestartTime"], "%Y-%m-%dT%H:%M:%SZ"))
        assert second_restart - first_restart >= 3  # 4 s backoff, timestamps in whole seconds
        if cluster.emulated:  # fast enough to see the wait itself
            assert seen and seen[0]["status"] == "True" and "re-forming at" in seen[0]["message"]
            assert seen[0]["phase"] == "Degraded" and seen[0]["pods"] == uids

        # A member pod that disappears (e.g. its node died) is a failure too.
        bring_up(cluster, "dsv3")
        wait_phase(cluster, "dsv3", "Running")
        cluster.wait_for(lambda: len(cluster.status("dsv3")["group"]["members"]) == 2, what="members recorded")
        cluster.delete(kube.PODS, "dsv3-node-1")
        cluster.wait_for(lambda: "gone" in cluster.condition("dsv3", "Degraded").get("message", "") or
                         "gone" in cluster.status("dsv3")["group"]["lastRestartReason"],
                         what="the lost member noticed")


def test_spec_change_rolls_the_whole_group_and_tuning_changes_do_not(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(vexpert__allocationInterval={"mode": "fixed", "value": 10}))
        calibrate(cluster, type_name)
        pods = bring_up(cluster, "dsv3")
        wait_phase(cluster, "dsv3", "Running")
        old_hash = pods[0]["metadata"]["labels"][nm.LABEL_TEMPLATE_HASH]
        old_uids = {p["metadata"]["uid"] for p in pods}

        # k is hot-reloaded from the ConfigMap: no pod restarts.
        cluster.patch(kube.DEPLOYMENTS, "dsv3", {"spec": {"vexpert": {"allocationInterval": {"value": 25}}}})
        cluster.wait_for(lambda: runtime_config(cluster, "dsv3")["tuning"]["allocation_interval"] == 25,
                         what="k=25 in the ConfigMap")
        time.sleep(0.8)
        assert {p["metadata"]["uid"] for p in node_pods(cluster, "dsv3")} == old_uids

        # A new image is a new template: the StatefulSet changes and every rank is replaced together.
        cluster.patch(kube.DEPLOYMENTS, "dsv3", {"spec": {"runtime": {"image": "ghcr.io/vexpert/vexpert-runtime:0.2.0"}}})
        sts = cluster.wait_for(lambda: (lambda s: s if s["spec"]["template"]["spec"]["containers"][0]["image"]
                                        .endswith("0.2.0") else None)(
            cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3"))), what="the new template")
        new_hash = sts["spec"]["template"]["metadata"]["labels"][nm.LABEL_TEMPLATE_HASH]
        assert new_hash != old_hash
        new = cluster.wait_for(lambda: (lambda ps: ps if len(ps) == 2 and all(
            p["metadata"]["labels"][nm.LABEL_TEMPLATE_HASH] == new_hash for p in ps) else None)(
            node_pods(cluster, "dsv3")), what="all ranks on the new template")
        assert not {p["metadata"]["uid"] for p in new} & old_uids
        assert cluster.events("GroupRolled")
        if cluster.emulator is not None:
            # Never half-updated: replay the API's pod events; no new-template pod may exist while a
            # pod of the old template is still alive.
            live: dict[str, str] = {}
            for _, type_, obj, _old in cluster.emulator.event_log("", "v1", "pods"):
                labels = obj["metadata"].get("labels") or {}
                if labels.get(nm.LABEL_DEPLOYMENT) != "dsv3":
                    continue
                if type_ == "DELETED":
                    live.pop(obj["metadata"]["uid"], None)
                    continue
                live[obj["metadata"]["uid"]] = labels[nm.LABEL_TEMPLATE_HASH]
                assert set(live.values()) != {old_hash, new_hash}, "old and new ranks alive together"
        bring_up(cluster, "dsv3")
        status = wait_phase(cluster, "dsv3", "Running")
        assert status["group"]["templateHash"] == new_hash
        assert status["group"]["restarts"] == 0  # a roll is not a failure


def test_operator_restart_midway_creates_no_duplicates(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment())
        cluster.wait_for(lambda: hw_jobs(cluster), what="the hardware Job")
    # Restarted while calibration runs: it adopts the running Job instead of starting another.
    with running_operator(cluster, monkeypatch):
        time.sleep(1.0)
        assert len(hw_jobs(cluster)) == 1
        calibrate(cluster, type_name)
        cluster.wait_for(lambda: cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3")), what="the group")
        pods = bring_up(cluster, "dsv3")
        wait_phase(cluster, "dsv3", "Running")
    uids = {p["metadata"]["uid"] for p in pods}
    # Restarted with the group running: nothing is recreated, no pod restarts.
    with running_operator(cluster, monkeypatch):
        time.sleep(1.5)
        assert len(hw_jobs(cluster)) == 1
        assert len(model_jobs(cluster)) == 1
        assert len(cluster.list_by(kube.STATEFULSETS, nm.deployment_labels("dsv3"))) == 1
        assert len(cluster.list_by(kube.CONFIGMAPS, nm.deployment_labels("dsv3"))) == 1
        assert len(cluster.list_by(kube.SERVICES, nm.deployment_labels("dsv3"))) == 2  # headless + API
        assert len(cluster.list_by(kube.PDBS, nm.deployment_labels("dsv3"))) == 1
        assert {p["metadata"]["uid"] for p in node_pods(cluster, "dsv3")} == uids
        assert cluster.status("dsv3")["phase"] == "Running"


def allocator_heavy_node_metrics() -> NodeMetrics:
    """What a node runtime exports (its own NodeMetrics) at k = 10 when the allocator takes 0.06 s per
    allocation and a step 0.05 s (12 % of step time), balance 0.72/0.76, 1234.5 tokens/s."""
    runtime = NodeMetrics(num_layers=2)
    runtime.set_layers(runtime.balance, [0.72, 0.76])
    runtime.tokens_per_second.set(1234.5)
    for _ in range(3):
        runtime.allocator_time.observe(0.06)
        runtime.step_time.observe(0.05)
    runtime.allocation_interval.set(10)
    runtime.pooled_experts.set(256)
    runtime.degraded.set(0)
    return runtime


def test_tuning_decision_is_written_to_configmap_and_status(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    metrics = MetricsServer()
    try:
        # What the node runtime exports (its own NodeMetrics): the allocator takes 12% of step time at
        # k=10 (0.06 s per allocation, 0.05 s per step) and nothing says the balance decays: lengthen k.
        runtime = allocator_heavy_node_metrics()
        metrics.text = runtime.render()
        before = operator_metrics.TUNING_DECISIONS.labels("k", "changed")._value.get()
        with running_operator(cluster, monkeypatch):
            cluster.create(deployment(vexpert__tuningIntervalSeconds=1, runtime__httpPort=metrics.port))
            calibrate(cluster, type_name)
            bring_up(cluster, "dsv3")
            wait_phase(cluster, "dsv3", "Running")
            tuning = cluster.wait_for(lambda: (lambda t: t if t.get("allocationInterval") == 15 else None)(
                cluster.status("dsv3").get("tuning") or {}), timeout=15, what="k 10→15 in status")
            assert "allocator" in tuning["reason"]
            assert tuning["changes"] >= 1
            assert runtime_config(cluster, "dsv3")["tuning"]["allocation_interval"] == 15
            report = cluster.status("dsv3")["runtime"]
            assert report["tokensPerSecond"] == pytest.approx(2469.0)  # two pods, summed
            assert report["balanceRatio"] == pytest.approx(0.74)
            assert cluster.events("Tuned")
            assert metrics.hits >= 2

            # Until the runtime reports k=15, the tuner holds (the decision has not taken effect).
            held = cluster.wait_for(lambda: (lambda t: t if "waiting for the runtime" in t["reason"] else None)(
                cluster.status("dsv3")["tuning"]), timeout=10, what="the tuner holding")
            assert held["allocationInterval"] == 15 and held["changes"] == tuning["changes"]
        assert operator_metrics.TUNING_DECISIONS.labels("k", "changed")._value.get() >= before + 1
    finally:
        metrics.close()


def test_tuning_reads_the_serving_series(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `vexpert serve`'s series on /metrics: status reports served tokens/s and latencies, and
    k is judged against the inter-token latency, not the step gauge."""
    type_name = add_nodes(cluster, 2)
    metrics = MetricsServer()
    try:
        # Allocator 0.06 s per allocation at k=10: 12 % of the 0.05 s step (alone, k would go 10→15),
        # 3 % of the 0.2 s clients wait per token (within the dead band: k stays).
        runtime = allocator_heavy_node_metrics()
        static = runtime.render()
        start = time.monotonic()

        def render() -> str:  # cumulative series growing at 100 tokens/s and 10 latencies/s per pod
            elapsed = time.monotonic() - start
            count = int(10 * elapsed)
            return static + (
                f"vexpert_serve_generated_tokens_total {100 * elapsed:.3f}\n"
                f"vexpert_serve_inter_token_latency_seconds_sum {0.2 * count:.3f}\n"
                f"vexpert_serve_inter_token_latency_seconds_count {count}\n"
                'vexpert_serve_requests_total{status="ok"} 7\n'
                "vexpert_serve_requests_running 3\nvexpert_serve_requests_waiting 0\n")

        metrics.render = render
        with running_operator(cluster, monkeypatch):
            cluster.create(deployment(vexpert__tuningIntervalSeconds=1, runtime__httpPort=metrics.port))
            calibrate(cluster, type_name)
            bring_up(cluster, "dsv3")
            wait_phase(cluster, "dsv3", "Running")
            report = cluster.wait_for(lambda: (lambda r: r if r.get("interTokenLatencySeconds") else None)(
                cluster.status("dsv3").get("runtime") or {}), timeout=15, what="serving rates in status")
            assert report["interTokenLatencySeconds"] == pytest.approx(0.2, rel=0.05)
            assert report["tokensPerSecond"] == pytest.approx(200, rel=0.3)  # two pods (one server here) at 100/s
            assert report["requestsRunning"] == 6 and report["requestsWaiting"] == 0
            tuning = cluster.status("dsv3")["tuning"]
            assert "of inter-token latency" in tuning["reason"], tuning
            assert tuning["allocationInterval"] == 10 and tuning["changes"] == 0
            assert runtime_config(cluster, "dsv3")["tuning"]["allocation_interval"] == 10
    finally:
        metrics.close()


def test_deletion_cleans_up_children(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment(calibration__traces=[]))  # no traces: the paper's load-balance coefficients
        calibrate(cluster, type_name, model=False)
        bring_up(cluster, "dsv3")
        status = wait_phase(cluster, "dsv3", "Running")
        assert status["calibration"]["modelState"] == "Default" and model_jobs(cluster) == []
        assert runtime_config(cluster, "dsv3")["profile"]["load_balance"]["alpha"] == -0.75
        cluster.delete(kube.DEPLOYMENTS, "dsv3")
        cluster.wait_for(lambda: cluster.get(kube.DEPLOYMENTS, "dsv3") is None, what="the deployment gone")
        for res, name in ((kube.STATEFULSETS, nm.statefulset_name("dsv3")), (kube.SERVICES, nm.service_name("dsv3")),
                          (kube.SERVICES, nm.api_service_name("dsv3")),
                          (kube.CONFIGMAPS, nm.config_map_name("dsv3")), (kube.PDBS, nm.pdb_name("dsv3"))):
            cluster.wait_for(lambda res=res, name=name: cluster.get(res, name) is None, what=f"{name} gone")
        cluster.wait_for(lambda: not model_jobs(cluster), what="the model calibration Job gone")
        assert hw_jobs(cluster)  # the node type's, for every deployment: its TTL removes it
        cluster.wait_for(lambda: not node_pods(cluster, "dsv3"), what="node pods gone")
        # Profiles are a cluster-wide cache and outlive the deployment.
        assert cluster.get(kube.NODE_PROFILES, type_name) is not None


def test_children_are_valid_kubernetes_objects(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator validates every built-in object clients write with kubernetes-validate --strict
    (a real API server validates them itself); a 422 would show in the error list."""
    type_name = add_nodes(cluster, 2)
    with running_operator(cluster, monkeypatch):
        cluster.create(deployment())
        calibrate(cluster, type_name)
        cluster.wait_for(lambda: cluster.get(kube.PDBS, nm.pdb_name("dsv3")), what="the group")
    if cluster.emulator is None:
        return  # the real API server accepted them, which is the check
    rejected = [e for e in cluster.emulator.errors if getattr(e, "status", 0) == 422]
    assert rejected == []
    posts = [r for r in cluster.emulator if r.method == "POST"]
    kinds = {(r.data or {}).get("kind") for r in posts if isinstance(r.data, dict)}
    assert {"Job", "VExpertNodeProfile"} <= kinds
    applies = [r for r in cluster.emulator if r.method == "PATCH" and
               r.headers.get("Content-Type", "").startswith("application/apply-patch+yaml")]
    assert {r.params.get("fieldManager") for r in applies} == {kube.FIELD_MANAGER}
    assert {r.data.get("kind") for r in applies} == {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"}
