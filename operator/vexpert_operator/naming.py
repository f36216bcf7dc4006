"""Names, labels and hashes of everything the operator creates. Pure functions.

All children carry ``app.kubernetes.io/*`` labels plus ``vexpert.io/deployment`` so that one label
selector finds a deployment's objects; names are deterministic so that a restarted operator finds
what it created before instead of creating duplicates.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .api import GROUP

MANAGED_BY = "vexpert-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"
LABEL_CALIBRATION = f"{GROUP}/calibration"
LABEL_NODE_TYPE = f"{GROUP}/node-type"
LABEL_MODEL_KEY = f"{GROUP}/model-key"
LABEL_ATTEMPT = f"{GROUP}/attempt"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
ANNOTATION_DRAINED_NODES = f"{GROUP}/drained-nodes"  # on the PDB: the cordoned nodes that relax it
ANNOTATION_MODEL = f"{GROUP}/model"
ANNOTATION_REVISION = f"{GROUP}/model-revision"
ANNOTATION_NODE_TYPE_KEY = f"{GROUP}/node-type-key"
ANNOTATION_HARVEST_ERROR = f"{GROUP}/harvest-error"
ANNOTATION_SOURCE_JOB = f"{GROUP}/calibration-job"
FINALIZER = f"{GROUP}/finalizer"

ROLE_NODE = "node"
ROLE_CALIBRATION = "calibration"

MAX_DEPLOYMENT_NAME = 40  # "<name>-node-<ordinal>" and the StatefulSet revision label must stay ≤ 63


def stable_hash(obj: Any, length: int = 10) -> str:
    """A short, stable hash of a JSON-able object (sorted keys)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def label_selector(labels: Mapping[str, str]) -> str:
    """``{"a": "1", "b": "2"}`` → ``a=1,b=2`` (equality requirements, sorted)."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def slug(text: str, max_len: int = 63) -> str:
    """Lower-case DNS-1123 label fragment: [a-z0-9-], no leading/trailing dash."""
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return out[:max_len].strip("-") or "x"


def bounded_name(prefix: str, key: Any, max_len: int = 63) -> str:
    """``<slug(prefix)>-<hash>`` within ``max_len``: readable and unique per ``key``."""
    digest = stable_hash(key, 10)
    head = slug(prefix, max_len - len(digest) - 1)
    return f"{head}-{digest}"


def label_value(text: str) -> str:
    """A valid label value (≤ 63 chars, alphanumeric at both ends) that keeps text readable."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
    if len(cleaned) > 63:
        cleaned = cleaned[:52] + "-" + stable_hash(text, 10)
    return cleaned.strip("-_.")


# ---------------------------------------------------------------------------- deployment children


def config_map_name(deployment: str) -> str:
    return f"{deployment}-config"


def service_name(deployment: str) -> str:
    return f"{deployment}-nodes"


def api_service_name(deployment: str) -> str:
    """The ClusterIP Service of the OpenAI-compatible API."""
    return f"{deployment}-api"


def statefulset_name(deployment: str) -> str:
    return f"{deployment}-node"


def pdb_name(deployment: str) -> str:
    return f"{deployment}-pdb"


def pod_name(deployment: str, ordinal: int) -> str:
    return f"{statefulset_name(deployment)}-{ordinal}"


def rank0_address(deployment: str, namespace: str) -> str:
    """Stable DNS name of rank 0 through the headless Service."""
    return f"{pod_name(deployment, 0)}.{service_name(deployment)}.{namespace}.svc"


def deployment_labels(deployment: str) -> dict[str, str]:
    return {
        LABEL_NAME: "vexpert",
        LABEL_INSTANCE: deployment,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: "vexpert",
        LABEL_DEPLOYMENT: deployment,
    }


def node_selector_labels(deployment: str) -> dict[str, str]:
    """The immutable selector of the StatefulSet, Service and PDB."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: ROLE_NODE}


# ------------------------------------------------------------------------------------ calibration


def hardware_job_name(node_type: str, attempt: int) -> str:
    return f"vexpert-hwcal-{stable_hash(node_type, 10)}-{attempt}"


def model_key(model: str, revision: str, fit_inputs: Sequence[str] = ()) -> str:
    """Name of the VExpertModelProfile of one model revision fitted on ``fit_inputs`` (the traces,
    EP size and vmax its calibration ran with: a fit for EP8 is not one for EP64), also the
    model-key label."""
    return bounded_name(f"{model.split('/')[-1]}-{revision}", [model, revision, *fit_inputs], 63)


def model_job_name(key: str, attempt: int) -> str:
    return f"vexpert-modelcal-{stable_hash(key, 10)}-{attempt}"
