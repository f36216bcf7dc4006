"""VExpertDeployment handlers: reconcile on create/update/resume, and one loop per deployment that
re-reconciles periodically (level-triggered), when woken by a pod/Job/profile event, and runs the
tuning loop every ``spec.vexpert.tuningIntervalSeconds``.

No finalizer: the children are owned (``ownerReferences``) and garbage-collected by the API server,
and nothing outside the cluster needs cleaning up, so deleting a ``vxd`` never waits for the
operator (it may be uninstalled or down). That is why the per-deployment loop is an asyncio task
started and stopped from the watch events (``track``) rather than a ``kopf.daemon``: kopf puts a
finalizer on every object with a daemon, to stop the daemon before the object goes. A finalizer
left by an older version is removed by kopf on the first event, since no handler needs it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from .. import kube
from .. import metrics as m
from ..api import DEPLOYMENT_PLURAL, GROUP, VERSION
from ..reconciler import Context, Outcome, is_permanently_invalid, reconcile, utcnow

VXD = (GROUP, VERSION, DEPLOYMENT_PLURAL)
PERIOD_JITTER = 0.1


def wake(memo: kopf.Memo, namespace: str, name: str) -> None:
    event = memo.get("wakeups", {}).get((namespace, name))
    if event is not None:
        event.set()


def wake_all(memo: kopf.Memo, namespace: str | None) -> None:
    for (ns, _), event in list(memo.get("wakeups", {}).items()):
        if namespace is None or ns == namespace:
            event.set()


def _context(memo: kopf.Memo, logger: Any) -> Context:
    return Context(client=memo["client"], settings=memo["config"], logger=logger,
                   counted_jobs=memo["counted_jobs"], lists=memo.get("lists"),
                   scrapes=memo.setdefault("scrapes", {}))


def periodic_delay(interval_s: float) -> float:
    """The reconcile period with ±10 % jitter: deployments created together (or all resumed at an
    operator start) would otherwise re-reconcile in lockstep, every one at the same instant."""
    return interval_s * random.uniform(1 - PERIOD_JITTER, 1 + PERIOD_JITTER)


async def locked_reconcile(memo: kopf.Memo, body: Mapping[str, Any], logger: Any, trigger: str,
                           tune: bool = False) -> Outcome:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    lock = memo["locks"].setdefault(key, asyncio.Lock())
    async with lock:
        m.RECONCILES.labels(trigger).inc()
        with m.RECONCILE_SECONDS.time():
            try:
                return await reconcile(_context(memo, logger), body, tune=tune)
            except kube.ApiError:
                m.RECONCILE_ERRORS.labels("api").inc()
                raise
            except Exception:
                m.RECONCILE_ERRORS.labels("internal").inc()
                raise


@kopf.on.resume(*VXD)
@kopf.on.create(*VXD)
@kopf.on.update(*VXD)
async def reconcile_now(body: kopf.Body, memo: kopf.Memo, logger: Any, reason: Any, **_: Any) -> None:
    try:
        await locked_reconcile(memo, body, logger, str(reason))
    except kube.ApiError as exc:
        raise kopf.TemporaryError(f"API error, retrying: {exc}", delay=5) from exc


@dataclass
class GroupLoop:
    """One deployment's loop: the task, its stop signal and the latest body the watch delivered."""

    uid: str
    body: dict[str, Any]
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@kopf.on.event(*VXD)
async def track(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Start a deployment's loop when it is first seen, keep its body fresh, stop it when it is gone."""
    ns, name = body.metadata.namespace or "", body.metadata.name or ""
    loops: dict[tuple[str, str], GroupLoop] = memo.setdefault("loops", {})
    current = loops.get((ns, name))
    if event.get("type") == "DELETED" or (current is not None and current.uid != body.metadata.uid):
        if current is not None:
            await stop_loop(memo, (ns, name))
        if event.get("type") == "DELETED":
            forget(memo, ns, name)
            return
        current = None
    if current is None:
        current = loops[(ns, name)] = GroupLoop(uid=body.metadata.uid or "", body=dict(body))
        current.task = asyncio.create_task(group_loop(current, memo, logger), name=f"vxd {ns}/{name}")
    else:
        current.body = dict(body)  # read by the loop's next round; status writes do not wake it


async def stop_loop(memo: kopf.Memo, key: tuple[str, str], timeout: float = 5.0) -> None:
    loop = memo.get("loops", {}).pop(key, None)
    if loop is None or loop.task is None:
        return
    loop.stopped.set()
    wake(memo, *key)
    done, _ = await asyncio.wait([loop.task], timeout=timeout)
    if not done:
        loop.task.cancel()  # a reconcile stuck in I/O; the next owner of the key starts afresh


async def stop_all_loops(memo: kopf.Memo) -> None:
    await asyncio.gather(*(stop_loop(memo, key) for key in list(memo.get("loops", {}))))


def forget(memo: kopf.Memo, ns: str, name: str) -> None:
    """Children go with the owner (garbage collection); only in-memory state is dropped here."""
    m.DEPLOYMENT_PHASES.forget(ns, name)
    memo.get("scrapes", {}).pop((ns, name), None)


def _tuning_interval(body: Mapping[str, Any]) -> float:
    try:
        return float(body["spec"]["vexpert"]["tuningIntervalSeconds"])
    except (KeyError, TypeError, ValueError):
        return 60.0


async def group_loop(loop: GroupLoop, memo: kopf.Memo, logger: Any) -> None:
    body = loop.body
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    event = memo["wakeups"].setdefault((ns, name), asyncio.Event())
    stopped = loop.stopped
    settings = memo["config"]
    next_tune = time.monotonic() + _tuning_interval(body)
    timeout = periodic_delay(settings.reconcile_interval_s)
    try:
        while not stopped.is_set():
            waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())]
            try:
                await asyncio.wait(waiters, timeout=max(0.05, timeout), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            event.clear()
            if stopped.is_set():
                break
            body = loop.body
            timeout = periodic_delay(settings.reconcile_interval_s)
            if is_permanently_invalid(body):
                continue
            tune = time.monotonic() >= next_tune
            try:
                outcome = await locked_reconcile(memo, body, logger, "periodic", tune=tune)
            except Exception as exc:  # the next round retries
                logger.warning(f"reconcile failed, retrying in {settings.reconcile_interval_s}s: {exc}")
                continue
            if outcome.phase == "Deleted":
                break  # gone (no finalizer: the DELETED event may still be on its way)
            if tune:
                next_tune = time.monotonic() + _tuning_interval(body)
            timeout = min(timeout, max(0.0, next_tune - time.monotonic()))
            if outcome.wake_at is not None:
                timeout = min(timeout, max(0.05, (outcome.wake_at - utcnow()).total_seconds()))
    finally:
        if memo["wakeups"].get((ns, name)) is event:
            memo["wakeups"].pop((ns, name), None)
        memo["locks"].pop((ns, name), None)
        # again here: a reconcile still running when the deployment went sets the phase gauge back
        forget(memo, ns, name)
