"""Production behaviours of the operator (issue #15): drift correction by server-side apply, label
selectors on the watches, deletion without the operator, node drains, leader election.

Each test runs against the emulator and, with ``KUBECONFIG`` set when pytest starts, against that
cluster (see ``tests/operator_support``), except where the emulator's request log is the evidence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from operator_support.harness import OPERATOR_ENV, REPO, Cluster, running_operator
from test_operator_api import add_nodes, bring_up, calibrate, cluster, deployment, wait_phase
from vexpert_operator import kube, leader
from vexpert_operator import naming as nm

__all__ = ["cluster"]  # the fixture (emulator, and the real cluster when KUBECONFIG is set)


def running_group(cluster: Cluster, name: str = "dsv3") -> list[dict[str, Any]]:
    """A 2-node group Running (the operator must be running)."""
    type_name = add_nodes(cluster, 2)
    cluster.create(deployment(name, calibration__traces=[]))
    calibrate(cluster, type_name, model=False)
    pods = bring_up(cluster, name)
    wait_phase(cluster, name, "Running")
    return pods


# ------------------------------------------------------------------------- 1. server-side apply


def test_drift_is_corrected_by_the_periodic_reconcile(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_operator(cluster, monkeypatch):
        running_group(cluster)
        sts_name, pdb_name = nm.statefulset_name("dsv3"), nm.pdb_name("dsv3")
        pdb = cluster.get(kube.PDBS, pdb_name)
        assert pdb is not None
        want_pdb = pdb["spec"]
        # `kubectl scale sts --replicas=0`, an edited PDB, and a label another tool adds
        cluster.patch(kube.STATEFULSETS, sts_name, {"spec": {"replicas": 0}})
        cluster.patch(kube.PDBS, pdb_name, {"spec": {"minAvailable": 0}})
        cluster.patch(kube.CONFIGMAPS, nm.config_map_name("dsv3"), {"metadata": {"labels": {"team": "infra"}}})
        # nothing watches these children: the periodic reconcile's apply takes the fields back
        cluster.wait_for(lambda: cluster.get(kube.STATEFULSETS, sts_name)["spec"]["replicas"] == 2,  # type: ignore[index]
                         what="replicas restored")
        cluster.wait_for(lambda: cluster.get(kube.PDBS, pdb_name)["spec"] == want_pdb,  # type: ignore[index]
                         what="the PDB restored")
        cm = cluster.get(kube.CONFIGMAPS, nm.config_map_name("dsv3"))
        assert cm is not None and cm["metadata"]["labels"]["team"] == "infra"  # fields it does not own stay
        owners = {(e["manager"], e["operation"]) for e in cluster.get(kube.PDBS, pdb_name)["metadata"][  # type: ignore[index]
            "managedFields"]}
        assert (kube.FIELD_MANAGER, "Apply") in owners


def test_children_of_the_hash_era_are_handed_over_to_the_apply(cluster: Cluster) -> None:
    """A child an older operator PUT (``vexpert.io/applied-hash``): fields the operator no longer
    sets go, the legacy annotation goes, and the operator owns the result."""
    legacy = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
              "metadata": {"name": "old-pdb", "namespace": cluster.namespace,
                           "annotations": {kube.LEGACY_APPLIED_HASH: "0123456789abcdef"}},
              "spec": {"minAvailable": 2, "selector": {"matchLabels": {"a": "b"}}}}
    cluster.create(legacy)
    desired = {**legacy, "metadata": {"name": "old-pdb", "namespace": cluster.namespace},
               "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"a": "b"}}}}
    action, obj = cluster.run(kube.apply(cluster.client, kube.PDBS, desired))
    assert action == "updated"
    assert "minAvailable" not in obj["spec"] and obj["spec"]["maxUnavailable"] == 1
    assert kube.LEGACY_APPLIED_HASH not in (obj["metadata"].get("annotations") or {})
    assert [(e["manager"], e["operation"]) for e in obj["metadata"]["managedFields"]] == \
        [(kube.FIELD_MANAGER, "Apply")]
    action, again = cluster.run(kube.apply(cluster.client, kube.PDBS, desired))
    assert action == "unchanged" and again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


# ------------------------------------------------------------------------ 2. label selectors


def test_pods_and_jobs_are_listed_and_watched_with_a_label_selector(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    if cluster.emulator is None:
        pytest.skip("the evidence is the emulator's request log")
    with running_operator(cluster, monkeypatch):
        running_group(cluster)
    seen: dict[str, list[Any]] = {"pods": [], "jobs": []}
    for request in cluster.emulator:
        plural = str(request.url.path).rstrip("/").rsplit("/", 1)[-1]
        if request.method == "GET" and plural in seen:  # collection URLs: list and watch
            seen[plural].append(request)
    for plural, requests in seen.items():
        watches = [r for r in requests if r.params.get("watch") == "true"]
        assert watches, f"no watch of {plural}"
        # Watches and lists select by label; the one exception is the sizing's per-node pod list,
        # selected by field (the pods bound to one GPU node), never the whole cluster.
        unselected = [str(r.url) for r in requests if not r.params.get("labelSelector")
                      and not (plural == "pods" and r.params.get("watch") != "true"
                               and str(r.params.get("fieldSelector", "")).startswith("spec.nodeName="))]
        assert unselected == [], f"{plural} listed or watched without a selector"
    assert {r.params["labelSelector"] for r in seen["pods"] if r.params.get("watch") == "true"} == \
        {f"{nm.LABEL_MANAGED_BY}={nm.MANAGED_BY},{nm.LABEL_ROLE}={nm.ROLE_NODE}"}
    assert {r.params["labelSelector"] for r in seen["jobs"] if r.params.get("watch") == "true"} == \
        {f"{nm.LABEL_MANAGED_BY}={nm.MANAGED_BY},{nm.LABEL_ROLE}={nm.ROLE_CALIBRATION}"}


# ------------------------------------------------------------------------------ 4. finalizers


def test_deleting_a_deployment_does_not_need_the_operator(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_operator(cluster, monkeypatch):
        running_group(cluster)
        assert not cluster.deployment("dsv3")["metadata"].get("finalizers")
    # the operator is uninstalled; the deployment and everything it owns still go at once
    cluster.delete(kube.DEPLOYMENTS, "dsv3")
    cluster.wait_for(lambda: cluster.get(kube.DEPLOYMENTS, "dsv3") is None, timeout=10, what="the vxd gone")
    for res, name in ((kube.STATEFULSETS, nm.statefulset_name("dsv3")), (kube.PDBS, nm.pdb_name("dsv3")),
                      (kube.CONFIGMAPS, nm.config_map_name("dsv3")), (kube.SERVICES, nm.api_service_name("dsv3"))):
        cluster.wait_for(lambda res=res, name=name: cluster.get(res, name) is None, what=f"{name} collected")


def test_the_finalizer_of_older_versions_is_removed(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    add_nodes(cluster, 2)
    body = deployment(calibration__mode="skip")
    body["metadata"]["finalizers"] = [nm.FINALIZER]
    cluster.create(body)
    with running_operator(cluster, monkeypatch):
        cluster.wait_for(lambda: not cluster.deployment("dsv3")["metadata"].get("finalizers"),
                         what="the legacy finalizer removed")
        cluster.wait_for(lambda: cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3")), what="the group")


# ------------------------------------------------------------------------ 5. disruption policy


def evict(cluster: Cluster, pod: str) -> int:
    """One eviction API call, as ``kubectl drain`` makes them: 201, or 429 while the budget forbids."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": cluster.namespace}}
    try:
        cluster.run(cluster.client.request("POST", kube.PODS.path(cluster.namespace, pod, "eviction"), body=body))
    except kube.ApiError as exc:
        return exc.status
    return 201


def test_a_running_group_is_protected_from_evictions_until_its_node_is_drained(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_operator(cluster, monkeypatch):
        pods = running_group(cluster)
        nodes = sorted(cluster.created_nodes)
        for pod, node in zip(sorted(p["metadata"]["name"] for p in pods), nodes, strict=True):  # the scheduler
            cluster.run(cluster.client.request("POST", kube.PODS.path(cluster.namespace, pod, "binding"), body={
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod}, "target": {"kind": "Node",
                                                                                         "name": node}}))
        victim = "dsv3-node-1"
        node = cluster.get(kube.PODS, victim)["spec"]["nodeName"]  # type: ignore[index]
        # An accidental eviction (autoscaler scale-down, descheduler) is refused: the group keeps serving.
        assert evict(cluster, victim) == 429
        # `kubectl drain NODE`: cordon, then evict every pod, retrying on 429 every few seconds.
        cluster.patch(kube.NODES, node, {"spec": {"unschedulable": True}})
        started = time.monotonic()
        cluster.wait_for(lambda: evict(cluster, victim) == 201, timeout=15, interval=0.2, what="the eviction")
        drained_in = time.monotonic() - started
        pdb = cluster.get(kube.PDBS, nm.pdb_name("dsv3"))
        assert pdb is not None and pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"],
                                                   "unhealthyPodEvictionPolicy": "AlwaysAllow"}
        assert pdb["metadata"]["annotations"][nm.ANNOTATION_DRAINED_NODES] == node
        # The rank is gone: the operator re-forms the group (its pods wait for schedulable nodes).
        cluster.wait_for(lambda: cluster.status("dsv3")["group"]["restarts"] >= 1 or
                         cluster.status("dsv3")["phase"] != "Running", what="the group re-formed")
        # Uncordoned after the maintenance: the budget protects the whole group again.
        cluster.patch(kube.NODES, node, {"spec": {"unschedulable": None}})
        bring_up(cluster, "dsv3")
        cluster.wait_for(lambda: cluster.get(kube.PDBS, nm.pdb_name("dsv3"))["spec"].get("minAvailable") == 2,  # type: ignore[index]
                         what="minAvailable back")
    assert drained_in < 10


def test_the_budget_relaxes_only_for_cordoned_nodes_running_a_rank() -> None:
    from vexpert_operator.group import nodes_being_drained
    from vexpert_operator.manifests import build_pdb
    from vexpert_operator.validation import parse_spec

    pods = [{"metadata": {"name": "a"}, "spec": {"nodeName": "n1"}},
            {"metadata": {"name": "b"}, "spec": {"nodeName": "n2"}},
            {"metadata": {"name": "c", "deletionTimestamp": "x"}, "spec": {"nodeName": "n3"}},
            {"metadata": {"name": "d"}, "spec": {}}]
    assert nodes_being_drained(pods, ["n9"]) == ()  # a cordoned node without a rank changes nothing
    assert nodes_being_drained(pods, ["n3"]) == ()  # nor one whose rank is already going
    assert nodes_being_drained(pods, ["n2", "n1", "n9"]) == ("n1", "n2")
    spec, problems = parse_spec(deployment()["spec"])
    assert spec is not None and not problems
    assert build_pdb("d", "ns", spec, [])["spec"]["minAvailable"] == 2
    relaxed = build_pdb("d", "ns", spec, [], ("n1",))
    assert "minAvailable" not in relaxed["spec"] and relaxed["spec"]["maxUnavailable"] == 1
    assert relaxed["metadata"]["annotations"] == {nm.ANNOTATION_DRAINED_NODES: "n1"}


# --------------------------------------------------------------------------- 3. leader election


def start_replica(cluster: Cluster, log: Any) -> subprocess.Popen[bytes]:
    """One operator replica as the chart runs it (``python -m vexpert_operator``), a process of its own."""
    env = {**os.environ, **OPERATOR_ENV, "VEXPERT_OPERATOR_LEADER_ELECTION": "true",
           "VEXPERT_OPERATOR_LEASE_NAMESPACE": cluster.namespace,
           "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("runtime", "operator"))}
    return subprocess.Popen([sys.executable, "-m", "vexpert_operator", "--namespace", cluster.namespace],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def lease_holder(cluster: Cluster) -> str:
    lease = cluster.get(kube.LEASES, leader.LEASE_NAME)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def test_a_standby_replica_takes_over_within_30_s_of_the_leader_dying(
        cluster: Cluster, tmp_path: Any) -> None:
    add_nodes(cluster, 2)
    logs = [open(tmp_path / f"replica-{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    first = start_replica(cluster, logs[0])
    second: subprocess.Popen[bytes] | None = None
    try:
        holder = cluster.wait_for(lambda: lease_holder(cluster), timeout=30, what="a leader")
        second = start_replica(cluster, logs[1])
        cluster.create(deployment(calibration__mode="skip"))
        cluster.wait_for(lambda: cluster.get(kube.STATEFULSETS, nm.statefulset_name("dsv3")), timeout=30,
                         what="the leader reconciling")
        time.sleep(2 * 15 / 7.5)  # the standby has seen the renewing leader for a few retries
        assert lease_holder(cluster) == holder, "the standby must not take a renewed Lease"
        os.killpg(first.pid, signal.SIGKILL)  # no clean shutdown: the Lease is not released
        first.wait(10)
        died = time.monotonic()
        generation = cluster.patch(kube.DEPLOYMENTS, "dsv3", {"spec": {"runtime": {
            "groupRestartBackoffSeconds": 3}}})["metadata"]["generation"]
        cluster.wait_for(lambda: cluster.status("dsv3").get("observedGeneration") == generation, timeout=30,
                         interval=0.2, what="the standby reconciling the change")
        took = time.monotonic() - died
        new_holder = lease_holder(cluster)
        assert new_holder and new_holder != holder
        assert took < 30, took
        print(f"takeover: the change was reconciled {took:.1f} s after the leader died")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()  # the clean way: kopf stops, the Lease is released
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    if second is not None:
        assert second.returncode == 0, (tmp_path / "replica-1.log").read_text()[-3000:]
        assert lease_holder(cluster) == "", "a replica stopping cleanly releases the Lease"
