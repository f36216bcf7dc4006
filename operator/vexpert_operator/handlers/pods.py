"""Node pod events wake the owning deployment's loop (a failed rank re-forms the group quickly)."""

from __future__ import annotations

from typing import Any

import kopf

from .. import naming as nm
from .deployment import wake


@kopf.on.event("", "v1", "pods", labels={nm.LABEL_ROLE: nm.ROLE_NODE, nm.LABEL_MANAGED_BY: nm.MANAGED_BY})
def node_pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    labels = body.metadata.labels
    deployment = labels.get(nm.LABEL_DEPLOYMENT)
    if deployment and body.metadata.namespace:
        wake(memo, body.metadata.namespace, deployment)
