"""Calibration Jobs and profiles: any change wakes the deployments that may be waiting for them."""

from __future__ import annotations

from typing import Any

import kopf

from .. import naming as nm
from ..api import GROUP, MODEL_PROFILE_PLURAL, NODE_PROFILE_PLURAL, VERSION
from .deployment import wake_all

JOBS = ("batch", "v1", "jobs")
# Also the server-side label selector of the watch (lifecycle.configure), see pods.NODE_POD_LABELS.
CALIBRATION_JOB_LABELS = {nm.LABEL_ROLE: nm.ROLE_CALIBRATION, nm.LABEL_MANAGED_BY: nm.MANAGED_BY}


@kopf.on.event(*JOBS, labels=CALIBRATION_JOB_LABELS)
def calibration_job_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    # a hardware Job (in the operator's namespace) serves deployments in every namespace
    hardware = body.metadata.labels.get(nm.LABEL_CALIBRATION) == "hardware"
    wake_all(memo, None if hardware else body.metadata.namespace)


@kopf.on.event(GROUP, VERSION, NODE_PROFILE_PLURAL)
def node_profile_changed(memo: kopf.Memo, **_: Any) -> None:
    lists = memo.get("lists")
    if lists is not None:
        lists.invalidate()  # the woken reconciles must see this change
    wake_all(memo, None)


@kopf.on.event(GROUP, VERSION, MODEL_PROFILE_PLURAL)
def model_profile_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    wake_all(memo, body.metadata.namespace)
