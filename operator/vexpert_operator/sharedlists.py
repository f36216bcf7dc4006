"""Cluster-wide lists shared by the reconciles of one round (nodes, node profiles).

Every reconcile reads all nodes and all ``VExpertNodeProfile`` objects, and these are the same for
every deployment: with N deployments reconciling together (start-up, a profile written, periodic
rounds) that was N identical LISTs of every node in the cluster. Here concurrent callers share one
in-flight request, and a result is reused for ``ttl_s``. ``invalidate`` (called on every watch event
of a node profile, and after the operator writes one) makes the next caller fetch anew, and an
in-flight request that started before the invalidation is not joined: a reconcile woken by an event
always sees a list read after that event.

Callers get their own list of the shared objects: they must not modify the objects.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from . import kube


@dataclass
class _Entry:
    epoch: int
    started: float
    task: asyncio.Task[list[dict[str, Any]]]


class SharedLists:
    def __init__(self, client: kube.KubeClient, ttl_s: float) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._entries: dict[kube.Resource, _Entry] = {}
        self._epoch = 0
        self.requests = 0  # LISTs actually sent (for tests and benchmarks)

    def invalidate(self) -> None:
        """Forget every shared list (and do not join requests in flight now)."""
        self._epoch += 1

    async def list_all(self, res: kube.Resource) -> list[dict[str, Any]]:
        """All objects of a cluster-scoped resource (or of every namespace)."""
        epoch = self._epoch
        entry = self._entries.get(res)
        fresh = entry is not None and entry.epoch == epoch and (
            not entry.task.done() or time.monotonic() - entry.started < self.ttl_s)
        if entry is None or not fresh or (entry.task.done() and (entry.task.cancelled() or entry.task.exception())):
            self.requests += 1
            entry = _Entry(epoch, time.monotonic(), asyncio.ensure_future(self.client.list(res)))
            self._entries[res] = entry
        # shield: one caller being cancelled (a stopping daemon) must not cancel the others' request
        return list(await asyncio.shield(entry.task))
