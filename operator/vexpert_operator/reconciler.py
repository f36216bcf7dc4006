"""Reconcile one VExpertDeployment: the effectful glue between the API and the pure decisions.

Level-triggered and idempotent: every call reads the deployment, the nodes, the profiles, the
calibration Jobs and the node pods, decides with the pure functions, and writes only what differs.
Children have deterministic names, so a restarted operator adopts what it created earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from . import kube
from . import metrics as m
from . import naming as nm
from .api import (
    TuningStatus,
    VExpertDeploymentSpec,
    VExpertDeploymentStatus,
)
from .calibration import (
    format_time,
    parse_time,
)
from .calibrator import CalibrationOutcome, ensure_calibration
from .conditions import (
    Blocker,
    GroupObservation,
    claim_blockers,
    derive_group_conditions,
    failed_create_blockers,
    pod_blockers,
)
from .context import Context, list_cluster_wide
from .context import post_event as _event
from .group import GroupDecision, decide_group, nodes_being_drained, summarize_pod
from .manifests import (
    api_endpoint,
)
from .nodetypes import (
    NodeInfo,
    NodeType,
    candidate_types,
    choose_node_type,
    memory_requested_by_node,
    node_info,
)
from .ownership import OwnerGone, read_owner_state, withdraw_if_owner_gone
from .plan import GroupPlan, PlanInputs, combine_profiles, plan_group
from .status import get_condition, merge_patch_between, set_condition, status_patch
from .tuning import (
    MetricsError,
    RuntimeSample,
    TuningState,
    aggregate,
    decide_tuning,
    parse_runtime_metrics,
    serving_rates,
)
from .validation import Problem, format_problems, parse_spec, validate_spec

REASON_INVALID_SPEC = "InvalidSpec"
REASON_DOES_NOT_FIT = "DoesNotFitNodeType"
# The API server refused a child built from the spec (400/422): the same spec gets the same answer,
# so say so in the status instead of retrying silently.
REASON_REJECTED = "RejectedByApiServer"

KIND_TO_RES = {
    "ConfigMap": kube.CONFIGMAPS,
    "Service": kube.SERVICES,
    "StatefulSet": kube.STATEFULSETS,
    "PodDisruptionBudget": kube.PDBS,
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)



@dataclass
class Outcome:
    """What one reconcile saw, for the caller (the daemon decides when to come back)."""

    phase: str
    status: VExpertDeploymentStatus
    plan: GroupPlan | None = None
    spec: VExpertDeploymentSpec | None = None
    node_type: NodeType | None = None
    wake_at: dt.datetime | None = None



def read_status(body: Mapping[str, Any]) -> VExpertDeploymentStatus:
    raw = dict(body.get("status") or {})
    try:
        return VExpertDeploymentStatus.model_validate(raw)
    except ValidationError:
        known = {k: v for k, v in raw.items() if k in {f.alias for f in VExpertDeploymentStatus.model_fields.values()}}
        try:
            return VExpertDeploymentStatus.model_validate(known)
        except ValidationError:
            return VExpertDeploymentStatus()


async def write_status(ctx: Context, body: Mapping[str, Any], old: VExpertDeploymentStatus,
                       new: VExpertDeploymentStatus) -> None:
    meta = body["metadata"]
    m.DEPLOYMENT_PHASES.set(meta["namespace"], meta["name"], new.phase)
    patch = merge_patch_between(status_patch(old), status_patch(new))
    if not patch:
        return
    await ctx.client.patch(kube.DEPLOYMENTS, meta["name"], {"status": patch}, meta["namespace"],
                           subresource="status")


# --------------------------------------------------------------------------------------- reconcile


def _invalid(status: VExpertDeploymentStatus, problems: list[Problem], reason: str, now: str,
             generation: int | None) -> VExpertDeploymentStatus:
    message = format_problems(problems)
    new = status.model_copy(deep=True)
    new.phase = "Invalid"
    new.message = message
    new.observed_generation = generation
    new.conditions = set_condition(new.conditions, "Invalid", True, reason, message, now, generation)
    new.conditions = set_condition(new.conditions, "Ready", False, reason, "the spec is invalid", now, generation)
    new.conditions = set_condition(new.conditions, "Progressing", False, reason, "fix the spec", now, generation)
    return new


def _refused_by_api_server(exc: kube.ApiError) -> bool:
    return exc.status in (400, 422)


async def _rejected(ctx: Context, body: Mapping[str, Any], old: VExpertDeploymentStatus,
                    status: VExpertDeploymentStatus, what: str, exc: kube.ApiError, stamp: str,
                    generation: int | None) -> VExpertDeploymentStatus:
    """Invalid, with the server's own words (they name the child's field), one event per new message."""
    problem = Problem(what, f"the API server refused it ({exc.status} {exc.reason}): {exc.message}")
    new = _invalid(status, [problem], REASON_REJECTED, stamp, generation)
    if old.message != new.message:
        _event(ctx, body, "Warning", "Invalid", new.message)
    await write_status(ctx, body, old, new)
    return new


def is_permanently_invalid(body: Mapping[str, Any]) -> bool:
    """Invalid for this very generation: do nothing until the spec changes."""
    status = read_status(body)
    cond = get_condition(status, "Invalid")
    generation = (body.get("metadata") or {}).get("generation")
    return bool(cond and cond.status == "True" and cond.reason == REASON_INVALID_SPEC
                and cond.observed_generation == generation)


@dataclass(frozen=True)
class _Pass:
    """What one reconcile pass holds fixed: the fresh body, the status it started from, and its clock
    (every condition written in the pass carries the same stamp and generation)."""

    ctx: Context
    body: Mapping[str, Any]
    old: VExpertDeploymentStatus
    now: dt.datetime

    @property
    def meta(self) -> Mapping[str, Any]:
        meta: Mapping[str, Any] = self.body["metadata"]
        return meta

    @property
    def name(self) -> str:
        return str(self.meta["name"])

    @property
    def namespace(self) -> str:
        return str(self.meta["namespace"])

    @property
    def generation(self) -> int | None:
        generation: int | None = self.meta.get("generation")
        return generation

    @property
    def stamp(self) -> str:
        return format_time(self.now)

    def condition(self, status: VExpertDeploymentStatus, kind: str, value: bool | None, reason: str,
                  message: str) -> None:
        status.conditions = set_condition(status.conditions, kind, value, reason, message, self.stamp,
                                          self.generation)

    def event(self, kind: str, reason: str, message: str) -> None:
        _event(self.ctx, self.body, kind, reason, message)

    async def write(self, new: VExpertDeploymentStatus) -> None:
        await write_status(self.ctx, self.body, self.old, new)


async def reconcile(ctx: Context, body: Mapping[str, Any], *, tune: bool = False) -> Outcome:
    """One level-triggered pass: each step either hands the next one what it needs or ends the pass
    with the status it wrote (invalid spec, no node type, calibrating, does not fit, rejected, gone)."""
    fresh = await _read_fresh(ctx, body)
    if fresh is None:
        return Outcome("Deleted", VExpertDeploymentStatus())
    if fresh["metadata"].get("deletionTimestamp"):
        return Outcome("Deleted", read_status(fresh))
    run = _Pass(ctx, fresh, read_status(fresh), utcnow())

    spec = await _valid_spec(run)
    if isinstance(spec, Outcome):
        return spec
    status = _status_for_valid_spec(run, spec)
    nodes = await observe_nodes(ctx, run.namespace, run.name)
    placed = await _choose_node_type(run, spec, status, nodes)
    if isinstance(placed, Outcome):
        return placed
    candidates, chosen = placed
    cal = await _calibrate(run, spec, status, candidates, chosen)
    if isinstance(cal, Outcome):
        return cal
    planned = await _plan(run, spec, status, chosen, cal)
    if isinstance(planned, Outcome):
        return planned
    plan, inputs = planned

    sample: RuntimeSample | None = None
    if tune and run.old.phase in ("Running", "Degraded"):
        sample = await scrape_group(ctx, run.namespace, run.name, spec.runtime.http_port)
        plan = await _tune(ctx, run.body, spec, status, plan, inputs, sample, run.now)

    # Decide about the group before applying: a re-form first scales the StatefulSet to zero.
    raw_pods = await ctx.client.list(kube.PODS, run.namespace, labels=nm.node_selector_labels(run.name))
    decision = _decide_group(spec, status, plan, raw_pods, run.now)
    plan = _replan_for_draining(status, decision, inputs, plan, raw_pods, nodes)

    applied = await _apply_children(run, spec, status, plan, chosen)
    if applied is not None:
        return applied
    wake_at = await _apply_group_decision(ctx, run.body, status, decision, run.now)
    await _report_group(run, spec, status, plan, chosen, decision, sample, raw_pods)
    return Outcome(status.phase, status, plan=plan, spec=spec, node_type=chosen, wake_at=wake_at)


async def _read_fresh(ctx: Context, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The deployment as the API has it now, or None when it is gone (or replaced: another uid).

    Re-read: a daemon's or handler's body can lag behind the API (a stale spec would flip the
    template back; a stale status would forget group restarts). Writes are serialised per object."""
    meta = body["metadata"]
    fresh = await ctx.client.get_or_none(kube.DEPLOYMENTS, meta["name"], meta["namespace"])
    if fresh is None:
        return None
    fresh_uid, uid = fresh["metadata"].get("uid"), meta.get("uid")
    if fresh_uid and uid and fresh_uid != uid:
        return None
    return fresh


async def _valid_spec(run: _Pass) -> VExpertDeploymentSpec | Outcome:
    """The parsed spec, or the Invalid outcome (its event only when the status changes)."""
    spec, problems = parse_spec(run.body.get("spec") or {})
    if spec is not None:
        problems = validate_spec(spec, run.name)
    if spec is not None and not problems:
        return spec
    new = _invalid(run.old, problems, REASON_INVALID_SPEC, run.stamp, run.generation)
    if status_patch(new) != status_patch(run.old):
        run.event("Warning", "Invalid", new.message)
    await run.write(new)
    return Outcome("Invalid", new)


def _status_for_valid_spec(run: _Pass, spec: VExpertDeploymentSpec) -> VExpertDeploymentStatus:
    """The status this pass builds up, starting from the old one: this generation, valid."""
    status = run.old.model_copy(deep=True)
    status.observed_generation = run.generation
    status.nodes = spec.parallelism.num_nodes
    run.condition(status, "Invalid", False, "Valid", "")
    return status


async def _choose_node_type(run: _Pass, spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus,
                            nodes: list[NodeInfo]) -> tuple[dict[str, NodeType], NodeType] | Outcome:
    """The node types the spec may use and the one chosen (kept once chosen), or Pending when none."""
    candidates = candidate_types(nodes, spec.runtime.node_selector, spec.runtime.tolerations,
                                 spec.parallelism.gpus_per_node)
    chosen_name = choose_node_type(candidates, spec.parallelism.num_nodes, status.node_type)
    if chosen_name is not None:
        status.node_type = chosen_name
        return candidates, candidates[chosen_name]
    msg = (f"no schedulable GPU node with ≥ {spec.parallelism.gpus_per_node} GPUs matches "
           f"nodeSelector {spec.runtime.node_selector or '{}'} and the tolerations")
    status.phase, status.message = "Pending", msg
    run.condition(status, "Calibrated", None, "NoMatchingNodes", msg)
    run.condition(status, "Progressing", False, "NoMatchingNodes", msg)
    run.condition(status, "Ready", False, "NoMatchingNodes", msg)
    if run.old.phase != "Pending":
        run.event("Warning", "NoMatchingNodes", msg)
    await run.write(status)
    return Outcome("Pending", status, spec=spec)


async def _calibrate(run: _Pass, spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus,
                     candidates: Mapping[str, NodeType], chosen: NodeType) -> CalibrationOutcome | Outcome:
    """The calibrated profiles, or the pass ends: owner gone, Job refused, or still calibrating."""
    try:
        cal = await ensure_calibration(run.ctx, run.body, spec, candidates, chosen, run.now)
    except OwnerGone:
        return Outcome("Deleted", status)
    except kube.ApiError as exc:
        if not _refused_by_api_server(exc):
            raise
        new = await _rejected(run.ctx, run.body, run.old, status, "calibration Job", exc, run.stamp, run.generation)
        return Outcome("Invalid", new, spec=spec, node_type=chosen)
    status.calibration.node_types = cal.node_types
    status.calibration.model_profile = cal.model_profile
    status.calibration.model_state = cal.model_state
    status.calibration.model_message = cal.model_message
    run.condition(status, "Calibrated", cal.ready, cal.reason, cal.message)
    if cal.ready:
        return cal
    status.phase, status.message = "Calibrating", cal.message
    run.condition(status, "Progressing", True, cal.reason, "waiting for calibration")
    run.condition(status, "Ready", False, cal.reason, "waiting for calibration")
    await run.write(status)
    return Outcome("Calibrating", status, spec=spec, node_type=chosen, wake_at=cal.wake_at)


async def _plan(run: _Pass, spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus, chosen: NodeType,
                cal: CalibrationOutcome) -> tuple[GroupPlan, PlanInputs] | Outcome:
    """The group's plan at the current k and Np, or Invalid when the model does not fit the node type
    (its event once per new message)."""
    inputs = PlanInputs(name=run.name, namespace=run.namespace, spec=spec, uid=run.meta.get("uid", ""),
                        node_type=chosen, profile=combine_profiles(cal.hardware, cal.model, chosen.key),
                        allocation_interval=status.tuning.allocation_interval,
                        pooled_experts=status.tuning.pooled_experts, keep_cap=_kept_cap(run.old, run.generation))
    plan = plan_group(inputs)
    if not plan.problems:
        return plan, inputs
    new = _invalid(status, plan.problems, REASON_DOES_NOT_FIT, run.stamp, run.generation)
    was = get_condition(run.old, "Invalid")
    if was is None or was.status != "True" or run.old.message != new.message:
        run.event("Warning", "Invalid", new.message)
    await run.write(new)
    return Outcome("Invalid", new, spec=spec, node_type=chosen)


def _replan_for_draining(status: VExpertDeploymentStatus, decision: GroupDecision, inputs: PlanInputs,
                         plan: GroupPlan, raw_pods: list[dict[str, Any]], nodes: list[NodeInfo]) -> GroupPlan:
    """The plan again when draining changed (a re-form scales the StatefulSet to zero until every old
    rank is gone) or cordoned nodes run ranks (the PDB then lets one go)."""
    if decision.action == "reform":
        status.group.draining = True
    elif status.group.draining and not raw_pods:
        status.group.draining = False  # every old rank is gone: the group may start again
    drained = nodes_being_drained(raw_pods, (n.name for n in nodes if n.unschedulable))
    if status.group.draining == inputs.draining and drained == inputs.drained_nodes:
        return plan
    inputs.draining, inputs.drained_nodes = status.group.draining, drained
    return plan_group(inputs)


async def _apply_children(run: _Pass, spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus,
                          plan: GroupPlan, chosen: NodeType) -> Outcome | None:
    """Apply the plan's children; None when all are in place, else the outcome that ends the pass.

    A deletion wins over this reconcile (see ownership.py): no child for an owner that went since
    the first read, and what was written while it went is taken back."""
    ctx, meta = run.ctx, run.meta
    if await read_owner_state(ctx, meta) != "live":
        return Outcome("Deleted", status)
    written: list[tuple[str, str]] = []  # (kind, name)
    try:
        for child in plan.children:
            try:
                action, _ = await kube.apply(ctx.client, KIND_TO_RES[child["kind"]], child)
            except kube.ApiError as exc:
                if not _refused_by_api_server(exc):
                    raise
                what = f"{child['kind']} {child['metadata']['name']}"
                new = await _rejected(ctx, run.body, run.old, status, what, exc, run.stamp, run.generation)
                return Outcome("Invalid", new, plan=plan, spec=spec, node_type=chosen)
            if action != "unchanged":
                written.append((child["kind"], child["metadata"]["name"]))
                m.CHILD_WRITES.labels(child["kind"], action).inc()
                ctx.logger.info("%s %s %s", action, child["kind"], child["metadata"]["name"])
    except Exception:
        if written:  # failed half-way (the namespace going, say): still take back a gone owner's children
            with contextlib.suppress(Exception):
                await withdraw_if_owner_gone(ctx, meta, written)
        raise
    if written and await withdraw_if_owner_gone(ctx, meta, written) != "live":
        return Outcome("Deleted", status)
    return None


def _record_tuning(status: VExpertDeploymentStatus, plan: GroupPlan) -> None:
    """The k and Np the applied plan runs with."""
    status.tuning.allocation_interval = plan.allocation_interval
    status.tuning.pooled_experts = plan.pooled_experts
    status.tuning.pooled_experts_cap = plan.sizing.pooled_experts_cap
    if not status.tuning.reason:
        status.tuning.reason = "initial: k from the spec, Np as large as node memory allows"


async def _report_group(run: _Pass, spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus, plan: GroupPlan,
                        chosen: NodeType, decision: GroupDecision, sample: RuntimeSample | None,
                        raw_pods: list[dict[str, Any]]) -> None:
    """Endpoint, tuning and the group's conditions into the status; an event when it starts running
    or degrades. Blockers are looked up only when the group is short of ready ranks and waiting."""
    status.endpoint = api_endpoint(run.name, run.namespace, spec)
    _record_tuning(status, plan)
    usable = chosen.ready_nodes + len(chosen.cordoned)  # cordoned ones may already run group pods
    ready = status.ready_nodes == spec.parallelism.num_nodes
    waiting = not ready and decision.action == "none"
    seen = GroupObservation(
        nodes=spec.parallelism.num_nodes, ready_nodes=status.ready_nodes, action=decision.action,
        decision_reason=decision.reason, retry_at=format_time(decision.retry_at) if decision.retry_at else "",
        restarts=status.group.restarts,
        degraded_ranks=sample.degraded_pods if sample is not None else status.runtime.degraded_ranks,
        usable_nodes=usable, node_type=chosen.name,
        blockers=await observe_blockers(run.ctx, run.namespace, run.name, spec, raw_pods) if waiting else [])
    derive_group_conditions(status, seen, run.stamp, run.generation)
    if status.phase != run.old.phase and status.phase in ("Running", "Degraded"):
        run.event("Normal" if status.phase == "Running" else "Warning", status.phase, status.message)
    await run.write(status)


async def observe_nodes(ctx: Context, namespace: str, name: str) -> list[NodeInfo]:
    """Every node; for GPU nodes (the only ones a group can use) the memory that the pods bound to
    them request, the deployment's own pods left out (they are what is being sized). Pods are listed
    per GPU node with a ``spec.nodeName`` field selector: never every pod of the cluster."""
    infos = []
    for raw in await list_cluster_wide(ctx, kube.NODES):
        info = node_info(raw)
        if info.allocatable_gpus:
            pods = await ctx.client.list(kube.PODS, field_selector=f"spec.nodeName={info.name}")
            used = memory_requested_by_node(pods, nm.node_selector_labels(name), namespace)
            info = node_info(raw, used.get(info.name, 0))
        infos.append(info)
    return infos


def _kept_cap(old: VExpertDeploymentStatus, generation: int | None) -> int | None:
    """The Np_cap the group was sized with, kept while the spec is the same (a spec change re-sizes)."""
    if old.group.template_hash and old.observed_generation == generation:
        return old.tuning.pooled_experts_cap
    return None


async def observe_blockers(ctx: Context, namespace: str, name: str, spec: VExpertDeploymentSpec,
                          raw_pods: list[dict[str, Any]]) -> list[Blocker]:
    """Why node pods do not run, in the scheduler's, kubelet's and controllers' words."""
    blockers = pod_blockers(raw_pods)
    live = [p for p in raw_pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    if len(live) < spec.parallelism.num_nodes:
        sts = nm.statefulset_name(name)
        events = await ctx.client.list(kube.EVENTS, namespace, field_selector=f"involvedObject.name={sts}")
        blockers += failed_create_blockers(events, sts)
    claim = spec.model.checkpoint.claim_name
    if claim:
        blockers += claim_blockers(await ctx.client.get_or_none(kube.PVCS, claim, namespace), claim,
                                   spec.parallelism.num_nodes)
    return blockers


def _decide_group(spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus, plan: GroupPlan,
                  raw_pods: list[dict[str, Any]], now: dt.datetime) -> GroupDecision:
    pods = [summarize_pod(p) for p in raw_pods]
    status.group.template_hash = plan.template_hash
    decision = decide_group(pods, plan.template_hash, spec.parallelism.num_nodes, status.group, now,
                            spec.runtime.group_restart_backoff_seconds, spec.runtime.max_group_restart_backoff_seconds)
    status.ready_nodes = decision.ready_nodes
    return decision


async def _apply_group_decision(ctx: Context, body: Mapping[str, Any], status: VExpertDeploymentStatus,
                                decision: GroupDecision, now: dt.datetime) -> dt.datetime | None:
    meta = body["metadata"]
    ns = meta["namespace"]
    stamp = format_time(now)
    group = status.group
    wake_at: dt.datetime | None = None
    if decision.action == "reform":
        for pod in decision.delete:
            await ctx.client.delete(kube.PODS, pod, ns)
        group.members, group.formed_at = [], ""
        group.last_restart_reason = decision.reason
        if decision.is_failure:
            group.restarts += 1
            group.last_restart_time = stamp
            m.GROUP_REFORMS.labels("failure").inc()
            _event(ctx, body, "Warning", "GroupReformed", f"{decision.reason}; re-forming all "
                   f"{len(decision.delete)} ranks (restart {group.restarts})")
        else:
            m.GROUP_REFORMS.labels("rollout").inc()
            _event(ctx, body, "Normal", "GroupRolled", decision.reason)
        status.ready_nodes = 0
    elif decision.action == "backoff":
        wake_at = decision.retry_at
    else:
        if decision.formed and decision.members != group.members:
            group.members = decision.members
            group.formed_at = stamp
        formed_at = parse_time(group.formed_at)
        if decision.formed and group.restarts and formed_at and \
                (now - formed_at).total_seconds() >= ctx.settings.group_stable_s:
            group.restarts = 0
    return wake_at


# ------------------------------------------------------------------------------------------ tuning


async def _scrape_one(session: aiohttp.ClientSession, url: str, max_bytes: int) -> dict[str, float] | None:
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            # read(n) returns what has arrived so far: read to the end (or just past the limit),
            # a cut-off body would parse without complaint into missing or wrong values
            body = b""
            while len(body) <= max_bytes:
                chunk = await resp.content.read(max_bytes + 1 - len(body))
                if not chunk:
                    break
                body += chunk
            return parse_runtime_metrics(body, max_bytes)
    except (aiohttp.ClientError, asyncio.TimeoutError, MetricsError, OSError):
        return None


async def scrape_group(ctx: Context, namespace: str, name: str, port: int) -> RuntimeSample:
    """Read every ready node pod's runtime metrics (bounded size and time); serving counters become
    rates against the pod's previous scrape (kept in ``ctx.scrapes``)."""
    pods = [summarize_pod(p) for p in await ctx.client.list(kube.PODS, namespace, labels=nm.node_selector_labels(name))]
    targets = [p for p in pods if p.ready and p.pod_ip and not p.terminating]
    timeout = aiohttp.ClientTimeout(total=ctx.settings.scrape_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*[
            _scrape_one(session, f"http://{p.pod_ip}:{port}/metrics", ctx.settings.scrape_max_bytes) for p in targets
        ])
    scraped_at = time.monotonic()
    previous = ctx.scrapes.get((namespace, name), {})
    latest: dict[str, tuple[float, dict[str, float]]] = {}
    per_pod: list[dict[str, float]] = []
    for pod, values in zip(targets, results, strict=True):
        if values is None:
            continue
        before = previous.get(pod.uid)
        rates = serving_rates(values, before[1], scraped_at - before[0]) if before else {}
        per_pod.append(values | rates)
        latest[pod.uid] = (scraped_at, values)
    ctx.scrapes[(namespace, name)] = latest  # pods gone or unscraped drop out
    return aggregate(per_pod, unscraped=sum(1 for r in results if r is None))


def _round(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def _since(stamp: str, now: dt.datetime, interval_s: float) -> int:
    when = parse_time(stamp)
    if when is None:
        return 1_000
    return int((now - when).total_seconds() // max(interval_s, 1e-3))


async def _tune(ctx: Context, body: Mapping[str, Any], spec: VExpertDeploymentSpec, status: VExpertDeploymentStatus,
                plan: GroupPlan, inputs: PlanInputs, sample: RuntimeSample, now: dt.datetime) -> GroupPlan:
    stamp = format_time(now)
    interval = spec.vexpert.tuning_interval_seconds
    k_spec, np_spec = spec.vexpert.allocation_interval, spec.vexpert.pinned_experts
    state = TuningState(
        allocation_interval=plan.allocation_interval,
        pooled_experts=plan.pooled_experts,
        k_mode=k_spec.mode, k_min=k_spec.min, k_max=k_spec.max,
        np_mode=np_spec.mode, np_min=min(np_spec.min, plan.sizing.pooled_experts_cap),
        np_cap=plan.sizing.pooled_experts_cap,
        decisions_since_k_change=_since(status.tuning.last_k_change_time, now, interval),
        decisions_since_np_change=_since(status.tuning.last_np_change_time, now, interval),
    )
    decision = decide_tuning(state, sample)
    status.runtime.balance_ratio = round(sample.balance_ratio, 4) if sample.balance_ratio is not None else None
    served = sample.generated_tokens_per_second
    tokens = served if served is not None else sample.tokens_per_second
    status.runtime.tokens_per_second = round(tokens, 1) if tokens is not None else None
    status.runtime.inter_token_latency_seconds = _round(sample.inter_token_latency, 5)
    status.runtime.time_to_first_token_seconds = _round(sample.time_to_first_token, 4)
    status.runtime.requests_running = sample.requests_running
    status.runtime.requests_waiting = sample.requests_waiting
    status.runtime.allocator_share = round(sample.allocator_share, 4) if sample.allocator_share is not None else None
    status.runtime.degraded_ranks = sample.degraded_pods
    status.runtime.scraped_pods = sample.pods
    status.runtime.updated_at = stamp
    tuning: TuningStatus = status.tuning
    tuning.reason = decision.reason
    tuning.last_decision_time = stamp
    m.TUNING_DECISIONS.labels("k", "changed" if decision.k_changed else "held").inc()
    m.TUNING_DECISIONS.labels("np", "changed" if decision.np_changed else "held").inc()
    if not decision.changed:
        return plan
    if decision.k_changed:
        tuning.last_k_change_time = stamp
    if decision.np_changed:
        tuning.last_np_change_time = stamp
    tuning.changes += 1
    tuning.allocation_interval = decision.allocation_interval
    tuning.pooled_experts = decision.pooled_experts
    _event(ctx, body, "Normal", "Tuned", decision.reason)
    inputs.allocation_interval = decision.allocation_interval
    inputs.pooled_experts = decision.pooled_experts
    new_plan = plan_group(inputs)
    if new_plan.template_hash != plan.template_hash:  # pragma: no cover - tuning never touches the template
        raise RuntimeError("tuning changed the pod template")
    return new_plan

