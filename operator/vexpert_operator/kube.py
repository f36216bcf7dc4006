"""The only module that talks to the Kubernetes API (besides kopf itself).

A small async client over aiohttp (kopf's own dependency) using the same ``kopf.ConnectionInfo``
the operator logged in with: in-cluster service account, else ``$KUBECONFIG`` (read at login time,
not import time), else ``~/.kube/config``. Plain JSON dicts in and out; errors are ``ApiError``.
Children are written with server-side apply (field manager ``vexpert-operator``, forced): the API
server merges what the operator owns and removes what it stopped setting, and any other writer's
change to an owned field is taken back on the next reconcile (drift correction). Other updates are
whole-object PUTs with ``resourceVersion`` (409 on conflict) or JSON merge patches — never strategic
merge — so the semantics are the same on every API server.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from .api import DEPLOYMENT_PLURAL, GROUP, MODEL_PROFILE_PLURAL, NODE_PROFILE_PLURAL, VERSION


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{urllib.parse.quote(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{urllib.parse.quote(name)}"
            if subresource:
                base += f"/{subresource}"
        return base


NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)
NODES = Resource("", "v1", "nodes", namespaced=False)
PODS = Resource("", "v1", "pods")
CONFIGMAPS = Resource("", "v1", "configmaps")
SERVICES = Resource("", "v1", "services")
EVENTS = Resource("", "v1", "events")
PVCS = Resource("", "v1", "persistentvolumeclaims")
STATEFULSETS = Resource("apps", "v1", "statefulsets")
JOBS = Resource("batch", "v1", "jobs")
PDBS = Resource("policy", "v1", "poddisruptionbudgets")
LEASES = Resource("coordination.k8s.io", "v1", "leases")
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False)
DEPLOYMENTS = Resource(GROUP, VERSION, DEPLOYMENT_PLURAL)
NODE_PROFILES = Resource(GROUP, VERSION, NODE_PROFILE_PLURAL, namespaced=False)
MODEL_PROFILES = Resource(GROUP, VERSION, MODEL_PROFILE_PLURAL)

KIND_TO_RESOURCE: dict[str, Resource] = {
    "Namespace": NAMESPACES, "Node": NODES, "Pod": PODS, "PersistentVolumeClaim": PVCS, "ConfigMap": CONFIGMAPS, "Service": SERVICES,
    "StatefulSet": STATEFULSETS, "Job": JOBS, "PodDisruptionBudget": PDBS, "CustomResourceDefinition": CRDS,
    "Lease": LEASES, "VExpertDeployment": DEPLOYMENTS, "VExpertNodeProfile": NODE_PROFILES, "VExpertModelProfile": MODEL_PROFILES,
}


FIELD_MANAGER = "vexpert-operator"
# Stamped on children by operator versions that compared a hash instead of applying (see ``apply``).
LEGACY_APPLIED_HASH = "vexpert.io/applied-hash"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def connection_from_environment() -> kopf.ConnectionInfo:
    """In-cluster service account, else ``$KUBECONFIG`` / ``~/.kube/config`` (via the kubernetes
    client library, which understands exec plugins and auth providers), read now."""
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG") or None
        kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)  # type: ignore[no-untyped-call]
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        priority=100,
    )


_LOGGED_IN: kopf.ConnectionInfo | None = None


def remember_login(connection: kopf.ConnectionInfo) -> kopf.ConnectionInfo:
    """Called by the operator's login handler: the client then uses the same credentials as kopf."""
    global _LOGGED_IN
    _LOGGED_IN = connection
    return connection


def logged_in_connection() -> kopf.ConnectionInfo:
    if _LOGGED_IN is None:
        raise RuntimeError("not logged in yet")
    return _LOGGED_IN


class KubeClient:
    """Minimal async Kubernetes client: get, list, create, replace, merge-patch, delete.

    ``connection`` is a ``ConnectionInfo`` or a callable returning one (read when a session is
    opened, so a re-login is picked up after a 401).
    """

    def __init__(self, connection: kopf.ConnectionInfo | Callable[[], kopf.ConnectionInfo],
                 timeout_s: float = 30.0) -> None:
        self._connection = connection
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._stale = False
        self._lock = asyncio.Lock()

    @property
    def connection(self) -> kopf.ConnectionInfo:
        return self._connection() if callable(self._connection) else self._connection

    async def _get_session(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._stale and self._session is not None:
                await self._session.close()
                self._session, self._stale = None, False
            if self._session is None or self._session.closed:
                conn = self.connection
                ssl: Any = False if conn.insecure else (
                    conn.as_ssl_context() if str(conn.server).startswith("https") else None)
                self._session = aiohttp.ClientSession(
                    base_url=None,
                    headers={"Accept": "application/json", **conn.as_http_headers()},
                    connector=aiohttp.TCPConnector(ssl=ssl, limit=20),
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        session = await self._get_session()
        url = str(self.connection.server).rstrip("/") + path
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with session.request(method, url, data=data, params=params or None, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 401:
                self._stale = True  # the next request opens a session with the (re-)login
            if resp.status >= 400:
                try:
                    payload = json.loads(text)
                    reason, message = payload.get("reason", ""), payload.get("message", text)
                except (json.JSONDecodeError, AttributeError):
                    reason, message = resp.reason or "", text[:500]
                raise ApiError(resp.status, str(reason), str(message)[:2000])
            return json.loads(text) if text else {}

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> dict[str, Any]:
        return await self.request("GET", res.path(namespace, name))

    async def get_or_none(self, res: Resource, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return await self.get(res, name, namespace)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def list(self, res: Resource, namespace: str | None = None, *, labels: Mapping[str, str] | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        params: dict[str, str] = {"limit": "500"}
        if labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in labels.items())
        if field_selector:
            params["fieldSelector"] = field_selector
        items: list[dict[str, Any]] = []
        while True:
            page = await self.request("GET", res.path(namespace), params=params)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            params["continue"] = token

    async def create(self, res: Resource, body: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        ns = namespace or (body.get("metadata") or {}).get("namespace")
        return await self.request("POST", res.path(ns), body=body)

    async def replace(self, res: Resource, body: Mapping[str, Any]) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        return await self.request("PUT", res.path(meta.get("namespace"), meta["name"]), body=body)

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str | None = None,
                    subresource: str | None = None) -> dict[str, Any]:
        return await self.request("PATCH", res.path(namespace, name, subresource), body=patch,
                                  content_type="application/merge-patch+json")

    async def server_side_apply(self, res: Resource, body: Mapping[str, Any], *, force: bool = True,
                                field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """``PATCH`` as ``application/apply-patch+yaml`` (JSON is YAML): creates the object or merges
        the fields this manager sets; ``force`` takes over fields another manager changed."""
        meta = body.get("metadata") or {}
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self.request("PATCH", res.path(meta.get("namespace"), meta["name"]), body=body, params=params,
                                  content_type="application/apply-patch+yaml")

    async def delete(self, res: Resource, name: str, namespace: str | None = None, *,
                     propagation: str = "Background", uid: str | None = None,
                     resource_version: str | None = None) -> bool:
        """Delete; False if it was already gone. ``uid`` and ``resource_version`` are preconditions
        (409 if the object was replaced, or changed since it was read)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            body["preconditions"] = preconditions
        try:
            await self.request("DELETE", res.path(namespace, name), body=body)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True


async def apply(client: KubeClient, res: Resource, desired: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Server-side apply ``desired`` (complete: every field the operator wants, nothing else).
    Returns (created|updated|unchanged, obj).

    Forced, on every reconcile: a ``kubectl scale`` or an edited PDB is reverted by the next one. The
    GET before tells created/updated/unchanged apart (metrics, logs) and finds children written by
    an operator version that PUT them (``LEGACY_APPLIED_HASH``): those are handed over first.
    """
    meta = desired["metadata"]
    live = await client.get_or_none(res, meta["name"], meta.get("namespace"))
    if live is not None and LEGACY_APPLIED_HASH in ((live.get("metadata") or {}).get("annotations") or {}):
        live = await _hand_over(client, res, desired, live)
    applied = await client.server_side_apply(res, desired)
    if live is None:
        return "created", applied
    same = applied["metadata"].get("resourceVersion") == live["metadata"].get("resourceVersion")
    return ("unchanged" if same else "updated"), applied


async def _hand_over(client: KubeClient, res: Resource, desired: Mapping[str, Any], live: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """A child an older operator PUT: its fields belong to an ``Update`` manager, so an apply
    would share them and never remove one the operator stopped setting (a PDB would keep its old
    ``minAvailable`` next to the new ``maxUnavailable`` and be refused). One PUT of the desired
    object with ``managedFields: [{}]`` (the documented way to strip them) leaves exactly the
    desired fields, owned by nobody; the apply that follows owns them all."""
    body = json.loads(json.dumps(desired))
    body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
    body["metadata"]["managedFields"] = [{}]
    if res == SERVICES and "clusterIP" in (live.get("spec") or {}):  # allocated by the server, immutable
        body["spec"]["clusterIP"] = live["spec"]["clusterIP"]
        if "clusterIPs" in live["spec"]:
            body["spec"]["clusterIPs"] = live["spec"]["clusterIPs"]
    return await client.replace(res, body)
