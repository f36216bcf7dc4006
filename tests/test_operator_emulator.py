"""The API emulator's fixes over kmock: each behaviour the operator's API tests rely on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import kopf
import pytest

from operator_support.emulator import KubeEmulator, label_selector_matches, merge_patch
from operator_support.harness import Cluster, EmulatorServer, LoopThread
from vexpert_operator import kube

CM = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": "1"}}


@pytest.fixture
def env() -> Iterator[tuple[Cluster, EmulatorServer]]:
    loop = LoopThread()
    server = EmulatorServer(loop).start()
    assert server.emulator is not None
    cluster = Cluster(loop, kopf.ConnectionInfo(server=server.url), "ns", server.emulator)
    cluster.install_crds()
    cluster.create_namespace()
    try:
        yield cluster, server
    finally:
        cluster.close()
        server.stop()
        loop.stop()


def api_error(fn: Any, *args: Any, **kwargs: Any) -> kube.ApiError:
    with pytest.raises(kube.ApiError) as info:
        fn(*args, **kwargs)
    return info.value


def test_metadata_resource_versions_and_no_op_writes(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    cm = cluster.create(CM)
    meta = cm["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1 and meta["namespace"] == "ns"
    rv = int(meta["resourceVersion"])
    patched = cluster.patch(kube.CONFIGMAPS, "c", {"data": {"a": "2"}})
    assert int(patched["metadata"]["resourceVersion"]) > rv
    assert patched["metadata"]["generation"] == 2 and patched["metadata"]["uid"] == meta["uid"]
    same = cluster.patch(kube.CONFIGMAPS, "c", {"data": {"a": "2"}})
    assert same["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]
    listed = cluster.run(cluster.client.request("GET", kube.CONFIGMAPS.path("ns")))
    assert int(listed["metadata"]["resourceVersion"]) >= int(patched["metadata"]["resourceVersion"])
    assert listed["kind"] == "ConfigMapList"
    generated = cluster.create({**CM, "metadata": {"generateName": "gen-"}})
    assert generated["metadata"]["name"].startswith("gen-") and len(generated["metadata"]["name"]) == 9


def test_conflicts(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    cm = cluster.create(CM)
    assert api_error(cluster.create, CM).status == 409
    cluster.patch(kube.CONFIGMAPS, "c", {"data": {"a": "2"}})
    stale = {**cm, "data": {"a": "3"}}
    assert api_error(cluster.run, cluster.client.replace(kube.CONFIGMAPS, stale)).status == 409
    err = api_error(cluster.patch, kube.CONFIGMAPS, "c",
                    {"metadata": {"resourceVersion": cm["metadata"]["resourceVersion"]}, "data": {"a": "4"}})
    assert err.status == 409
    # kopf's finalizer JSON patch with a failing `test` op gets 422, as from a real API server.
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
           {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]
    err = api_error(cluster.run, cluster.client.request("PATCH", kube.CONFIGMAPS.path("ns", "c"), body=ops,
                                                        content_type="application/json-patch+json"))
    assert err.status == 422
    smp = api_error(cluster.run, cluster.client.request("PATCH", kube.CONFIGMAPS.path("ns", "c"), body={},
                                                        content_type="application/strategic-merge-patch+json"))
    assert smp.status == 415
    assert api_error(cluster.create, {**CM, "metadata": {"name": "x", "namespace": "missing"}}).status == 404


def test_status_subresource_isolation_and_generation(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    job = cluster.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
                          "status": {"succeeded": 5},
                          "spec": {"template": {"spec": {"restartPolicy": "Never",
                                                         "containers": [{"name": "c", "image": "i"}]}}}})
    assert job.get("status", {}).get("succeeded") is None  # status on create is ignored
    pod_name = cluster.wait_for(lambda: cluster.job_pod("j"), what="the Job controller's pod")["metadata"]["name"]
    after = cluster.patch(kube.PODS, pod_name, {"status": {"phase": "Running"}, "metadata": {"labels": {"x": "y"}}})
    assert after["status"]["phase"] == "Pending" and after["metadata"]["labels"]["x"] == "y"
    running = cluster.patch(kube.PODS, pod_name, {"status": {"phase": "Running"}, "metadata": {"labels": {"x": "z"}}},
                            subresource="status")
    assert running["status"]["phase"] == "Running" and running["metadata"]["labels"]["x"] == "y"
    assert running["metadata"]["generation"] == 1


def test_watch_resumes_from_resource_version_and_follows_selectors(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, server = env
    first = cluster.create({**CM, "metadata": {"name": "a", "labels": {"app": "x"}}})
    cluster.create({**CM, "metadata": {"name": "b", "labels": {"app": "y"}}})
    since = first["metadata"]["resourceVersion"]
    cluster.patch(kube.CONFIGMAPS, "a", {"metadata": {"labels": {"app": "y"}}})

    async def watch(params: dict[str, str], n: int) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        async with aiohttp.ClientSession() as session, session.get(
                f"{server.url}/api/v1/namespaces/ns/configmaps", params={"watch": "true", **params}) as resp:
            async for line in resp.content:
                if line.strip():
                    event = json.loads(line)
                    out.append((event["type"], event["object"]["metadata"]["name"]))
                    if len(out) == n:
                        return out
        return out

    resumed = cluster.run(asyncio.wait_for(watch({"resourceVersion": since}, 2), 5))
    assert resumed == [("ADDED", "b"), ("MODIFIED", "a")]  # not a replay of `a`'s creation
    fresh = cluster.run(asyncio.wait_for(watch({}, 2), 5))
    assert sorted(fresh) == [("ADDED", "a"), ("ADDED", "b")]
    # `a` left the selector app=x: a selector watch from before sees it DELETED.
    left = cluster.run(asyncio.wait_for(watch({"resourceVersion": since, "labelSelector": "app=x"}, 1), 5))
    assert left == [("DELETED", "a")]
    timed = cluster.run(asyncio.wait_for(watch({"resourceVersion": "999999", "timeoutSeconds": "1"}, 1), 5))
    assert timed == []


def test_selectors() -> None:
    labels = {"app": "vexpert", "tier": "node"}
    assert label_selector_matches("app=vexpert,tier==node", labels)
    assert label_selector_matches("app in (vexpert, other),!missing,tier", labels)
    assert not label_selector_matches("app notin (vexpert)", labels)
    assert not label_selector_matches("tier!=node", labels)
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None}, "l": [2], "s": {"x": 1}}) == \
        {"a": {"c": 2}, "l": [2], "s": {"x": 1}}


def test_lists_filter_by_label_and_field_and_namespaces_list(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    cluster.create({**CM, "metadata": {"name": "a", "labels": {"app": "x"}}})
    cluster.create({**CM, "metadata": {"name": "b", "labels": {"app": "y"}}})
    assert [o["metadata"]["name"] for o in cluster.list(kube.CONFIGMAPS, app="x")] == ["a"]
    by_field = cluster.run(cluster.client.list(kube.CONFIGMAPS, "ns", field_selector="metadata.name=b"))
    assert [o["metadata"]["name"] for o in by_field] == ["b"]
    assert "ns" in {n["metadata"]["name"] for n in cluster.list(kube.NAMESPACES)}
    assert cluster.get(kube.NAMESPACES, "ns") is not None


def test_finalizers_and_garbage_collection(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    owner = cluster.create({**CM, "metadata": {"name": "owner", "finalizers": ["x/y"]}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"],
           "controller": True}
    cluster.create({**CM, "metadata": {"name": "child", "ownerReferences": [ref]}})
    cluster.delete(kube.CONFIGMAPS, "owner")
    marked = cluster.get(kube.CONFIGMAPS, "owner")
    assert marked is not None and marked["metadata"]["deletionTimestamp"]
    assert cluster.get(kube.CONFIGMAPS, "child") is not None
    cluster.patch(kube.CONFIGMAPS, "owner", {"metadata": {"finalizers": None}})
    assert cluster.get(kube.CONFIGMAPS, "owner") is None
    assert cluster.get(kube.CONFIGMAPS, "child") is None
    assert cluster.delete(kube.CONFIGMAPS, "child") is False  # already gone: 404 → False
    cluster.create({**CM, "metadata": {"name": "p"}})
    err = api_error(cluster.run, cluster.client.delete(kube.CONFIGMAPS, "p", "ns", uid="not-its-uid"))
    assert err.status == 409  # a delete precondition on the uid


def test_posted_crds_register_resources_with_schema_and_defaults(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    discovery = cluster.run(cluster.client.request("GET", "/apis/vexpert.io/v1alpha1"))
    kinds = {r["kind"]: r for r in discovery["resources"]}
    assert kinds["VExpertDeployment"]["namespaced"] is True and "vxd" in kinds["VExpertDeployment"]["shortNames"]
    assert kinds["VExpertNodeProfile"]["namespaced"] is False
    assert "vexpertdeployments/status" in {r["name"] for r in discovery["resources"]}
    body = {"apiVersion": "vexpert.io/v1alpha1", "kind": "VExpertDeployment", "metadata": {"name": "d"},
            "spec": {"model": {"name": "m", "checkpoint": {"claimName": "c"}}, "parallelism": {"expertParallelSize": 8},
                     "runtime": {"image": "i"}}}
    created = cluster.create(body)
    assert created["spec"]["parallelism"]["gpusPerNode"] == 8 and created["spec"]["model"]["revision"] == "main"
    bad = {**body, "metadata": {"name": "e"}, "spec": {**body["spec"], "runtime": {"image": "i", "cpus": 3}}}
    err = api_error(cluster.create, bad)
    assert err.status == 422 and "cpus" in err.message


def test_builtin_objects_are_validated_and_immutable_fields_enforced(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    err = api_error(cluster.create, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
                                     "spec": {"ports": [{"port": "http"}]}})
    assert err.status == 422
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "s"},
           "spec": {"serviceName": "s", "replicas": 2, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    cluster.create(sts)
    pods = cluster.wait_for(lambda: (lambda ps: ps if len(ps) == 2 else None)(cluster.list(kube.PODS, a="b")),
                            what="the StatefulSet's pods")
    assert sorted(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] for p in pods) == ["0", "1"]
    err = api_error(cluster.patch, kube.STATEFULSETS, "s", {"spec": {"serviceName": "other"}})
    assert err.status == 422 and "Forbidden" in err.message
    cluster.patch(kube.STATEFULSETS, "s", {"spec": {"replicas": 1}})
    cluster.wait_for(lambda: len(cluster.list(kube.PODS, a="b")) == 1, what="scale down")
    cluster.patch(kube.PODS, "s-0", {"status": {"phase": "Failed"}}, subresource="status")
    replaced = cluster.wait_for(lambda: (lambda p: p if p and p["status"]["phase"] == "Pending" else None)(
        cluster.get(kube.PODS, "s-0")), what="the failed pod replaced")
    assert replaced["metadata"]["uid"] != pods[0]["metadata"]["uid"]


def test_job_controller_completes_and_fails(env: tuple[Cluster, EmulatorServer]) -> None:
    cluster, _ = env
    template = {"spec": {"restartPolicy": "Never", "containers": [{"name": "calibrate", "image": "i"}]}}
    for name in ("ok", "bad"):
        cluster.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                        "spec": {"backoffLimit": 0, "template": template}})
    cluster.finish_job("ok", '{"x": 1}')
    cluster.finish_job("bad", "boom", exit_code=2)

    def condition(job: str) -> str | None:
        obj = cluster.get(kube.JOBS, job) or {}
        done = [c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] in (
            "Complete", "Failed")]
        return done[0] if done else None

    assert cluster.wait_for(lambda: condition("ok"), what="Complete") == "Complete"
    assert cluster.wait_for(lambda: condition("bad"), what="Failed") == "Failed"


def test_injected_faults_prevent_the_change(env: tuple[Cluster, EmulatorServer]) -> None:
    """kmock's reaction DSL still works: a reaction answering 500 means nothing was stored."""
    cluster, server = env
    emulator: KubeEmulator = server.emulator  # type: ignore[assignment]
    emulator["post", "/api/v1/namespaces/ns/configmaps"] << 500
    assert api_error(cluster.create, CM).status == 500
    time.sleep(0.05)
    assert cluster.get(kube.CONFIGMAPS, "c") is None


def test_server_side_apply_owns_merges_removes_and_conflicts(env: tuple[Cluster, EmulatorServer]) -> None:
    """``application/apply-patch+yaml`` as the operator uses it (see ``fieldmanagers.py``)."""
    from operator_support.fieldmanagers import parse_managed_fields

    cluster, _ = env
    client = cluster.client
    cfg = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "s", "namespace": "ns", "labels": {"a": "1"}}, "data": {"x": "1", "y": "2"}}
    created = cluster.run(client.server_side_apply(kube.CONFIGMAPS, cfg))  # creates
    owners = parse_managed_fields(created["metadata"]["managedFields"])
    assert owners == {("vexpert-operator", "Apply"): {("metadata", "labels", "a"), ("data", "x"), ("data", "y")}}
    again = cluster.run(client.server_side_apply(kube.CONFIGMAPS, cfg))  # a no-op apply writes nothing
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    # Another writer changes an owned field and adds its own: it takes the changed one over.
    cluster.patch(kube.CONFIGMAPS, "s", {"data": {"x": "drift", "z": "theirs"}})
    # Without force the applier is told; with force it takes the field back, and keeps theirs.
    err = api_error(cluster.run, client.server_side_apply(kube.CONFIGMAPS, cfg, force=False))
    assert err.status == 409 and "data.x" in err.message
    fixed = cluster.run(client.server_side_apply(kube.CONFIGMAPS, cfg))
    assert fixed["data"] == {"x": "1", "y": "2", "z": "theirs"}
    # Dropping a field from the configuration removes it (nobody else owns it); others stay.
    smaller = {**cfg, "metadata": {"name": "s", "namespace": "ns"}, "data": {"x": "1"}}
    shrunk = cluster.run(client.server_side_apply(kube.CONFIGMAPS, smaller))
    assert shrunk["data"] == {"x": "1", "z": "theirs"} and "labels" not in shrunk["metadata"]
    # managedFields: [{}] in a PUT strips ownership (how kube.apply hands over legacy children).
    body = {**shrunk, "metadata": {**shrunk["metadata"], "managedFields": [{}]}}
    stripped = cluster.run(client.replace(kube.CONFIGMAPS, body))
    assert "managedFields" not in stripped["metadata"]
    assert api_error(cluster.run, client.server_side_apply(kube.CONFIGMAPS, {**cfg, "metadata": {"name": "s"},
                                                                             "kind": ""})).status == 400
