"""Node pod events wake the owning deployment's loop (a failed rank re-forms the group quickly)."""

from __future__ import annotations

from typing import Any

import kopf

from .. import naming as nm
from .deployment import wake

PODS = ("", "v1", "pods")
# Also the server-side label selector of the watch (lifecycle.configure): kopf's ``labels=`` filter
# alone is applied client-side, after every Pod of the cluster has been streamed.
NODE_POD_LABELS = {nm.LABEL_ROLE: nm.ROLE_NODE, nm.LABEL_MANAGED_BY: nm.MANAGED_BY}


@kopf.on.event(*PODS, labels=NODE_POD_LABELS)
def node_pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    labels = body.metadata.labels
    deployment = labels.get(nm.LABEL_DEPLOYMENT)
    if deployment and body.metadata.namespace:
        wake(memo, body.metadata.namespace, deployment)
