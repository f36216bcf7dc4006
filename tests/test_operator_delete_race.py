"""A deletion wins over a reconcile in flight (issue 22, point 9): the operator never leaves or
re-creates children of a ``VExpertDeployment`` that is being deleted or is gone.

Under leader kills, a deployment deleted within ~1 s of the kill kept its StatefulSet (with pods) or
its PDB: the in-flight reconcile re-created them 0.3–0.8 s after the DELETE. Here the race is made
deterministic: a hook in the emulator deletes the owner at an exact point of the operator's request
sequence — right after the reconcile's first read of the owner, right after its re-read before the
children, or just before the apply of one child (the DELETE lands between the check and the write,
which no check before writing can see). The emulator's collection of late dependents is switched off
for these tests, so what is left is what the operator left: it must take back what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kmock._internal import references, rendering

from operator_support.harness import Cluster, cluster_session, running_operator
from test_operator_api import add_nodes, deployment, model_jobs, node_pods
from vexpert_operator import kube
from vexpert_operator import naming as nm
from vexpert_operator.ownership import belongs_to, may_write_children, owner_state

UID = "0b7c1c52-4a3e-4a55-9a8e-5f1f2f0c1d11"


def owner(uid: str = UID, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "dsv3", "namespace": "ns", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T12:00:00Z"
    return {"metadata": meta}


# ----------------------------------------------------------------------------- the pure decision


def test_children_are_written_only_for_the_live_owner_of_the_planned_uid() -> None:
    assert owner_state(owner(), UID) == "live" and may_write_children(owner(), UID)
    assert owner_state(None, UID) == "gone" and not may_write_children(None, UID)
    assert owner_state(owner(deleting=True), UID) == "deleting" and not may_write_children(owner(deleting=True), UID)
    # deleted and re-created under the same name: the new object's children are not this reconcile's
    assert owner_state(owner("another-uid"), UID) == "replaced" and not may_write_children(owner("another-uid"), UID)
    assert owner_state(owner("another-uid", deleting=True), UID) == "replaced"
    # an object without a uid (never from an API server): its name is all there is to go by
    assert owner_state(owner(""), UID) == "live" and owner_state(owner(), "") == "live"
    assert owner_state(owner(deleting=True), "") == "deleting"


def test_only_children_that_still_belong_to_the_gone_owner_are_taken_back() -> None:
    def child(*uids: str) -> dict[str, Any]:
        return {"metadata": {"name": "c", "ownerReferences": [{"kind": "VExpertDeployment", "uid": u} for u in uids]}}
    assert belongs_to(child(UID), UID)
    assert belongs_to(child("other", UID), UID)
    assert not belongs_to(child("other"), UID)  # re-applied for a new deployment of the same name
    assert not belongs_to(child(), UID) and not belongs_to({"metadata": {}}, UID)
    assert not belongs_to(None, UID)
    assert not belongs_to(child(""), "")  # no uid: nothing is known to be its


# ------------------------------------------------------------------------- against the emulator

DEPLOYMENTS = references.resource("vexpert.io", "v1alpha1", "vexpertdeployments")
NAME = "dsv3"


@pytest.fixture
def cluster(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with cluster_session(tmp_path, monkeypatch) as c:
        assert c.emulator is not None
        c.emulator.collect_late_dependents = False
        try:
            yield c
        finally:
            c.emulator.request_hook = None


class DeleteOwnerAt:
    """Emulator hook: deletes the deployment once, at the given point of the operator's requests.

    ``read:N`` — right after the N-th GET of the deployment is served (the reconcile's first read,
    then its re-read before the children); ``apply:Kind`` — just before the server-side apply of the
    first child of that kind is served; ``create:Job`` — just before the model calibration Job's POST.
    """

    def __init__(self, cluster: Cluster, point: str) -> None:
        assert cluster.emulator is not None
        self.emulator = cluster.emulator
        self.namespace = cluster.namespace
        self.point = point
        self.reads = 0
        self.fired = threading.Event()
        self.deleted_uid = ""

    async def __call__(self, request: rendering.Request, when: str) -> None:
        if self.fired.is_set() or not self._matches(request, when):
            return
        self.fired.set()
        async with self.emulator._lock:
            gone = await self.emulator.delete_object(DEPLOYMENTS, self.namespace, NAME)
        self.deleted_uid = gone["metadata"]["uid"]

    def _matches(self, request: rendering.Request, when: str) -> bool:
        kind, _, arg = self.point.partition(":")
        res, data = request.resource, request.data if isinstance(request.data, dict) else {}
        if not data and request.text:
            with contextlib.suppress(ValueError):
                data = json.loads(request.text)
        if kind == "read":
            if when != "after" or request.method != "GET" or res != DEPLOYMENTS or request.name != NAME:
                return False
            self.reads += 1
            return self.reads == int(arg)
        if when != "before":
            return False
        if kind == "apply":
            return (request.method == "PATCH" and data.get("kind") == arg
                    and request.headers.get("Content-Type", "").startswith("application/apply-patch"))
        return (request.method == "POST" and data.get("kind") == "Job"
                and ((data.get("metadata") or {}).get("labels") or {}).get(nm.LABEL_CALIBRATION) == "model")


def leftovers(cluster: Cluster) -> list[str]:
    """Every child of the deployment that exists (none may, once it is gone)."""
    found = [f"{res.plural}/{name}" for res, name in (
        (kube.CONFIGMAPS, nm.config_map_name(NAME)), (kube.SERVICES, nm.service_name(NAME)),
        (kube.SERVICES, nm.api_service_name(NAME)), (kube.STATEFULSETS, nm.statefulset_name(NAME)),
        (kube.PDBS, nm.pdb_name(NAME))) if cluster.get(res, name) is not None]
    found += [f"pods/{p['metadata']['name']}" for p in node_pods(cluster, NAME)]
    found += [f"jobs/{j['metadata']['name']}" for j in model_jobs(cluster)]
    return found


def written_after_delete(cluster: Cluster, uid: str) -> list[str]:
    """Children of the deleted owner ``uid`` the operator wrote after the DELETE (from the event log)."""
    assert cluster.emulator is not None
    deleted_at = next(rv for rv, type_, obj, _ in cluster.emulator.event_log("vexpert.io", "v1alpha1",
                                                                              "vexpertdeployments")
                      if type_ == "DELETED" and obj["metadata"]["uid"] == uid)
    out = []
    for group, plural in (("", "configmaps"), ("", "services"), ("apps", "statefulsets"),
                          ("policy", "poddisruptionbudgets"), ("batch", "jobs")):
        for rv, type_, obj, _ in cluster.emulator.event_log(group, "v1", plural):
            if rv > deleted_at and type_ in ("ADDED", "MODIFIED") and belongs_to(obj, uid):
                out.append(f"{plural}/{obj['metadata']['name']}")
    return out


def race(cluster: Cluster, point: str, body: dict[str, Any]) -> list[str]:
    """Create the deployment, delete it at ``point`` of the operator's reconcile, and check that
    nothing of it is left once the operator is quiet. Returns what was written after the DELETE."""
    assert cluster.emulator is not None
    hook = DeleteOwnerAt(cluster, point)
    cluster.emulator.request_hook = hook
    cluster.create(body)
    assert hook.fired.wait(15), f"the operator never reached {point}"
    cluster.emulator.request_hook = None
    cluster.wait_for(lambda: cluster.get(kube.DEPLOYMENTS, NAME) is None, what="the deployment gone")
    cluster.wait_for(lambda: not leftovers(cluster), timeout=10, what=f"no child left ({point})")
    time.sleep(1.0)  # > 3 reconcile periods: nothing comes back either
    assert leftovers(cluster) == [], point
    return written_after_delete(cluster, hook.deleted_uid)


GROUP_POINTS = ["read:1", "read:2", "apply:ConfigMap", "apply:Service", "apply:StatefulSet",
                "apply:PodDisruptionBudget"]


def test_a_delete_racing_the_reconcile_leaves_no_child(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    add_nodes(cluster, 2)
    body = deployment(NAME, calibration__mode="skip")  # the first reconcile applies the group's children
    written: dict[str, list[str]] = {}
    with running_operator(cluster, monkeypatch):
        for point in GROUP_POINTS * 2:  # 12 deletions, the same name re-created each time
            written.setdefault(point, []).extend(race(cluster, point, body))
        # the race is real: deleted before an apply, the child was written for the gone owner (and
        # taken back); deleted after the first read, the re-read stopped the reconcile before any write
        assert written["read:1"] == []
        for kind, name in (("ConfigMap", nm.config_map_name(NAME)), ("StatefulSet", nm.statefulset_name(NAME)),
                           ("PodDisruptionBudget", nm.pdb_name(NAME))):
            assert any(w.endswith("/" + name) for w in written[f"apply:{kind}"]), (kind, written)
        # and a deployment created afterwards still gets its group
        cluster.create(body)
        cluster.wait_for(lambda: cluster.get(kube.PDBS, nm.pdb_name(NAME)), what="the group of a new deployment")
        cluster.wait_for(lambda: len(node_pods(cluster, NAME)) == 2, what="its 2 node pods")
    # (after the operator: kopf's runner captures stdout while it runs)
    print("written after the DELETE, then taken back:", {p: sorted(set(w)) for p, w in written.items()})


def test_a_delete_racing_the_model_calibration_job_leaves_no_job(cluster: Cluster,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    type_name = add_nodes(cluster, 2)
    cluster.add_node_profile(type_name)  # hardware profiled: the reconcile goes straight to the model Job
    with running_operator(cluster, monkeypatch):
        for _ in range(2):
            written = race(cluster, "create:Job", deployment(NAME))
            assert any(w.startswith("jobs/") for w in written), written
