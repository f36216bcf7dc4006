"""Calibration effects: the hardware profile of every candidate node type and the model profile of
the deployment's model revision (decisions in :mod:`.calibration`, Jobs from :mod:`.manifests`).

Hardware calibration is one piece of work per node type for the whole cluster: its Jobs run in
the operator's namespace (``settings.calibration_namespace``) with the installer's image, resources
and retry policy, are named by node type and attempt (so reconciles of deployments in any number
of namespaces agree on the one Job, a second create gets 409), and are owned by nobody (their TTL
removes them). The result is the cluster-scoped ``VExpertNodeProfile``. Failures show in the
status of every deployment waiting for the type (``Calibrated=False``, ``status.calibration``)
and as Events. Model calibration stays in the deployment's namespace: it reads the checkpoint there.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from vexpert_runtime.policy.profile import PerformanceProfile

from . import kube
from . import metrics as m
from . import naming as nm
from .api import NodeTypeCalibration, VExpertDeploymentSpec, VExpertModelProfileSpec, VExpertNodeProfileSpec
from .calibration import (
    CalibrationStep,
    JobSummary,
    decide_calibration,
    failure_reason,
    format_time,
    parse_result,
    stale_attempts,
    summarize_job,
    termination_message,
)
from .context import Context, list_cluster_wide
from .context import post_event as _event
from .manifests import (
    build_hardware_calibration_job,
    build_model_calibration_job,
    build_model_profile,
    build_node_profile,
    model_fit_inputs,
    owner_reference,
)
from .nodetypes import NodeType, node_type_name
from .ownership import OwnerGone, read_owner_state, withdraw_if_owner_gone


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


async def _step_message(ctx: Context, namespace: str, step: CalibrationStep, jobs: list[JobSummary],
                        selector: str) -> str:
    """What failed, from the latest attempt's pod or Job, and what happens next."""
    if step.action not in ("backoff", "exhausted"):
        return step.message
    latest = max(jobs, key=lambda j: j.attempt)
    pod = await _job_pod(ctx, namespace, latest.name)
    why = failure_reason(pod, latest)
    limit = ctx.settings.calibration_max_attempts
    if step.action == "exhausted":
        return (f"attempt {step.attempt} of {limit} ({step.job}) failed: {why}; no more attempts (delete the "
                f"failed Jobs to start again: kubectl delete jobs -n {namespace} -l {selector})")
    when = format_time(step.retry_at) if step.retry_at else "soon"
    return f"attempt {step.attempt} of {limit} ({step.job}) failed: {why}; retry at {when}"


async def _prune_attempts(ctx: Context, namespace: str, jobs: list[JobSummary]) -> list[JobSummary]:
    """Delete failed calibration Jobs beyond the last few; returns the Jobs that remain."""
    stale = set(stale_attempts(jobs))
    for name in stale:
        await ctx.client.delete(kube.JOBS, name, namespace)
    return [j for j in jobs if j.name not in stale]


def profiles_by_type(profiles: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Node type name → VExpertNodeProfile: by object name (what the operator writes), and by
    ``spec.nodeType`` (hand-written profiles, and those written before GPU memory left the type's
    identity: they still serve their type instead of calibrating it again)."""
    found = {p["metadata"]["name"]: p for p in profiles}
    for obj in profiles:
        try:
            spec = VExpertNodeProfileSpec.model_validate(obj.get("spec") or {})
        except ValidationError:
            continue
        found.setdefault(node_type_name(spec.node_type.to_key()), obj)
    return found


def _full_key(node_type: NodeType) -> Any:
    """The type's key with its GPU memory, for the calibration command and the profile (informative)."""
    return node_type.key.model_copy(update={"gpu_memory_mib": node_type.gpu_memory_mib})


async def _hardware_step(ctx: Context, body: Mapping[str, Any], node_type: NodeType, jobs: list[JobSummary],
                         profiles: dict[str, dict[str, Any]], now: dt.datetime, wake: list[dt.datetime]
                         ) -> NodeTypeCalibration:
    """One step of one node type's calibration (cluster-wide, in the calibration namespace)."""
    ns, settings, type_name = ctx.settings.calibration_namespace, ctx.settings, node_type.name
    jobs = await _prune_attempts(ctx, ns, jobs)
    step = decide_calibration(jobs, now, settings.calibration_retry_backoff_s, settings.calibration_max_retry_backoff_s,
                              settings.calibration_max_attempts)
    entry = NodeTypeCalibration(name=type_name, state="Running", attempts=step.attempt, job=step.job)
    if step.action == "create":
        job = build_hardware_calibration_job(ns, type_name, _full_key(node_type), step.attempt, settings)
        try:
            await ctx.client.create(kube.JOBS, job)
            m.CALIBRATION_JOBS.labels("hardware", "started").inc()
            _event(ctx, body, "Normal", "HardwareCalibrationStarted",
                   f"Job {ns}/{job['metadata']['name']} calibrates node type {type_name} (attempt {step.attempt})")
        except kube.ApiError as exc:
            if not exc.conflict:  # 409: another deployment's reconcile created this very attempt
                raise
        entry.job = job["metadata"]["name"]
        entry.message = f"attempt {step.attempt} started (Job {ns}/{entry.job})"
    elif step.action == "harvest":
        result = await _harvest(ctx, ns, step.job)
        if isinstance(result, PerformanceProfile):
            if result.provenance.node_type is None:
                result.provenance.node_type = node_type.key
            profile_obj = build_node_profile(type_name, _full_key(node_type), result,
                                             node_type.min_allocatable_memory, step.job, ns)
            try:
                profiles[type_name] = await ctx.client.create(kube.NODE_PROFILES, profile_obj)
                if ctx.lists is not None:
                    ctx.lists.invalidate()
                m.CALIBRATION_JOBS.labels("hardware", "succeeded").inc()
                _event(ctx, body, "Normal", "NodeTypeProfiled",
                       f"VExpertNodeProfile {type_name} written from Job {ns}/{step.job}")
            except kube.ApiError as exc:
                if not exc.conflict:
                    raise
                profiles[type_name] = await ctx.client.get(kube.NODE_PROFILES, type_name)
            return NodeTypeCalibration(name=type_name, state="Profiled", attempts=step.attempt, job=step.job)
        entry.state, entry.message = "Failed", f"attempt {step.attempt} ({step.job}): {result}"
        wake.append(now)
        _note_failure(ctx, body, "hardware", step.job, f"node type {type_name}: {entry.message}")
    elif step.action in ("backoff", "exhausted"):
        entry.state = "Failed"
        entry.message = await _step_message(ctx, ns, step, jobs, f"{nm.LABEL_NODE_TYPE}={type_name}")
        _note_failure(ctx, body, "hardware", step.job, f"node type {type_name}: {entry.message}")
        if step.retry_at:
            wake.append(step.retry_at)
    else:
        entry.message = f"{step.message} (Job {ns}/{step.job})"
    return entry


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
    profiles = profiles_by_type(await list_cluster_wide(ctx, kube.NODE_PROFILES))
    hw_jobs: dict[str, list[JobSummary]] = {}
    if calib.mode == "auto":
        for job in await ctx.client.list(kube.JOBS, ctx.settings.calibration_namespace,
                                          labels={nm.LABEL_CALIBRATION: "hardware"}):
            type_name = (job["metadata"].get("labels") or {}).get(nm.LABEL_NODE_TYPE, "")
            hw_jobs.setdefault(type_name, []).append(summarize_job(job))
    chosen_message = ""
    for type_name, node_type in candidates.items():
        if type_name in profiles:
            out.node_types.append(NodeTypeCalibration(name=type_name, state="Profiled"))
            continue
        if calib.mode != "auto":
            continue
        entry = await _hardware_step(ctx, body, node_type, hw_jobs.get(type_name, []), profiles, now, wake)
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
    step = decide_calibration(jobs, now, calib.retry_backoff_seconds, calib.max_retry_backoff_seconds,
                              ctx.settings.calibration_max_attempts)
    out.model_profile = key
    out.model_state = "Running"
    if step.action == "create":
        job = build_model_calibration_job(ns, key, step.attempt, spec, owner, ctx.settings)
        # The Job is the deployment's child: not for an owner that went since the reconcile read
        # it, and taken back if it went while the Job was created (see ownership.py).
        state = await read_owner_state(ctx, body["metadata"])
        if state != "live":
            raise OwnerGone(state)
        try:
            await ctx.client.create(kube.JOBS, job)
            await withdraw_if_owner_gone(ctx, body["metadata"], [("Job", job["metadata"]["name"])])
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
    elif step.action in ("backoff", "exhausted"):
        out.model_state = "Failed"
        out.model_message = await _step_message(ctx, ns, step, jobs, f"{nm.LABEL_MODEL_KEY}={key}")
        _note_failure(ctx, body, "model", step.job, out.model_message)
        if step.retry_at:
            wake.append(step.retry_at)
    else:
        out.model_message = step.message
    if out.ready:
        out.ready = False
        out.reason = "ModelCalibrationFailed" if out.model_state == "Failed" else "ModelCalibrating"
        out.message = f"model {spec.model.name}@{spec.model.revision}: {out.model_message}"
