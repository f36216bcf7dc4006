"""The group's conditions (Ready, Progressing, Degraded), phase and message, derived in one place
from what was observed. Pure functions.

Why pods stay Pending is said in the scheduler's or kubelet's own words: a pod's ``PodScheduled``
condition (``Unschedulable`` with the scheduler's message), a container waiting on its image
(``ErrImagePull``, ``ImagePullBackOff``) or its configuration, the StatefulSet controller's
``FailedCreate`` events (admission, quota), and a checkpoint claim that cannot attach to every node
of the group (``ReadWriteOnce``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .api import VExpertDeploymentStatus
from .calibration import one_line
from .status import set_condition

# container waiting reasons that keep a pod from ever running without a change
WAITING_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                   "CreateContainerError", "CrashLoopBackOff", "RunContainerError")
SHAREABLE_MODES = ("ReadOnlyMany", "ReadWriteMany")


@dataclass(frozen=True)
class Blocker:
    """Why the group cannot (yet) run: a reason in CamelCase and a one-line message."""

    reason: str
    message: str


def pod_blockers(pods: Iterable[Mapping[str, Any]]) -> list[Blocker]:
    """The scheduler's and kubelet's reasons for the node pods that do not run."""
    out: list[Blocker] = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "")
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                out.append(Blocker(cond.get("reason") or "Unschedulable",
                                   one_line(f"pod {name}: {cond.get('message') or 'not scheduled'}")))
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in WAITING_REASONS:
                out.append(Blocker(waiting["reason"], one_line(
                    f"pod {name} container {cs.get('name', '')}: {waiting.get('message') or waiting['reason']}")))
    return out


def failed_create_blockers(events: Iterable[Mapping[str, Any]], statefulset: str) -> list[Blocker]:
    """The StatefulSet controller's latest ``FailedCreate`` (e.g. Pod Security or quota refused a pod)."""
    mine = [e for e in events if e.get("reason") == "FailedCreate"
            and (e.get("involvedObject") or {}).get("name") == statefulset]
    if not mine:
        return []
    latest = max(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [Blocker("FailedCreate", one_line(f"StatefulSet {statefulset}: {latest.get('message', '')}"))]


def claim_blockers(claim: Mapping[str, Any] | None, claim_name: str, nodes: int) -> list[Blocker]:
    """A checkpoint claim one node at a time can mount stops every pod but one from starting."""
    if claim is None or nodes <= 1:
        return []
    modes = (claim.get("spec") or {}).get("accessModes") or []
    if any(m in SHAREABLE_MODES for m in modes):
        return []
    return [Blocker("ClaimNotShareable", (
        f"PersistentVolumeClaim {claim_name} has accessModes {modes}: it attaches to one node, the group needs "
        f"{nodes}; use a ReadOnlyMany claim for the checkpoint"))]


@dataclass(frozen=True)
class GroupObservation:
    """What the conditions are derived from."""

    nodes: int
    ready_nodes: int
    action: str = "none"  # the group decision (group.GroupDecision): none, reform, backoff
    decision_reason: str = ""
    retry_at: str = ""  # backoff: when the group re-forms
    restarts: int = 0
    degraded_ranks: int = 0
    usable_nodes: int | None = None  # nodes of the pinned type a pod can start on (None: enough)
    node_type: str = ""
    blockers: Sequence[Blocker] = ()


def derive_group_conditions(status: VExpertDeploymentStatus, seen: GroupObservation, stamp: str,
                            generation: int | None) -> None:
    """Set Ready, Progressing, Degraded, phase and message of ``status`` from ``seen``."""
    ready = seen.ready_nodes == seen.nodes and seen.nodes > 0
    counted = f"{seen.ready_nodes}/{seen.nodes} node pods ready"
    degraded: tuple[bool, str, str] = (False, "AsExpected", "")
    if seen.action == "backoff":
        degraded = (True, "GroupRestartBackoff", f"{seen.decision_reason}; re-forming at {seen.retry_at or 'soon'} "
                                                 f"(restart {seen.restarts + 1})")
    elif seen.action != "reform" and seen.degraded_ranks > 0:
        degraded = (True, "RuntimeDegraded", f"{seen.degraded_ranks} node pod(s) report degraded")
    status.conditions = set_condition(status.conditions, "Degraded", degraded[0], degraded[1], degraded[2], stamp,
                                      generation)

    progress_reason, message = ("Deployed", counted) if ready else ("Deploying", counted)
    if not ready and seen.blockers:
        first = seen.blockers[0]
        progress_reason = first.reason
        message = f"{counted}; " + "; ".join(b.message for b in seen.blockers[:3])
    elif not ready and seen.usable_nodes is not None and seen.usable_nodes < seen.nodes:
        progress_reason = "NotEnoughNodes"
        message = (f"node type {seen.node_type} has {seen.usable_nodes} Ready schedulable node(s), the group needs "
                   f"{seen.nodes}: its pods wait for nodes")
    ready_reason = "GroupReady" if ready else (progress_reason if progress_reason != "Deploying" else "NodesNotReady")
    status.conditions = set_condition(status.conditions, "Ready", ready, ready_reason,
                                      counted if ready or progress_reason == "Deploying" else message, stamp,
                                      generation)
    status.conditions = set_condition(status.conditions, "Progressing", not ready, progress_reason, message, stamp,
                                      generation)
    if degraded[0]:
        status.phase, status.message = "Degraded", degraded[2]
    elif ready:
        status.phase, status.message = "Running", f"{seen.nodes} node pods ready"
    else:
        status.phase, status.message = "Deploying", message
