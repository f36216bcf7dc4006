"""What every effectful step of a reconcile shares: the API client, the settings, the logger, the
event poster and the cluster-wide lists shared by concurrent reconciles."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import kube
from .calibration import one_line
from .settings import OperatorSettings
from .sharedlists import SharedLists


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


def post_event(ctx: Context, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    if not ctx.post_events:
        return
    try:
        obj = body if isinstance(body, kopf.Body) else kopf.Body(dict(body))  # type: ignore[arg-type]
        kopf.event(obj, type=type_, reason=reason, message=one_line(message, 1000))
    except Exception:  # events are auxiliary; outside kopf's context there is no poster
        ctx.logger.debug("could not post event %s: %s", reason, message)
