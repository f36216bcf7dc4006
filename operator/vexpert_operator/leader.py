"""Leader election with a ``coordination.k8s.io/v1`` Lease, the way client-go's leaderelection does it.

Several operator replicas run; one holds the Lease and runs kopf, the others wait (``__main__``).
The holder renews the Lease every ``retry`` seconds; a standby takes it over once it has seen the
same record unchanged for ``leaseDurationSeconds`` (its own clock, not the holder's timestamps, so
clock skew between nodes does not matter). A holder that cannot renew for ``renew_deadline`` seconds
stops (the process exits and the pod restarts as a standby) before a standby can take over, so two
replicas never reconcile at once. A holder shutting down releases the Lease (empty holder, 1 s) and
a standby takes over at its next retry.

Why a Lease and not kopf's peering: kopf's peering pauses operators with a *lower* priority and,
when peers have the same priority, pauses all of them (it is meant to keep a developer's local
operator from fighting the deployed one, not to elect one of N equal replicas); it also needs its
own CRDs. A Lease is what the Kubernetes controllers themselves use (``kubectl get lease``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import random
import signal
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp

from . import kube

LEASE_NAME = "vexpert-operator"
log = logging.getLogger("vexpert.leader")


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    duration_s: float
    renew_time: str
    transitions: int
    acquire_time: str


def read_lease(lease: Mapping[str, Any]) -> LeaseRecord:
    spec = lease.get("spec") or {}
    return LeaseRecord(holder=spec.get("holderIdentity") or "", duration_s=float(spec.get("leaseDurationSeconds") or 0),
                       renew_time=spec.get("renewTime") or "", transitions=int(spec.get("leaseTransitions") or 0),
                       acquire_time=spec.get("acquireTime") or "")


def may_take(record: LeaseRecord, identity: str, unchanged_for_s: float) -> bool:
    """Ours already, released, or not renewed for a whole lease duration as seen from here."""
    return record.holder in ("", identity) or unchanged_for_s >= record.duration_s


def micro_time(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(record: LeaseRecord | None, identity: str, duration_s: float, now: dt.datetime) -> dict[str, Any]:
    """The spec that (re)claims the Lease: acquireTime and transitions change only with the holder."""
    stamp = micro_time(now)
    ours = record is not None and record.holder == identity
    transitions = (record.transitions if ours else record.transitions + 1) if record is not None else 0
    return {"holderIdentity": identity, "leaseDurationSeconds": max(1, round(duration_s)),
            "acquireTime": record.acquire_time if ours and record is not None and record.acquire_time else stamp,
            "renewTime": stamp, "leaseTransitions": transitions}


class LeaderElector:
    """Acquire, renew and release one Lease (all API calls through ``kube.KubeClient``)."""

    def __init__(self, client: kube.KubeClient, namespace: str, identity: str, duration_s: float = 15.0,
                 name: str = LEASE_NAME) -> None:
        self.client, self.namespace, self.identity, self.name = client, namespace, identity, name
        self.duration_s = duration_s
        self.renew_deadline_s = duration_s * 2 / 3  # client-go's defaults: 15 s, 10 s, 2 s
        self.retry_s = duration_s / 7.5
        self._seen: tuple[LeaseRecord, float] | None = None  # last record seen, and since when (monotonic)

    def _unchanged_for(self, record: LeaseRecord) -> float:
        now = time.monotonic()
        if self._seen is None or self._seen[0] != record:
            self._seen = (record, now)
        return now - self._seen[1]

    async def try_acquire_or_renew(self) -> bool:
        lease = await self.client.get_or_none(kube.LEASES, self.name, self.namespace)
        now = dt.datetime.now(dt.timezone.utc)
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        try:
            if lease is None:
                await self.client.create(kube.LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                       "metadata": meta,
                                                       "spec": lease_spec(None, self.identity, self.duration_s, now)})
                return True
            record = read_lease(lease)
            if not may_take(record, self.identity, self._unchanged_for(record)):
                return False
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]  # a racing standby gets 409
            await self.client.replace(kube.LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                    "metadata": meta,
                                                    "spec": lease_spec(record, self.identity, self.duration_s, now)})
            return True
        except kube.ApiError as exc:
            if exc.conflict:
                return False
            raise

    async def acquire(self) -> None:
        """Block until this replica holds the Lease."""
        log.info("waiting to lead: Lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not await self._attempt():
            await asyncio.sleep(self.retry_s * random.uniform(1.0, 1.2))
        log.info("leading: Lease %s/%s held by %s", self.namespace, self.name, self.identity)

    async def hold(self) -> None:
        """Renew until a renewal has not succeeded for ``renew_deadline_s``; then return (lost)."""
        last_ok = time.monotonic()
        while time.monotonic() - last_ok < self.renew_deadline_s:
            await asyncio.sleep(self.retry_s)
            if await self._attempt():
                last_ok = time.monotonic()
        log.error("lost the Lease %s/%s (no renewal for %.0f s)", self.namespace, self.name, self.renew_deadline_s)

    async def release(self) -> None:
        """Hand over at once on a clean shutdown: empty holder, shortest duration."""
        lease = await self.client.get_or_none(kube.LEASES, self.name, self.namespace)
        if lease is None or read_lease(lease).holder != self.identity:
            return
        spec = {**(lease.get("spec") or {}), "holderIdentity": "", "leaseDurationSeconds": 1}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": spec,
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "resourceVersion": lease["metadata"]["resourceVersion"]}}
        with contextlib.suppress(kube.ApiError):  # else it expires on its own
            await self.client.replace(kube.LEASES, body)

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except (kube.ApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
            return False


# ------------------------------------------------------------------------------ the process


def own_namespace() -> str:
    """The pod's namespace: ``POD_NAMESPACE`` (downward API), else the service account's."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def liveness_port(args: list[str]) -> int | None:
    """The port of kopf's ``--liveness`` endpoint, answered by the standby while it waits."""
    for i, arg in enumerate(args):
        url = arg.split("=", 1)[1] if arg.startswith("--liveness=") else (
            args[i + 1] if arg == "--liveness" and i + 1 < len(args) else None)
        if url:
            return urllib.parse.urlsplit(url).port
    return None


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"standby\n")

    def log_message(self, *args: Any) -> None:
        pass


def run_as_leader(run: Callable[[], int], namespace: str, duration_s: float, health_port: int | None) -> int:
    """Wait for the Lease (answering the liveness probe meanwhile), then ``run`` kopf while a thread
    renews it. Losing it stops the process (SIGTERM: kopf shuts down cleanly; the pod restarts as a
    standby); a normal end releases it."""
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:6]}"
    health = ThreadingHTTPServer(("0.0.0.0", health_port), _Healthy) if health_port else None
    if health is not None:
        threading.Thread(target=health.serve_forever, daemon=True).start()
    try:
        asyncio.run(_with_elector(namespace, identity, duration_s, lambda e: e.acquire()))
    finally:
        if health is not None:
            health.shutdown()
            health.server_close()  # kopf binds the same port next
    stop = threading.Event()
    thread = threading.Thread(target=_renew, args=(namespace, identity, duration_s, stop), daemon=True,
                              name="lease renewal")
    thread.start()
    try:
        return run()
    finally:
        stop.set()
        thread.join(10)


async def _with_elector(namespace: str, identity: str, duration_s: float, body: Callable[[LeaderElector], Any]) -> Any:
    client = kube.KubeClient(kube.connection_from_environment())
    try:
        return await body(LeaderElector(client, namespace, identity, duration_s))
    finally:
        await client.close()


def _renew(namespace: str, identity: str, duration_s: float, stop: threading.Event) -> None:
    async def lead(elector: LeaderElector) -> bool:
        holding = asyncio.create_task(elector.hold())
        while not holding.done() and not stop.is_set():
            await asyncio.sleep(0.1)
        if holding.done():
            return True
        holding.cancel()
        await elector.release()
        return False

    if asyncio.run(_with_elector(namespace, identity, duration_s, lead)):
        os.kill(os.getpid(), signal.SIGTERM)
        if not stop.wait(duration_s):
            os._exit(1)  # kopf did not stop in time: a standby is about to take over
