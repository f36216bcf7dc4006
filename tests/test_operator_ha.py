"""Production behaviours of the operator (issue #15): drift correction by server-side apply, label
selectors on the watches, deletion without the operator, node drains, leader election.

Each test runs against the emulator and, with ``KUBECONFIG`` set when pytest starts, against that
cluster (see ``tests/operator_support``), except where the emulator's request log is the evidence.
"""

from __future__ import annotations

from typing import Any

import pytest

from operator_support.harness import Cluster, running_operator
from test_operator_api import add_nodes, bring_up, calibrate, cluster, deployment, wait_phase
from vexpert_operator import kube
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
        unselected = [str(r.url) for r in requests if not r.params.get("labelSelector")]
        assert unselected == [], f"{plural} listed or watched without a labelSelector"
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
