"""A deletion wins over a reconcile in flight: children are written only for a live owner, and
what a reconcile wrote while its owner went away is taken back by that reconcile.

A reconcile reads its ``VExpertDeployment`` first, then makes a dozen API calls before it applies
the children. A ``DELETE`` of the deployment in between (issue 22: within ~1 s of a leader kill,
the in-flight reconcile re-created the StatefulSet or the PDB 0.3–0.8 s after the DELETE) must not
leave children behind. Garbage collection would remove a dependent whose owner is gone only
eventually, and not on every API server or emulator, so the operator does not rely on it:

1. before applying, the owner is read again: children are applied only while it exists with the
   uid the reconcile planned for and has no ``deletionTimestamp`` (``may_write_children``);
2. the children carry an ``ownerReference`` with that uid (``manifests.owner_reference``), so
   garbage collection also removes them with the owner;
3. after applying (when something was created or changed), the owner is read once more; if it went
   meanwhile, every child the reconcile wrote and that still belongs to that uid is deleted, with
   uid and resourceVersion preconditions so a child already taken over by a new deployment of the
   same name is left alone (``belongs_to``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from . import kube
from .context import Context

OwnerState = Literal["live", "deleting", "gone", "replaced"]
WITHDRAW_ATTEMPTS = 5


class OwnerGone(Exception):
    """Raised where a child would be created for an owner that is no longer live: the reconcile ends."""

    def __init__(self, state: OwnerState) -> None:
        super().__init__(f"the deployment is {state}")
        self.state = state


def owner_state(live: Mapping[str, Any] | None, uid: str) -> OwnerState:
    """The owner as the API has it now, against the uid the reconcile planned children for.
    ``uid`` empty (an object without one): any object of the name counts as the owner."""
    if live is None:
        return "gone"
    meta = live.get("metadata") or {}
    if uid and meta.get("uid") and meta["uid"] != uid:
        return "replaced"
    if meta.get("deletionTimestamp"):
        return "deleting"
    return "live"


def may_write_children(live: Mapping[str, Any] | None, uid: str) -> bool:
    return owner_state(live, uid) == "live"


def belongs_to(child: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether ``child`` exists and is the owner ``uid``'s (an ownerReference with that uid)."""
    if child is None or not uid:
        return False
    refs = (child.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(ref, Mapping) and ref.get("uid") == uid for ref in refs)


async def read_owner_state(ctx: Context, meta: Mapping[str, Any]) -> OwnerState:
    live = await ctx.client.get_or_none(kube.DEPLOYMENTS, meta["name"], meta["namespace"])
    return owner_state(live, meta.get("uid") or "")


async def withdraw(ctx: Context, res: kube.Resource, name: str, namespace: str, uid: str) -> bool:
    """Delete the child ``name`` if it still belongs to the owner ``uid``; True if it was deleted.
    Preconditions: the child's uid and resourceVersion as just read (a child re-applied for a new
    owner in between gives 409: read again and decide again)."""
    for _ in range(WITHDRAW_ATTEMPTS):
        live = await ctx.client.get_or_none(res, name, namespace)
        if not belongs_to(live, uid):
            return False
        assert live is not None
        meta = live["metadata"]
        try:
            return await ctx.client.delete(res, name, namespace, uid=meta.get("uid"),
                                           resource_version=meta.get("resourceVersion"))
        except kube.ApiError as exc:
            if not exc.conflict:
                raise
    return False


# The kinds of child a reconcile may have to take back (by kind, so the RBAC scan of the chart's
# tests sees every resource a withdrawal may delete).
CHILD_RESOURCES: dict[str, kube.Resource] = {
    "ConfigMap": kube.CONFIGMAPS,
    "Service": kube.SERVICES,
    "StatefulSet": kube.STATEFULSETS,
    "PodDisruptionBudget": kube.PDBS,
    "Job": kube.JOBS,
}


async def withdraw_if_owner_gone(ctx: Context, meta: Mapping[str, Any],
                                 written: Iterable[tuple[str, str]]) -> OwnerState:
    """After writing children, given as (kind, name): if the owner is no longer live, delete the
    ones written (that still belong to it). Returns the owner's state."""
    state = await read_owner_state(ctx, meta)
    if state != "live":
        uid = meta.get("uid") or ""
        for kind, name in written:
            if await withdraw(ctx, CHILD_RESOURCES[kind], name, meta["namespace"], uid):
                ctx.logger.info("withdrew %s %s: the deployment is %s", kind, name, state)
    return state
