"""VExpertDeployment handlers: reconcile on create/update/resume, and one daemon per deployment that
re-reconciles periodically (level-triggered), when woken by a pod/Job/profile event, and runs the
tuning loop every ``spec.vexpert.tuningIntervalSeconds``."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
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


@kopf.on.delete(*VXD, optional=True)
def forget(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the owner (garbage collection); only in-memory state is dropped here."""
    ns, name = body.metadata.namespace or "", body.metadata.name or ""
    m.DEPLOYMENT_PHASES.forget(ns, name)
    memo.get("scrapes", {}).pop((ns, name), None)
    wake(memo, ns, name)


def _tuning_interval(body: Mapping[str, Any]) -> float:
    try:
        return float(body["spec"]["vexpert"]["tuningIntervalSeconds"])
    except (KeyError, TypeError, ValueError):
        return 60.0


@kopf.daemon(*VXD, cancellation_timeout=5.0)
async def group_loop(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    ns, name = body.metadata.namespace or "", body.metadata.name or ""
    event = memo["wakeups"].setdefault((ns, name), asyncio.Event())
    settings = memo["config"]
    next_tune = time.monotonic() + _tuning_interval(body)
    timeout = periodic_delay(settings.reconcile_interval_s)
    try:
        while not stopped:
            waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())]
            try:
                await asyncio.wait(waiters, timeout=max(0.05, timeout), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            event.clear()
            if stopped:
                break
            timeout = periodic_delay(settings.reconcile_interval_s)
            if is_permanently_invalid(body):
                continue
            tune = time.monotonic() >= next_tune
            try:
                outcome = await locked_reconcile(memo, body, logger, "periodic", tune=tune)
            except Exception as exc:  # the next round retries; kopf would stop the daemon otherwise
                logger.warning(f"reconcile failed, retrying in {settings.reconcile_interval_s}s: {exc}")
                continue
            if tune:
                next_tune = time.monotonic() + _tuning_interval(body)
            timeout = min(timeout, max(0.0, next_tune - time.monotonic()))
            if outcome.wake_at is not None:
                timeout = min(timeout, max(0.05, (outcome.wake_at - utcnow()).total_seconds()))
    finally:
        memo["wakeups"].pop((ns, name), None)
        memo["locks"].pop((ns, name), None)
        memo.get("scrapes", {}).pop((ns, name), None)
        # again here: a reconcile still running while `forget` ran sets the phase gauge back;
        # the daemon ends after its last reconcile (kopf holds the finalizer until then)
        m.DEPLOYMENT_PHASES.forget(ns, name)
