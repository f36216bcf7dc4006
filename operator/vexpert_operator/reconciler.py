"""Reconcile one VExpertDeployment: the effectful glue between the API and the pure decisions.

Level-triggered and idempotent: every call reads the deployment, the nodes, the profiles, the
calibration Jobs and the node pods, decides with the pure functions, and writes only what differs.
Children have deterministic names, so a restarted operator adopts what it created earlier.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from pydantic import ValidationError

from vexpert_runtime.policy.profile import PerformanceProfile

from . import kube
from . import metrics as m
from . import naming as nm
from .api import (
    NodeTypeCalibration,
    TuningStatus,
    VExpertDeploymentSpec,
    VExpertDeploymentStatus,
    VExpertModelProfileSpec,
    VExpertNodeProfileSpec,
)
from .calibration import (
    CalibrationStep,
    JobSummary,
    decide_calibration,
    failure_reason,
    format_time,
    one_line,
    parse_result,
    parse_time,
    stale_attempts,
    summarize_job,
    termination_message,
)
from .group import GroupDecision, decide_group, nodes_being_drained, summarize_pod
from .manifests import (
    api_endpoint,
    build_hardware_calibration_job,
    build_model_calibration_job,
    build_model_profile,
    build_node_profile,
    model_fit_inputs,
    owner_reference,
)
from .nodetypes import NodeType, candidate_types, choose_node_type, node_info
from .plan import GroupPlan, PlanInputs, combine_profiles, plan_group
from .settings import OperatorSettings
from .sharedlists import SharedLists
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
class Context:
    client: kube.KubeClient
    settings: OperatorSettings
    logger: logging.Logger | logging.LoggerAdapter = field(default_factory=lambda: logging.getLogger("vexpert"))
    post_events: bool = True
    counted_jobs: set[str] = field(default_factory=set)
    lists: SharedLists | None = None  # nodes and node profiles shared by concurrent reconciles
    # the last scrape of each node pod, per deployment: (namespace, name) → pod UID → (monotonic s, metrics);
    # serving counters become rates against it
    scrapes: dict[tuple[str, str], dict[str, tuple[float, dict[str, float]]]] = field(default_factory=dict)


async def list_cluster_wide(ctx: Context, res: kube.Resource) -> list[dict[str, Any]]:
    """Every object of a cluster-wide resource; shared with the other reconciles of this round."""
    if ctx.lists is not None:
        return await ctx.lists.list_all(res)
    return await ctx.client.list(res)


@dataclass
class Outcome:
    """What one reconcile saw, for the caller (the daemon decides when to come back)."""

    phase: str
    status: VExpertDeploymentStatus
    plan: GroupPlan | None = None
    spec: VExpertDeploymentSpec | None = None
    node_type: NodeType | None = None
    wake_at: dt.datetime | None = None


def _event(ctx: Context, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    if not ctx.post_events:
        return
    try:
        obj = body if isinstance(body, kopf.Body) else kopf.Body(dict(body))  # type: ignore[arg-type]
        kopf.event(obj, type=type_, reason=reason, message=one_line(message, 1000))
    except Exception:  # events are auxiliary; outside kopf's context there is no poster
        ctx.logger.debug("could not post event %s: %s", reason, message)


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


# ------------------------------------------------------------------------------------ calibration


@dataclass
class CalibrationOutcome:
    ready: bool
    hardware: PerformanceProfile | None = None
    model: PerformanceProfile | None = None
    reason: str = ""
    message: str = ""
    wake_at: dt.datetime | None = None
    node_types: list[NodeTypeCalibration] = field(default_factory=list)
    model_profile: str = ""
    model_state: str = ""
    model_message: str = ""


def _profile_of(obj: Mapping[str, Any] | None, model: type[VExpertNodeProfileSpec] | type[VExpertModelProfileSpec]
                ) -> PerformanceProfile | None:
    if obj is None:
        return None
    try:
        return model.model_validate(obj.get("spec") or {}).profile
    except ValidationError:
        return None


async def _job_pod(ctx: Context, namespace: str, job: str) -> dict[str, Any] | None:
    for label in ("batch.kubernetes.io/job-name", "job-name"):
        pods = await ctx.client.list(kube.PODS, namespace, labels={label: job})
        if pods:
            return sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp", ""))[-1]
    return None


async def _harvest(ctx: Context, namespace: str, job: str) -> PerformanceProfile | str:
    """The profile a succeeded Job wrote, or the reason it is unusable (the Job is marked failed)."""
    pod = await _job_pod(ctx, namespace, job)
    if pod is None:
        reason = "its pod is gone, so its termination message cannot be read"
    else:
        _, message = termination_message(pod)
        try:
            return parse_result(message)
        except ValueError as exc:
            reason = str(exc)
    await ctx.client.patch(kube.JOBS, job, {"metadata": {"annotations": {nm.ANNOTATION_HARVEST_ERROR: reason}}},
                           namespace)
    m.CALIBRATION_JOBS.labels("unknown", "invalid-result").inc()
    return reason


def _note_failure(ctx: Context, body: Mapping[str, Any], kind: str, job: str, message: str) -> None:
    """Count and announce a failed attempt once per operator run."""
    if job in ctx.counted_jobs:
        return
    ctx.counted_jobs.add(job)
    m.CALIBRATION_JOBS.labels(kind, "failed").inc()
    _event(ctx, body, "Warning", f"{kind.capitalize()}CalibrationFailed", message)


async def _step_message(ctx: Context, namespace: str, step: CalibrationStep, jobs: list[JobSummary]) -> str:
    if step.action == "backoff":
        latest = max(jobs, key=lambda j: j.attempt)
        pod = await _job_pod(ctx, namespace, latest.name)
        why = failure_reason(pod, latest)
        when = format_time(step.retry_at) if step.retry_at else "soon"
        return f"attempt {step.attempt} ({step.job}) failed: {why}; retry at {when}"
    return step.message


async def _prune_attempts(ctx: Context, namespace: str, jobs: list[JobSummary]) -> list[JobSummary]:
    """Delete failed calibration Jobs beyond the last few; returns the Jobs that remain."""
    stale = set(stale_attempts(jobs))
    for name in stale:
        await ctx.client.delete(kube.JOBS, name, namespace)
    return [j for j in jobs if j.name not in stale]


async def ensure_calibration(ctx: Context, body: Mapping[str, Any], spec: VExpertDeploymentSpec,
                             candidates: Mapping[str, NodeType], chosen: NodeType, now: dt.datetime
                             ) -> CalibrationOutcome:
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta.get("uid", "")
    owner = owner_reference(name, uid)
    calib = spec.calibration
    out = CalibrationOutcome(ready=True)
    wake: list[dt.datetime] = []

    # Hardware: every candidate type gets a profile (auto); the group waits for its own type only.
    profiles = {p["metadata"]["name"]: p for p in await list_cluster_wide(ctx, kube.NODE_PROFILES)}
    hw_jobs: dict[str, list[JobSummary]] = {}
    if calib.mode == "auto":
        for job in await ctx.client.list(kube.JOBS, ns, labels={nm.LABEL_CALIBRATION: "hardware"}):
            type_name = (job["metadata"].get("labels") or {}).get(nm.LABEL_NODE_TYPE, "")
            hw_jobs.setdefault(type_name, []).append(summarize_job(job))
    chosen_message = ""
    for type_name, node_type in candidates.items():
        if type_name in profiles:
            out.node_types.append(NodeTypeCalibration(name=type_name, state="Profiled"))
            continue
        if calib.mode != "auto":
            continue
        jobs = await _prune_attempts(ctx, ns, hw_jobs.get(type_name, []))
        step = decide_calibration(jobs, now, calib.retry_backoff_seconds, calib.max_retry_backoff_seconds)
        entry = NodeTypeCalibration(name=type_name, state="Running", attempts=step.attempt, job=step.job)
        if step.action == "create":
            job = build_hardware_calibration_job(ns, type_name, node_type.key, step.attempt, spec, owner)
            try:
                await ctx.client.create(kube.JOBS, job)
                m.CALIBRATION_JOBS.labels("hardware", "started").inc()
                _event(ctx, body, "Normal", "HardwareCalibrationStarted",
                       f"Job {job['metadata']['name']} calibrates node type {type_name} (attempt {step.attempt})")
            except kube.ApiError as exc:
                if not exc.conflict:
                    raise
            entry.job = job["metadata"]["name"]
            entry.message = f"attempt {step.attempt} started"
        elif step.action == "harvest":
            result = await _harvest(ctx, ns, step.job)
            if isinstance(result, PerformanceProfile):
                if result.provenance.node_type is None:
                    result.provenance.node_type = node_type.key
                profile_obj = build_node_profile(type_name, node_type.key, result, node_type.min_allocatable_memory,
                                                 step.job, ns)
                try:
                    profiles[type_name] = await ctx.client.create(kube.NODE_PROFILES, profile_obj)
                    if ctx.lists is not None:
                        ctx.lists.invalidate()
                    m.CALIBRATION_JOBS.labels("hardware", "succeeded").inc()
                    _event(ctx, body, "Normal", "NodeTypeProfiled",
                           f"VExpertNodeProfile {type_name} written from Job {step.job}")
                except kube.ApiError as exc:
                    if not exc.conflict:
                        raise
                    profiles[type_name] = await ctx.client.get(kube.NODE_PROFILES, type_name)
                entry = NodeTypeCalibration(name=type_name, state="Profiled", attempts=step.attempt, job=step.job)
            else:
                entry.state, entry.message = "Failed", f"attempt {step.attempt} ({step.job}): {result}"
                wake.append(now)
                _note_failure(ctx, body, "hardware", step.job, f"node type {type_name}: {entry.message}")
        elif step.action == "backoff":
            entry.state = "Failed"
            entry.message = await _step_message(ctx, ns, step, jobs)
            _note_failure(ctx, body, "hardware", step.job, f"node type {type_name}: {entry.message}")
            if step.retry_at:
                wake.append(step.retry_at)
        else:
            entry.message = step.message
        out.node_types.append(entry)
        if type_name == chosen.name:
            chosen_message = entry.message

    chosen_profile = _profile_of(profiles.get(chosen.name), VExpertNodeProfileSpec)
    if chosen_profile is not None:
        out.hardware = chosen_profile
    elif calib.mode == "auto":
        state = next((e for e in out.node_types if e.name == chosen.name), None)
        out.ready = False
        out.reason = "HardwareCalibrationFailed" if state and state.state == "Failed" else "HardwareCalibrating"
        out.message = f"node type {chosen.name}: {chosen_message or 'calibrating'}"
    elif calib.mode == "given" and calib.profile is not None:
        out.hardware = calib.profile
    # skip / given without a node profile: the paper's defaults (combine_profiles fills them in)

    # Model: one profile per model revision and fit inputs (traces, EP size, vmax), in the namespace.
    key = nm.model_key(spec.model.name, spec.model.revision, model_fit_inputs(spec))
    if calib.mode == "given":
        if calib.model_profile_ref:
            obj = await ctx.client.get_or_none(kube.MODEL_PROFILES, calib.model_profile_ref, ns)
            out.model = _profile_of(obj, VExpertModelProfileSpec)
            out.model_profile = calib.model_profile_ref
            if out.model is None:
                out.model_state = "Missing"
                out.model_message = f"VExpertModelProfile {calib.model_profile_ref} not found or invalid"
                if out.ready:
                    out.ready, out.reason, out.message = False, "ModelProfileMissing", out.model_message
            else:
                out.model_state = "Profiled"
        else:
            out.model = calib.profile
            out.model_state = "Given"
    else:
        obj = await ctx.client.get_or_none(kube.MODEL_PROFILES, key, ns)
        out.model = _profile_of(obj, VExpertModelProfileSpec)
        out.model_profile = key if obj is not None else ""
        out.model_state = "Profiled" if out.model is not None else "Default"
        if out.model is None and calib.mode == "auto":
            if calib.traces:
                await _model_calibration(ctx, body, spec, key, owner, now, out, wake)
            else:
                out.model_message = "no spec.calibration.traces to fit on: the paper's load-balance coefficients"
    if out.ready:
        out.reason = "Skipped" if calib.mode == "skip" else ("Given" if calib.mode == "given" else "Profiled")
        out.message = f"hardware: {'profile ' + chosen.name if out.hardware else 'paper defaults'}; model: " \
                      f"{out.model_profile or ('inline profile' if out.model else 'paper defaults')}"
    out.wake_at = min(wake) if wake else None
    return out


async def _model_calibration(ctx: Context, body: Mapping[str, Any], spec: VExpertDeploymentSpec, key: str,
                             owner: list[dict[str, Any]], now: dt.datetime, out: CalibrationOutcome,
                             wake: list[dt.datetime]) -> None:
    ns = body["metadata"]["namespace"]
    calib = spec.calibration
    jobs = [summarize_job(j) for j in
            await ctx.client.list(kube.JOBS, ns, labels={nm.LABEL_CALIBRATION: "model", nm.LABEL_MODEL_KEY: key})]
    jobs = await _prune_attempts(ctx, ns, jobs)
    step = decide_calibration(jobs, now, calib.retry_backoff_seconds, calib.max_retry_backoff_seconds)
    out.model_profile = key
    out.model_state = "Running"
    if step.action == "create":
        job = build_model_calibration_job(ns, key, step.attempt, spec, owner)
        try:
            await ctx.client.create(kube.JOBS, job)
            m.CALIBRATION_JOBS.labels("model", "started").inc()
            _event(ctx, body, "Normal", "ModelCalibrationStarted",
                   f"Job {job['metadata']['name']} calibrates {spec.model.name}@{spec.model.revision} "
                   f"(attempt {step.attempt})")
        except kube.ApiError as exc:
            if not exc.conflict:
                raise
        out.model_message = f"attempt {step.attempt} started"
    elif step.action == "harvest":
        result = await _harvest(ctx, ns, step.job)
        if isinstance(result, PerformanceProfile):
            if not result.provenance.model:
                result.provenance.model = spec.model.name
                result.provenance.model_revision = spec.model.revision
            obj = build_model_profile(ns, key, spec.model.name, spec.model.revision, spec.model.architecture, result,
                                      step.job)
            try:
                await ctx.client.create(kube.MODEL_PROFILES, obj)
                m.CALIBRATION_JOBS.labels("model", "succeeded").inc()
                _event(ctx, body, "Normal", "ModelProfiled", f"VExpertModelProfile {key} written from Job {step.job}")
            except kube.ApiError as exc:
                if not exc.conflict:
                    raise
            out.model, out.model_state, out.model_message = result, "Profiled", ""
            return
        out.model_state, out.model_message = "Failed", f"attempt {step.attempt} ({step.job}): {result}"
        wake.append(now)
        _note_failure(ctx, body, "model", step.job, out.model_message)
    elif step.action == "backoff":
        out.model_state = "Failed"
        out.model_message = await _step_message(ctx, ns, step, jobs)
        _note_failure(ctx, body, "model", step.job, out.model_message)
        if step.retry_at:
            wake.append(step.retry_at)
    else:
        out.model_message = step.message
    if out.ready:
        out.ready = False
        out.reason = "ModelCalibrationFailed" if out.model_state == "Failed" else "ModelCalibrating"
        out.message = f"model {spec.model.name}@{spec.model.revision}: {out.model_message}"


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


async def reconcile(ctx: Context, body: Mapping[str, Any], *, tune: bool = False) -> Outcome:
    # Re-read: a daemon's or handler's body can lag behind the API (a stale spec would flip the
    # template back; a stale status would forget group restarts). Writes are serialised per object.
    fresh = await ctx.client.get_or_none(kube.DEPLOYMENTS, body["metadata"]["name"], body["metadata"]["namespace"])
    if fresh is None or (fresh["metadata"].get("uid") and body["metadata"].get("uid")
                         and fresh["metadata"]["uid"] != body["metadata"]["uid"]):
        return Outcome("Deleted", VExpertDeploymentStatus())
    body = fresh
    meta = body["metadata"]
    name, ns, generation = meta["name"], meta["namespace"], meta.get("generation")
    if meta.get("deletionTimestamp"):
        return Outcome("Deleted", read_status(body))
    now = utcnow()
    stamp = format_time(now)
    old = read_status(body)

    spec, problems = parse_spec(body.get("spec") or {})
    if spec is not None:
        problems = validate_spec(spec, name)
    if problems or spec is None:
        new = _invalid(old, problems, REASON_INVALID_SPEC, stamp, generation)
        if status_patch(new) != status_patch(old):
            _event(ctx, body, "Warning", "Invalid", new.message)
        await write_status(ctx, body, old, new)
        return Outcome("Invalid", new)

    status = old.model_copy(deep=True)
    status.observed_generation = generation
    status.nodes = spec.parallelism.num_nodes
    status.conditions = set_condition(status.conditions, "Invalid", False, "Valid", "", stamp, generation)

    nodes = [node_info(n) for n in await list_cluster_wide(ctx, kube.NODES)]
    candidates = candidate_types(nodes, spec.runtime.node_selector, spec.runtime.tolerations,
                                 spec.parallelism.gpus_per_node)
    chosen_name = choose_node_type(candidates, spec.parallelism.num_nodes, status.node_type)
    if chosen_name is None:
        msg = (f"no schedulable GPU node with ≥ {spec.parallelism.gpus_per_node} GPUs matches "
               f"nodeSelector {spec.runtime.node_selector or '{}'} and the tolerations")
        status.phase, status.message = "Pending", msg
        status.conditions = set_condition(status.conditions, "Calibrated", None, "NoMatchingNodes", msg, stamp,
                                          generation)
        status.conditions = set_condition(status.conditions, "Progressing", False, "NoMatchingNodes", msg, stamp,
                                          generation)
        status.conditions = set_condition(status.conditions, "Ready", False, "NoMatchingNodes", msg, stamp, generation)
        if status.phase != old.phase:
            _event(ctx, body, "Warning", "NoMatchingNodes", msg)
        await write_status(ctx, body, old, status)
        return Outcome("Pending", status, spec=spec)
    chosen = candidates[chosen_name]
    status.node_type = chosen_name

    try:
        cal = await ensure_calibration(ctx, body, spec, candidates, chosen, now)
    except kube.ApiError as exc:
        if not _refused_by_api_server(exc):
            raise
        new = await _rejected(ctx, body, old, status, "calibration Job", exc, stamp, generation)
        return Outcome("Invalid", new, spec=spec, node_type=chosen)
    status.calibration.node_types = cal.node_types
    status.calibration.model_profile = cal.model_profile
    status.calibration.model_state = cal.model_state
    status.calibration.model_message = cal.model_message
    status.conditions = set_condition(status.conditions, "Calibrated", cal.ready, cal.reason, cal.message, stamp,
                                      generation)
    if not cal.ready:
        status.phase, status.message = "Calibrating", cal.message
        status.conditions = set_condition(status.conditions, "Progressing", True, cal.reason,
                                          "waiting for calibration", stamp, generation)
        status.conditions = set_condition(status.conditions, "Ready", False, cal.reason,
                                          "waiting for calibration", stamp, generation)
        await write_status(ctx, body, old, status)
        return Outcome("Calibrating", status, spec=spec, node_type=chosen, wake_at=cal.wake_at)

    profile = combine_profiles(cal.hardware, cal.model, chosen.key) if (cal.hardware or cal.model) \
        else combine_profiles(None, None, chosen.key)
    inputs = PlanInputs(name=name, namespace=ns, spec=spec, uid=meta.get("uid", ""), node_type=chosen,
                        profile=profile, allocation_interval=status.tuning.allocation_interval,
                        pooled_experts=status.tuning.pooled_experts)
    plan = plan_group(inputs)
    if plan.problems:
        new = _invalid(status, plan.problems, REASON_DOES_NOT_FIT, stamp, generation)
        was = get_condition(old, "Invalid")
        if was is None or was.status != "True" or old.message != new.message:
            _event(ctx, body, "Warning", "Invalid", new.message)
        await write_status(ctx, body, old, new)
        return Outcome("Invalid", new, spec=spec, node_type=chosen)

    sample: RuntimeSample | None = None
    if tune and old.phase in ("Running", "Degraded"):
        sample = await scrape_group(ctx, ns, name, spec.runtime.http_port)
        plan = await _tune(ctx, body, spec, status, plan, inputs, sample, now)

    # Decide about the group before applying: a re-form first scales the StatefulSet to zero.
    raw_pods = await ctx.client.list(kube.PODS, ns, labels=nm.node_selector_labels(name))
    decision = _decide_group(spec, status, plan, raw_pods, now)
    if decision.action == "reform":
        status.group.draining = True
    elif status.group.draining and not raw_pods:
        status.group.draining = False  # every old rank is gone: the group may start again
    drained = nodes_being_drained(raw_pods, (n.name for n in nodes if n.unschedulable))
    if status.group.draining != inputs.draining or drained != inputs.drained_nodes:
        inputs.draining, inputs.drained_nodes = status.group.draining, drained
        plan = plan_group(inputs)

    for child in plan.children:
        try:
            action, _ = await kube.apply(ctx.client, KIND_TO_RES[child["kind"]], child)
        except kube.ApiError as exc:
            if not _refused_by_api_server(exc):
                raise
            what = f"{child['kind']} {child['metadata']['name']}"
            new = await _rejected(ctx, body, old, status, what, exc, stamp, generation)
            return Outcome("Invalid", new, plan=plan, spec=spec, node_type=chosen)
        if action != "unchanged":
            m.CHILD_WRITES.labels(child["kind"], action).inc()
            ctx.logger.info("%s %s %s", action, child["kind"], child["metadata"]["name"])

    wake_at = await _apply_group_decision(ctx, body, status, decision, now)
    status.endpoint = api_endpoint(name, ns, spec)

    status.tuning.allocation_interval = plan.allocation_interval
    status.tuning.pooled_experts = plan.pooled_experts
    status.tuning.pooled_experts_cap = plan.sizing.pooled_experts_cap
    if not status.tuning.reason:
        status.tuning.reason = "initial: k from the spec, Np as large as node memory allows"
    _phase(status, sample, stamp, generation)
    usable = chosen.ready_nodes + len(chosen.cordoned)  # cordoned ones may already run group pods
    if status.phase == "Deploying" and usable < spec.parallelism.num_nodes:
        # say why pods stay Pending instead of only counting them
        status.message = (f"node type {chosen.name} has {chosen.ready_nodes} Ready schedulable node(s), the group "
                          f"needs {spec.parallelism.num_nodes}: its pods wait for nodes")
        status.conditions = set_condition(status.conditions, "Progressing", True, "NotEnoughNodes", status.message,
                                          stamp, generation)
    if status.phase != old.phase and status.phase in ("Running", "Degraded"):
        _event(ctx, body, "Normal" if status.phase == "Running" else "Warning", status.phase, status.message)
    await write_status(ctx, body, old, status)
    return Outcome(status.phase, status, plan=plan, spec=spec, node_type=chosen, wake_at=wake_at)


def _phase(status: VExpertDeploymentStatus, sample: RuntimeSample | None, stamp: str, generation: int | None) -> None:
    nodes = status.nodes or 0
    ready = status.ready_nodes == nodes and nodes > 0
    degraded_cond = get_condition(status, "Degraded")
    backoff = degraded_cond is not None and degraded_cond.status == "True" and \
        degraded_cond.reason == "GroupRestartBackoff"
    runtime_degraded = status.runtime.degraded_ranks > 0
    if sample is not None:
        runtime_degraded = sample.degraded_pods > 0
    if not backoff:
        if runtime_degraded:
            status.conditions = set_condition(status.conditions, "Degraded", True, "RuntimeDegraded",
                                              f"{status.runtime.degraded_ranks} node pod(s) report degraded",
                                              stamp, generation)
        else:
            status.conditions = set_condition(status.conditions, "Degraded", False, "AsExpected", "", stamp,
                                              generation)
    status.conditions = set_condition(status.conditions, "Ready", ready, "GroupReady" if ready else "NodesNotReady",
                                      f"{status.ready_nodes}/{nodes} node pods ready", stamp, generation)
    status.conditions = set_condition(status.conditions, "Progressing", not ready,
                                      "Deploying" if not ready else "Deployed",
                                      f"{status.ready_nodes}/{nodes} node pods ready", stamp, generation)
    degraded = get_condition(status, "Degraded")
    if degraded is not None and degraded.status == "True":
        status.phase, status.message = "Degraded", degraded.message
    elif ready:
        status.phase, status.message = "Running", f"{nodes} node pods ready"
    else:
        status.phase, status.message = "Deploying", f"{status.ready_nodes}/{nodes} node pods ready"


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
    ns, generation = meta["namespace"], meta.get("generation")
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
        status.conditions = set_condition(status.conditions, "Degraded", False, "AsExpected", "", stamp, generation)
    elif decision.action == "backoff":
        wake_at = decision.retry_at
        status.conditions = set_condition(
            status.conditions, "Degraded", True, "GroupRestartBackoff",
            f"{decision.reason}; re-forming at {format_time(decision.retry_at) if decision.retry_at else 'soon'} "
            f"(restart {group.restarts + 1})", stamp, generation)
    else:
        status.conditions = set_condition(status.conditions, "Degraded", False, "AsExpected", "", stamp, generation)
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

