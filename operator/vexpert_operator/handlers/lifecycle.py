"""Operator start-up, login and clean-up."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from .. import kube, metrics
from ..naming import FINALIZER, label_selector
from ..settings import OperatorSettings
from ..sharedlists import SharedLists
from .calibration import CALIBRATION_JOB_LABELS, JOBS
from .deployment import stop_all_loops
from .pods import NODE_POD_LABELS, PODS


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    config = OperatorSettings.from_env()
    memo["config"] = config
    memo["client"] = kube.KubeClient(kube.logged_in_connection)
    # Nodes and node profiles are read by every reconcile: concurrent reconciles share one LIST,
    # reused for at most half a reconcile period (1 s at most); profile events invalidate it.
    memo["lists"] = SharedLists(memo["client"], min(1.0, config.reconcile_interval_s / 2))
    memo["wakeups"] = {}
    memo["locks"] = {}
    memo["counted_jobs"] = set()
    memo["scrapes"] = {}  # the last scrape of each node pod, for the serving rates
    memo["loops"] = {}  # (namespace, name) → the deployment's GroupLoop
    # No handler needs a finalizer (see handlers/deployment.py); kopf removes this one, which older
    # versions put on every deployment, from objects that still carry it.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="vexpert.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="vexpert.io", key="last-handled-configuration")
    settings.posting.reporting_component = "vexpert-operator"
    settings.posting.level = 20  # INFO and above from kopf.info/warning become Events
    settings.watching.reconnect_backoff = config.watch_reconnect_s
    # Only the operator's own Pods and Jobs are listed and streamed (labelSelector on the requests),
    # not every Pod and Job of the cluster.
    settings.watching.label_selectors[PODS] = label_selector(NODE_POD_LABELS)
    settings.watching.label_selectors[JOBS] = label_selector(CALIBRATION_JOB_LABELS)
    settings.execution.max_workers = 8
    metrics.DEPLOYMENT_PHASES.reset()
    metrics.serve(config.metrics_port)
    logger.info("vexpert-operator configured: %s", config.model_dump())


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return kube.remember_login(kube.connection_from_environment())


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await stop_all_loops(memo)
    client = memo.get("client")
    if client is not None:
        await client.close()
    for event in memo.get("wakeups", {}).values():
        event.set()
    await asyncio.sleep(0)
