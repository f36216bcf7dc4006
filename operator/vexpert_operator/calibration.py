"""Calibration Jobs: reading their state and result, and deciding the next step. Pure functions.

Job contract (``vexpert calibrate hardware|model``): the container writes the ``PerformanceProfile``
JSON as its termination message and exits 0, or exits non-zero with a one-line reason. The
operator reads the message from the Job's pod, validates it with ``parse_profile`` and stores it
as a ``VExpertNodeProfile`` / ``VExpertModelProfile``. Failed attempts are retried with a doubling
delay, at most ``max_attempts`` in all; the Jobs themselves are the record of attempts, so an
operator restart loses nothing, and deleting a target's failed Jobs starts it afresh.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.profile import PerformanceProfile, parse_profile

from . import naming as nm
from .manifests import CALIBRATION_CONTAINER

MAX_MESSAGE_BYTES = 4096  # the kubelet's cap on a termination message

JobState = Literal["active", "succeeded", "failed"]


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def format_time(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(frozen=True)
class JobSummary:
    name: str
    attempt: int
    state: JobState
    finished_at: dt.datetime | None
    message: str = ""


def summarize_job(job: Mapping[str, Any]) -> JobSummary:
    meta = job.get("metadata", {}) or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    try:
        attempt = int(labels.get(nm.LABEL_ATTEMPT, "1"))
    except ValueError:
        attempt = 1
    status = job.get("status", {}) or {}
    state: JobState = "active"
    finished: dt.datetime | None = None
    message = ""
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            state = "succeeded"
            finished = parse_time(status.get("completionTime")) or parse_time(cond.get("lastTransitionTime"))
        elif cond.get("type") == "Failed":
            state = "failed"
            finished = parse_time(cond.get("lastTransitionTime"))
            message = one_line(cond.get("message") or cond.get("reason") or "failed")
    if annotations.get(nm.ANNOTATION_HARVEST_ERROR):
        # It exited 0 but its result was unusable: that is a failed attempt.
        state = "failed"
        message = one_line(annotations[nm.ANNOTATION_HARVEST_ERROR])
        finished = finished or parse_time(status.get("completionTime"))
    return JobSummary(name=meta.get("name", ""), attempt=attempt, state=state, finished_at=finished, message=message)


@dataclass(frozen=True)
class CalibrationStep:
    """What to do next for one calibration target (a node type or a model revision)."""

    action: Literal["create", "wait", "harvest", "backoff", "exhausted"]
    attempt: int = 1
    job: str = ""
    retry_at: dt.datetime | None = None
    message: str = ""
    failures: int = 0


def retry_delay(failures: int, base_s: float, cap_s: float) -> float:
    """Doubling delay after the ``failures``-th failure: base, 2·base, 4·base … ≤ cap."""
    if failures <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2 ** min(failures - 1, 30)))


KEPT_FAILED_ATTEMPTS = 3  # failed calibration Jobs kept for inspection; older ones are deleted


def stale_attempts(jobs: Iterable[JobSummary], keep: int = KEPT_FAILED_ATTEMPTS) -> list[str]:
    """Failed Jobs older than the last ``keep`` failed attempts: a calibration that keeps failing
    must not pile up a Job (and its pod) per retry for the Jobs' whole TTL."""
    failed = sorted((j for j in jobs if j.state == "failed"), key=lambda j: j.attempt)
    return [j.name for j in failed[:-keep]] if keep > 0 else [j.name for j in failed]


def decide_calibration(jobs: Iterable[JobSummary], now: dt.datetime, base_s: float, cap_s: float,
                       max_attempts: int | None = None) -> CalibrationStep:
    """The next step; ``exhausted`` once ``max_attempts`` attempts failed (no more Jobs)."""
    ordered = sorted(jobs, key=lambda j: j.attempt)
    if not ordered:
        return CalibrationStep("create", attempt=1)
    # Every attempt before a success failed, so the highest failed attempt is the failure count
    # (also after old failed Jobs were deleted, see stale_attempts).
    failures = max((j.attempt for j in ordered if j.state == "failed"), default=0)
    done = [j for j in ordered if j.state == "succeeded"]
    if done:
        return CalibrationStep("harvest", attempt=done[-1].attempt, job=done[-1].name, failures=failures)
    latest = ordered[-1]
    if latest.state == "active":
        return CalibrationStep("wait", attempt=latest.attempt, job=latest.name, failures=failures,
                               message=f"attempt {latest.attempt} running")
    if max_attempts is not None and failures >= max_attempts:
        return CalibrationStep("exhausted", attempt=latest.attempt, job=latest.name, failures=failures,
                               message=latest.message)
    finished = latest.finished_at or now
    retry_at = finished + dt.timedelta(seconds=retry_delay(failures, base_s, cap_s))
    if now >= retry_at:
        return CalibrationStep("create", attempt=latest.attempt + 1, failures=failures, message=latest.message)
    return CalibrationStep("backoff", attempt=latest.attempt, job=latest.name, retry_at=retry_at,
                           failures=failures, message=latest.message)


def termination_message(pod: Mapping[str, Any], container: str = CALIBRATION_CONTAINER) -> tuple[int | None, str]:
    """(exit code, message) of the container's last termination, or (None, '') if it has not ended."""
    for status in (pod.get("status", {}) or {}).get("containerStatuses") or []:
        if status.get("name") != container:
            continue
        term = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")
        if term:
            return term.get("exitCode"), str(term.get("message") or term.get("reason") or "")
    return None, ""


def parse_result(message: str) -> PerformanceProfile:
    """The profile a successful calibration wrote; ``ValueError`` with a short reason otherwise."""
    if not message.strip():
        raise ValueError("the termination message is empty (expected PerformanceProfile JSON)")
    if len(message.encode()) > MAX_MESSAGE_BYTES:
        raise ValueError(f"the termination message exceeds {MAX_MESSAGE_BYTES} bytes")
    try:
        raw = json.loads(message)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the termination message is not JSON ({exc.msg})") from None
    except RecursionError:  # e.g. "[[[[…": 4 KiB of nesting exceeds the decoder's recursion limit
        raise ValueError("the termination message is nested too deeply") from None
    try:
        return parse_profile(raw, origin="termination message")
    except VExpertInputError as exc:
        raise ValueError(str(exc)) from None


def failure_reason(pod: Mapping[str, Any] | None, job: JobSummary) -> str:
    """The one-line reason of a failed attempt: the container's message, else the Job condition."""
    if pod is not None:
        code, message = termination_message(pod)
        if code not in (None, 0) and message:
            return one_line(f"exit {code}: {message}")
    return job.message or "failed"
