"""The node group's life: rolls, failures and re-forming. Pure functions.

An EP group cannot survive a lost rank: every rank holds experts no other rank has, and NCCL
communicators do not shrink. So any failure — a container restart, a failed pod, a member pod
replaced — re-forms the whole group (all pods deleted at once; the StatefulSet recreates them with
the same ordinals), with a doubling backoff between failure-triggered re-forms. A template change
(new config, image or model) does the same without backoff: the StatefulSet uses ``OnDelete``, so no
rank is ever updated alone and a group is never half old, half new.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from . import naming as nm
from .api import GroupStatus
from .calibration import one_line, parse_time
from .manifests import CONTAINER


@dataclass(frozen=True)
class PodSummary:
    name: str
    uid: str
    template_hash: str
    phase: str
    ready: bool
    restarts: int
    terminating: bool
    pod_ip: str = ""
    reason: str = ""


def summarize_pod(pod: Mapping[str, Any]) -> PodSummary:
    meta = pod.get("metadata", {}) or {}
    status = pod.get("status", {}) or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    restarts = 0
    reason = status.get("reason", "") or ""
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != CONTAINER:
            continue
        try:
            restarts = max(0, int(cs.get("restartCount") or 0))
        except (TypeError, ValueError):
            restarts = 0
        last = (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated") or {}
        if isinstance(last, Mapping) and last:
            reason = f"{one_line(str(last.get('reason', 'Terminated')), 60)} (exit {one_line(str(last.get('exitCode')), 12)})"
            if last.get("message"):
                reason += f": {one_line(str(last['message']), 200)}"
    return PodSummary(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        template_hash=(meta.get("labels") or {}).get(nm.LABEL_TEMPLATE_HASH, ""),
        phase=status.get("phase", "Pending") or "Pending",
        ready=ready,
        restarts=restarts,
        terminating=bool(meta.get("deletionTimestamp")),
        pod_ip=status.get("podIP", "") or "",
        reason=one_line(str(reason), 300),
    )


@dataclass
class GroupDecision:
    action: Literal["none", "reform", "backoff"]
    reason: str = ""
    delete: list[str] = field(default_factory=list)
    is_failure: bool = False  # counts as a group restart (backoff applies)
    retry_at: dt.datetime | None = None
    ready_nodes: int = 0
    formed: bool = False
    members: list[str] = field(default_factory=list)


def restart_delay(restarts: int, base_s: float, cap_s: float) -> float:
    """Delay before the next failure-triggered re-form after ``restarts`` consecutive ones."""
    if restarts <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2 ** min(restarts - 1, 30)))


def decide_group(pods: Iterable[PodSummary], desired_hash: str, num_nodes: int, group: GroupStatus,
                 now: dt.datetime, base_s: float, cap_s: float) -> GroupDecision:
    live = [p for p in pods if not p.terminating]
    current = [p for p in live if p.template_hash == desired_hash]
    ready = [p for p in current if p.ready and p.phase == "Running"]
    stale = [p for p in live if p.template_hash != desired_hash]
    if stale:
        return GroupDecision(
            "reform",
            reason=f"rolling the group to template {desired_hash}: {len(stale)} of {len(live)} ranks are older",
            delete=sorted(p.name for p in live),
            ready_nodes=len(ready),
        )

    failed = [p for p in live if p.phase == "Failed" or p.restarts > 0]
    live_uids = {p.uid for p in live}
    lost = [uid for uid in group.members if uid not in live_uids]
    if failed or lost:
        if failed:
            first = sorted(failed, key=lambda p: p.name)[0]
            why = f"rank pod {first.name} failed ({first.reason or first.phase}, restarts {first.restarts})"
        else:
            why = f"{len(lost)} member pod(s) of the formed group are gone"
        last = parse_time(group.last_restart_time)
        delay = restart_delay(group.restarts, base_s, cap_s)
        if last is not None and now < last + dt.timedelta(seconds=delay):
            return GroupDecision("backoff", reason=why, retry_at=last + dt.timedelta(seconds=delay),
                                 ready_nodes=len(ready))
        return GroupDecision("reform", reason=why, delete=sorted(p.name for p in live), is_failure=True,
                             ready_nodes=len(ready))

    formed = len(ready) == num_nodes and len(live) == num_nodes
    return GroupDecision("none", ready_nodes=len(ready), formed=formed,
                         members=sorted(p.uid for p in ready) if formed else [])


def nodes_being_drained(pods: Iterable[Mapping[str, Any]], cordoned: Iterable[str]) -> tuple[str, ...]:
    """The cordoned nodes (``spec.unschedulable``, the first step of ``kubectl drain`` and of every
    node upgrade tool) that run one of the group's pods: an administrator is taking them down, so
    the group's disruption budget lets one rank be evicted (``manifests.build_pdb``)."""
    cordoned = set(cordoned)
    on = {(p.get("spec") or {}).get("nodeName") for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")}
    return tuple(sorted(cordoned & {n for n in on if n}))
