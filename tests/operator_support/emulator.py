"""A Kubernetes API emulator for the operator's API tests: kmock 0.8 plus the project's fixes.

kmock's ``KubernetesEmulator`` stores objects and serves list/watch/get/create/patch/delete, but as
shipped it gives objects no uid/creationTimestamp/generation/resourceVersion, never answers 409,
ignores ``?resourceVersion`` on watches, registers nothing for a posted CRD and knows no
selectors, status subresource or garbage collection. This subclass keeps kmock's server,
discovery, request log and reaction DSL (tests can still inject faults with ``emulator[...] << 500``)
and replaces the object store's semantics with:

* metadata: uid, creationTimestamp, generation (bumped when anything but metadata/status changes),
  a global resourceVersion, ``generateName``; no-op writes change nothing and emit no event;
* 409 AlreadyExists on create; 409 Conflict on a stale ``resourceVersion`` (PUT, merge patch,
  delete preconditions); 422 for a failed JSON-patch ``test`` op (what kopf relies on);
* JSON merge patch (RFC 7386), JSON patch (RFC 6902), PUT, and server-side apply
  (``application/apply-patch+yaml``: ``fieldManager`` required, field ownership per manager,
  removal of fields a manager stopped applying, 409 conflicts unless ``force=true``,
  ``metadata.managedFields``; the model is in ``fieldmanagers.py``, lists are atomic); strategic
  merge patches are refused with 415 so nothing silently relies on them;
* status subresource isolation: writes to the object ignore ``status``, writes to ``/status``
  change only ``status``;
* watches resume from ``?resourceVersion`` (an event log per resource), honour label/field
  selectors (objects entering/leaving a selector are ADDED/DELETED) and ``timeoutSeconds``;
* label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors
  (``metadata.name``, ``metadata.namespace``, ``status.phase``, ``spec.nodeName``) on lists;
* finalizers and ``deletionTimestamp``; garbage collection of dependents by ``ownerReferences``;
* a posted CRD registers its resource (kind, scope, short names, status subresource) and its
  ``openAPIV3Schema``: custom resources get schema defaults and are validated (unknown fields are
  rejected rather than pruned, so a test notices what a real server would silently drop);
* built-in objects written by clients are validated with ``kubernetes-validate --strict``;
* immutable fields: StatefulSet spec except replicas/template/updateStrategy/…, Job template,
  Service clusterIP, metadata.name/namespace/uid;
* namespaces must exist for namespaced creates; ``/api/v1/namespaces`` lists;
* optional controllers: StatefulSet (ordinal pods from the template, status), Job (one pod per
  attempt, Complete/Failed conditions from the pod phase). There is no scheduler and no kubelet:
  tests play the kubelet by patching pod status through the API, exactly as they would on a real
  cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import functools
import hashlib
import json
import random
import re
import string
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import attrs
import jsonpatch
import jsonschema
import kmock
import kubernetes_validate
import kubernetes_validate.utils as kvu
import yaml
from kmock._internal import dsl, enums, parsing, references, rendering
from kmock._internal.k8s import KubernetesError
from referencing import Registry, Resource

from . import fieldmanagers as fm

VALIDATE_VERSION = "1.32"
VALIDATED_KINDS = {"Pod", "ConfigMap", "Service", "StatefulSet", "Job", "PodDisruptionBudget", "Namespace",
                   "CustomResourceDefinition"}
STATUS_SUBRESOURCE_BUILTINS = {"pods", "nodes", "namespaces", "services", "statefulsets", "deployments", "jobs",
                               "poddisruptionbudgets", "customresourcedefinitions", "replicasets", "daemonsets"}
CONTROLLED_PLURALS = {"statefulsets", "jobs", "pods"}
STS_MUTABLE_SPEC = {"replicas", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy",
                    "minReadySeconds", "ordinals", "revisionHistoryLimit"}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _err(status: int, reason: str, message: str) -> KubernetesError:
    return KubernetesError(status=status, reason=reason, message=message, details={})


def _client_gone(request: rendering.Request) -> bool:
    raw = request._raw_request
    transport = getattr(raw, "transport", None) if raw is not None else None
    return raw is not None and (transport is None or transport.is_closing())


# ------------------------------------------------------------------------------------- URL parsing

_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock reads ``/api/v1/namespaces[/NAME[/status]]`` as the prefix of a namespaced URL (and
    fails with 500); these URLs address the cluster-scoped ``namespaces`` resource itself."""
    parts = path.strip("/").split("/")
    if parts[:1] == ["api"] and len(parts) >= 3 and parts[2] == "namespaces":
        if len(parts) == 3:
            return parsing.ParsedPath("", parts[1], "namespaces")
        if len(parts) == 4:
            return parsing.ParsedPath("", parts[1], "namespaces", None, parts[3])
        if len(parts) == 5 and parts[4] in ("status", "finalize"):
            return parsing.ParsedPath("", parts[1], "namespaces", None, parts[3], parts[4])
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # rendering.Request._parse looks it up on the module at call time


# ----------------------------------------------------------------------------------------- selectors

_REQ = re.compile(r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(==|=|!=|\s+in\s+|\s+notin\s+)\s*(.*?))?\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def label_selector_matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    if not selector:
        return True
    for req in _split_selector(selector):
        match = _REQ.match(req)
        if not match:
            raise _err(400, "BadRequest", f"unable to parse requirement: {req!r}")
        neg, key, op, value = match.groups()
        op = (op or "").strip()
        if not op:
            if bool(neg) == (key in labels):
                return False
        elif op in ("=", "=="):
            if labels.get(key) != value.strip():
                return False
        elif op == "!=":
            if labels.get(key) == value.strip():
                return False
        else:
            values = {v.strip() for v in value.strip().strip("()").split(",")}
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and labels.get(key) in values:
                return False
    return True


def field_selector_matches(selector: str | None, obj: Mapping[str, Any]) -> bool:
    if not selector:
        return True
    for req in selector.split(","):
        neg = "!=" in req
        key, _, value = req.partition("!=" if neg else "=")
        value = value.lstrip("=")
        node: Any = obj
        for part in key.strip().split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        actual = "" if node is None else str(node)
        if (actual == value) == neg:
            return False
    return True


def _selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A PDB's ``LabelSelector`` (matchLabels only, which is all the operator writes): in policy/v1
    a null selector matches no pod, an empty one every pod of the namespace."""
    if selector is None:
        return False
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _scaled(value: int | str, total: int, round_up: bool) -> int:
    """An int-or-percent field of a PDB against ``total`` pods."""
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * total / 100
        return int(-(-exact // 1)) if round_up else int(exact)
    return int(value)


# ------------------------------------------------------------------------------------------ patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ----------------------------------------------------------------------------------- CRD schemas


def openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (structural) → JSON Schema draft 4, strict: unknown fields are errors."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in ("nullable", "default")}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if node.get("type") == "object" and "properties" in node and not preserve:
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def apply_defaults(schema: Mapping[str, Any], obj: Any) -> Any:
    if not isinstance(obj, dict):
        if isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
            return [apply_defaults(schema["items"], item) for item in obj]
        return obj
    for key, sub in (schema.get("properties") or {}).items():
        if key not in obj and "default" in sub:
            obj[key] = copy.deepcopy(sub["default"])
        if key in obj:
            obj[key] = apply_defaults(sub, obj[key])
    return obj


# --------------------------------------------------------------------------------------- emulator

_BUNDLED: dict[references.resource, references.ResourceInfo] = {}


def _bundled_resources() -> dict[references.resource, references.ResourceInfo]:
    """kmock's bundled discovery data (a K3s cluster's built-in resources), loaded once."""
    if not _BUNDLED:
        array = kmock.ResourcesArray()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # kmock uses importlib.resources.read_binary
            array.load_bundled()
        _BUNDLED.update({res: array[res] for res in array})
    return _BUNDLED



@functools.cache
def _builtin_validator(api_version: str, kind: str) -> Any:
    """What ``kubernetes_validate.validate(obj, VALIDATE_VERSION, strict=True)`` validates with, built
    once per kind: the library builds a new registry and validator (and re-resolves every ``$ref``)
    on every call, which made validation most of a write's cost."""
    version = [v for v in kvu.all_versions() if kvu.major_minor(v) <= kvu.major_minor(VALIDATE_VERSION)][-1]
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_dir = f"v{version}-local-strict"
    try:
        schema = kvu.schema_contents(f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{api}.json",
                                     VALIDATE_VERSION)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(version=kvu.major_minor(VALIDATE_VERSION), kind=kind,
                                                      api_version=api_version) from None
    defs = kvu.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", VALIDATE_VERSION)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    validate_builtins: bool = True
    run_controllers: bool = True
    # Kubernetes' garbage collector also deletes a dependent created after all its owners were
    # deleted (eventually). Off: such a late dependent stays, so a test sees what the operator itself
    # leaves behind (the delete-during-reconcile race, tests/test_operator_delete_race.py).
    collect_late_dependents: bool = True
    # Called with every request and "before" (not yet served) or "after" (served, the response not
    # yet sent): a test injects a write of its own at an exact point of the operator's sequence.
    request_hook: Callable[[rendering.Request, str], Awaitable[None]] | None = None

    _rv: int = attrs.field(default=0, init=False)
    _log: dict[references.resource, list[tuple[int, str, dict[str, Any], dict[str, Any] | None]]] = attrs.field(
        factory=dict, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _schemas: dict[references.resource, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _validators: dict[references.resource, Any] = attrs.field(factory=dict, init=False)
    _status_sub: set[references.resource] = attrs.field(factory=set, init=False)
    _controller_task: asyncio.Task[None] | None = attrs.field(default=None, init=False)
    _kick: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _managers: dict[tuple[references.resource, str | None, str], fm.Managers] = attrs.field(factory=dict, init=False)
    _deleted_uids: set[str] = attrs.field(factory=set, init=False)  # owners gone: their late dependents are collected

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for res, info in _bundled_resources().items():
            self.resources[res] = copy.deepcopy(info)
        for res in list(self.resources):
            if res.plural in STATUS_SUBRESOURCE_BUILTINS and res.group in ("", "apps", "batch", "policy",
                                                                            "apiextensions.k8s.io"):
                self._status_sub.add(res)
        self.fallback["put"] << self._serve_replace
        self.fallback["post"] << self._serve_create  # kmock guesses no action for POSTs to subresources

    async def __aenter__(self) -> KubeEmulator:
        await super().__aenter__()
        if self.run_controllers and self._controller_task is None:
            self._controller_task = asyncio.create_task(self._controllers())
        return self

    async def end_watches(self) -> None:
        """End every open watch stream (within a second). The server's shutdown waits for its
        handlers, and a watch whose client never closed its connection would hold it for the
        whole aiohttp shutdown timeout."""
        self._closing = True
        async with self._changed:
            self._changed.notify_all()

    async def __aexit__(self, *exc: Any) -> None:
        if self._controller_task is not None:
            self._controller_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._controller_task
            self._controller_task = None
        await super().__aexit__(*exc)

    # kmock's own _handle mutates objects before the reactions; ours does it inside the fallbacks,
    # so a user reaction (an injected fault) really prevents the change. It is kmock's
    # ``RawHandler._handle`` except for how it asks whether a reaction's filter sees the request:
    # kmock's ``request in view`` re-filters every request served so far (quadratic in the run's
    # length: with thousands of requests it was most of the emulator's time); ``_sees`` decides
    # filters, priorities, unions, intersections, exclusions and streams from the request alone and
    # falls back to kmock for what needs the history (slices, reactions, anything unknown).
    async def _handle(self, request: rendering.Request) -> Any:
        if self.request_hook is not None:
            await self.request_hook(request, "before")
        result = await self._dispatch(request)
        if self.request_hook is not None:
            await self.request_hook(request, "after")
        return result

    async def _dispatch(self, request: rendering.Request) -> Any:
        payloads = self._sorted_payloads()
        for payload in payloads:
            if self._sees(payload._source, request) and not payload._disabled.is_set():
                try:
                    return await payload(request)
                except rendering.ReactionMismatchError:  # either mismatch or depletion
                    payload._disabled.set()
                except NotImplementedError:  # matched, but non-actionable (nothing to respond with)
                    pass
        raise NotImplementedError("Undefined server behaviour: no reaction matching the request is defined.")

    def _sorted_payloads(self) -> list[Any]:
        """kmock's ordering of reactions (highest priority first, ties in registration order)."""
        priorities: list[tuple[float, ...]] = [payload.priorities for payload in self._payloads]
        max_length = max((len(p) for p in priorities), default=0)
        keys = [tuple(-p for p in priority) + (0,) * (max_length - len(priority)) for priority in priorities]
        return [self._payloads[i] for i in sorted(range(len(keys)), key=lambda i: keys[i])]

    def _sees(self, view: Any, request: rendering.Request) -> bool:
        kind = type(view)
        if view is self:
            return True  # the request was just appended to this root's log
        if kind is dsl.Filter:
            return self._sees(view._source, request) and bool(view.criteria(request))
        if kind is dsl.Priority:
            return self._sees(view._source, request)
        if kind is dsl.Stream:
            return self._sees(view._source, request) and bool(request._stream_bus.consumer_count)
        if kind is dsl.OrGroup:
            return any(self._sees(v, request) for v in view._sources)
        if kind is dsl.AndGroup:
            return all(self._sees(v, request) for v in view._sources)
        if kind is dsl.Exclusion:
            return self._sees(view._source, request) and not any(self._sees(v, request) for v in view._exclusions)
        return request in view  # kmock's exact (slow) answer

    # ---------------------------------------------------------------------------------- helpers

    def _info(self, res: references.resource | None) -> references.ResourceInfo:
        if res is None or res not in self.resources:
            raise _err(404, "NotFound", f"the server could not find the requested resource ({res})")
        return self.resources[res]

    def _get(self, res: references.resource, ns: str | None, name: str) -> dict[str, Any] | None:
        key = (res, ns, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _all(self, res: references.resource, ns: str | None = None,
             keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Copies of the live objects of a resource (that ``keep`` accepts: it sees the stored
        object, read-only, so only what is returned gets copied)."""
        out = [copy.deepcopy(obj) for obj in self._live(res, ns) if keep is None or keep(obj)]
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _live(self, res: references.resource, ns: str | None = None) -> list[dict[str, Any]]:
        """The stored live objects of a resource, NOT copied: read-only (the controllers' reads)."""
        out = []
        for (r, n, _), obj in self._objects.items():
            if r == res and not obj.deleted and (ns is None or n == ns):
                out.append(obj.raw)
        return out

    async def _append(self, res: references.resource, type_: str, obj: dict[str, Any],
                      old: dict[str, Any] | None) -> None:
        self._log.setdefault(res, []).append((self._rv, type_, copy.deepcopy(obj), copy.deepcopy(old)))
        async with self._changed:
            self._changed.notify_all()
        if res.plural in CONTROLLED_PLURALS and res.group in ("", "apps", "batch"):
            self._kick.set()  # the controllers read nothing else

    def _not_found(self, res: references.resource, name: str) -> KubernetesError:
        return _err(404, "NotFound", f'{res.plural}.{res.group or "core"} "{name}" not found')

    def _validate(self, res: references.resource, obj: dict[str, Any]) -> None:
        if res in self._schemas:
            validator = self._validators.get(res)
            if validator is None:
                validator = self._validators[res] = jsonschema.Draft4Validator(self._schemas[res])
            errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
            if errors:
                err = errors[0]
                path = ".".join(str(p) for p in err.path) or "(root)"
                raise _err(422, "Invalid", f"{obj.get('kind')} \"{obj['metadata'].get('name')}\" is invalid: "
                                           f"{path}: {err.message}")
        elif self.validate_builtins and obj.get("kind") in VALIDATED_KINDS:
            try:
                _builtin_validator(obj.get("apiVersion", ""), obj["kind"]).validate(obj)
            except jsonschema.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path) or "(root)"
                raise _err(422, "Invalid", f"{obj.get('kind')} \"{obj['metadata'].get('name')}\" is invalid: "
                                           f"{path}: {exc.message}") from None

    def _check_immutable(self, res: references.resource, old: dict[str, Any], new: dict[str, Any]) -> None:
        kind = old.get("kind")
        o_spec, n_spec = old.get("spec") or {}, new.get("spec") or {}
        if kind == "StatefulSet":
            for key in set(o_spec) | set(n_spec):
                if key not in STS_MUTABLE_SPEC and o_spec.get(key) != n_spec.get(key):
                    raise _err(422, "Invalid", f"StatefulSet.apps \"{old['metadata']['name']}\" is invalid: spec: "
                                               "Forbidden: updates to statefulset spec for fields other than "
                                               "'replicas', 'ordinals', 'template', 'updateStrategy', "
                                               "'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' "
                                               f"are forbidden (changed: {key})")
        elif kind == "Job":
            if o_spec.get("template") != n_spec.get("template") or o_spec.get("selector") != n_spec.get("selector"):
                raise _err(422, "Invalid", f"Job.batch \"{old['metadata']['name']}\" is invalid: spec.template: "
                                           "field is immutable")
        elif kind == "Service" and o_spec.get("clusterIP") and n_spec.get("clusterIP") != o_spec.get("clusterIP"):
            raise _err(422, "Invalid", f"Service \"{old['metadata']['name']}\" is invalid: spec.clusterIP: "
                                           "field is immutable")

    # ------------------------------------------------------------------------------ core writes

    async def create_object(self, res: references.resource, ns: str | None, body: dict[str, Any],
                            validate: bool = True) -> dict[str, Any]:
        info = self._info(res)
        if not isinstance(body, dict):
            raise _err(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if info.namespaced:
            ns = ns or meta.get("namespace")
            if not ns:
                raise _err(400, "BadRequest", "the namespace of the object is required")
            if meta.get("namespace") not in (None, ns):
                raise _err(400, "BadRequest", "the namespace of the object does not match the URL")
            if self._get(references.resource("", "v1", "namespaces"), None, ns) is None:
                raise _err(404, "NotFound", f'namespaces "{ns}" not found')
            meta["namespace"] = ns
        else:
            ns = None
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _err(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        name = meta["name"]
        if self._get(res, ns, name) is not None:
            raise _err(409, "AlreadyExists", f'{res.plural}.{res.group or "core"} "{name}" already exists')
        obj.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        obj.setdefault("kind", info.kind)
        if res in self._schemas:
            apply_defaults(self._crd_raw_schema(res), obj)
        if res in self._status_sub:
            obj.pop("status", None)
            if info.kind == "Pod":
                obj["status"] = {"phase": "Pending"}
        if info.kind == "Service" and not (obj.get("spec") or {}).get("clusterIP"):
            obj.setdefault("spec", {})["clusterIP"] = f"10.96.{random.randint(0, 255)}.{random.randint(1, 254)}"
        for key in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "generation"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if validate:
            self._validate(res, obj)
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        self._managers.pop((res, ns, name), None)
        if (res, ns, name) in self._objects:
            self._objects[res, ns, name].create(copy.deepcopy(obj))  # keeps the soft-deleted history
        else:
            self._objects[res, ns, name] = copy.deepcopy(obj)
        await self._append(res, "ADDED", obj, None)
        if info.kind == "CustomResourceDefinition":
            self._register_crd(obj)
        refs = meta.get("ownerReferences") or []
        if self.collect_late_dependents and refs and all(ref.get("uid") in self._deleted_uids for ref in refs):
            # Kubernetes' garbage collector deletes a dependent whose owners are all gone, also one
            # created after its owner was deleted (a controller's write racing the deletion).
            await self.delete_object(res, ns, name)
        return obj

    async def update_object(self, res: references.resource, ns: str | None, name: str, new: dict[str, Any],
                            subresource: str | None, validate: bool = True) -> dict[str, Any]:
        current = self._get(res, ns, name)
        if current is None:
            raise self._not_found(res, name)
        if subresource not in (None, "status"):
            raise _err(405, "MethodNotAllowed", f"subresource {subresource} is not emulated")
        if subresource == "status":
            merged = copy.deepcopy(current)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        else:
            if res in self._status_sub:
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
            meta, old_meta = new.setdefault("metadata", {}), current["metadata"]
            if meta.get("name", name) != name or meta.get("namespace", old_meta.get("namespace")) != \
                    old_meta.get("namespace"):
                raise _err(400, "BadRequest", "metadata.name and metadata.namespace cannot change")
            for key in ("uid", "creationTimestamp", "deletionTimestamp", "generation", "name", "namespace",
                        "resourceVersion", "generateName", "deletionGracePeriodSeconds"):
                if key in old_meta:
                    meta[key] = old_meta[key]
                else:
                    meta.pop(key, None)
            if old_meta.get("deletionTimestamp"):
                added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
                if added:
                    raise _err(422, "Invalid", "metadata.finalizers: Forbidden: no new finalizers can be added "
                                               "if the object is being deleted")
            self._check_immutable(res, current, new)
        new.setdefault("apiVersion", current.get("apiVersion"))
        new.setdefault("kind", current.get("kind"))
        if res in self._schemas:
            apply_defaults(self._crd_raw_schema(res), new)
        if validate:
            self._validate(res, new)
        if new == current:
            return current  # a no-op write changes nothing, not even the resourceVersion
        strip = ("metadata", "status")
        if {k: v for k, v in new.items() if k not in strip} != {k: v for k, v in current.items() if k not in strip}:
            new["metadata"]["generation"] = int(current["metadata"].get("generation") or 1) + 1
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            await self._remove(res, ns, name, new)
            return new
        self._objects[res, ns, name].history.append(copy.deepcopy(new))
        await self._append(res, "MODIFIED", new, current)
        return new

    async def delete_object(self, res: references.resource, ns: str | None, name: str,
                            options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        current = self._get(res, ns, name)
        if current is None:
            raise self._not_found(res, name)
        pre = (options or {}).get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
            raise _err(409, "Conflict", f"Precondition failed: UID in precondition: {pre['uid']}, "
                                        f"UID in object meta: {current['metadata']['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise _err(409, "Conflict", "Precondition failed: resourceVersion mismatch")
        if current["metadata"].get("finalizers"):
            if current["metadata"].get("deletionTimestamp"):
                return current
            new = copy.deepcopy(current)
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._objects[res, ns, name].history.append(copy.deepcopy(new))
            await self._append(res, "MODIFIED", new, current)
            return new
        self._rv += 1
        current["metadata"]["resourceVersion"] = str(self._rv)
        await self._remove(res, ns, name, current, orphan=(options or {}).get("propagationPolicy") == "Orphan")
        return current

    async def _remove(self, res: references.resource, ns: str | None, name: str, last: dict[str, Any],
                      orphan: bool = False) -> None:
        self._objects[res, ns, name].delete()
        self._deleted_uids.add(last["metadata"]["uid"])
        self._managers.pop((res, ns, name), None)
        await self._append(res, "DELETED", last, None)
        if last.get("kind") == "Namespace":
            for (r, n, nm_), obj in list(self._objects.items()):
                if n == name and not obj.deleted:
                    await self.delete_object(r, n, nm_)
        if not orphan:
            await self._collect_garbage(last["metadata"]["uid"])

    async def _collect_garbage(self, owner_uid: str) -> None:
        live_uids = {o.raw["metadata"]["uid"] for o in self._objects.values() if not o.deleted}
        for (r, n, name), obj in list(self._objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw["metadata"].get("ownerReferences") or []
            if refs and any(ref.get("uid") == owner_uid for ref in refs) and \
                    not any(ref.get("uid") in live_uids for ref in refs) and self._get(r, n, name) is not None:
                await self.delete_object(r, n, name)

    def _crd_raw_schema(self, res: references.resource) -> dict[str, Any]:
        return self._schemas[res].get("__raw__", {})

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            res = references.resource(spec["group"], version["name"], names["plural"])
            self.resources[res] = references.ResourceInfo(
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                kind=names["kind"],
                singular=names.get("singular", names["kind"].lower()),
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources={"status"} if "status" in (version.get("subresources") or {}) else set(),
            )
            if "status" in (version.get("subresources") or {}):
                self._status_sub.add(res)
            raw = (version.get("schema") or {}).get("openAPIV3Schema")
            if raw:
                converted = openapi_to_jsonschema(raw)
                converted.setdefault("properties", {})["metadata"] = {"type": "object"}
                converted["__raw__"] = raw
                self._schemas[res] = converted
                self._validators.pop(res, None)

    # ------------------------------------------------------------------------------- endpoints

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        self._info(request.resource)
        assert request.resource is not None and request.name is not None
        async with self._lock:
            obj = self._get(request.resource, request.namespace, request.name)
        if obj is None:
            raise self._not_found(request.resource, request.name)
        return obj

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        info = self._info(request.resource)
        assert request.resource is not None
        labels, fields = request.params.get("labelSelector"), request.params.get("fieldSelector")
        async with self._lock:
            items = self._all(request.resource, request.namespace,
                              lambda o: label_selector_matches(labels, o["metadata"].get("labels") or {})
                              and field_selector_matches(fields, o))
            rv = str(self._rv)
        res = request.resource
        return {"apiVersion": f"{res.group}/{res.version}" if res.group else res.version,
                "kind": f"{info.kind}List", "metadata": {"resourceVersion": rv}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        self._info(request.resource)
        res = request.resource
        assert res is not None
        yield b""
        params = request.params
        labels, fields = params.get("labelSelector"), params.get("fieldSelector")
        since = params.get("resourceVersion") or ""
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None

        def visible(obj: Mapping[str, Any] | None) -> bool:
            if obj is None:
                return False
            meta = obj.get("metadata") or {}
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                return False
            if request.name is not None and meta.get("name") != request.name:
                return False
            return label_selector_matches(labels, meta.get("labels") or {}) and field_selector_matches(fields, obj)

        async with self._lock:
            log = self._log.setdefault(res, [])
            if since and since != "0":
                try:
                    start_rv = int(since)
                except ValueError:
                    raise _err(400, "BadRequest", f"invalid resourceVersion {since!r}") from None
                index = next((i for i, entry in enumerate(log) if entry[0] > start_rv), len(log))
                initial: list[dict[str, Any]] = []
            else:
                index = len(log)
                initial = [{"type": "ADDED", "object": o} for o in self._all(res, request.namespace, visible)]
        for event in initial:
            yield event
        while True:
            while index < len(log):
                _, type_, obj, old = log[index]
                index += 1
                now_in, was_in = visible(obj), visible(old)
                if type_ == "MODIFIED" and now_in and not was_in:
                    yield {"type": "ADDED", "object": obj}
                elif type_ == "MODIFIED" and was_in and not now_in:
                    yield {"type": "DELETED", "object": obj}
                elif now_in:
                    yield {"type": type_, "object": obj}
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                return
            if _client_gone(request) or self._closing:
                return  # aiohttp does not cancel handlers of closed connections: end the stream here
            async with self._changed:
                if index >= len(log):
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=min(remaining or 1.0, 1.0))

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        self._info(request.resource)
        assert request.resource is not None
        if request.resource.plural == "pods" and request.subresource == "eviction":
            return await self._serve_eviction(request)
        if request.resource.plural == "pods" and request.subresource == "binding":
            return await self._serve_binding(request)
        if request.name is not None:
            raise _err(405, "MethodNotAllowed", f"POST to {request.subresource or 'an object'} is not emulated")
        async with self._lock:
            return await self.create_object(request.resource, request.namespace, request.data)

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        res, ns, name = request.resource, request.namespace, request.name
        self._info(res)
        assert res is not None and name is not None
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype == "application/apply-patch+yaml":
            return await self._serve_apply(request)
        async with self._lock:
            current = self._get(res, ns, name)
            if current is None:
                raise self._not_found(res, name)
            patch = request.data
            if ctype == "application/merge-patch+json":
                if not isinstance(patch, Mapping):
                    raise _err(400, "BadRequest", "a merge patch must be a JSON object")
                want_rv = (patch.get("metadata") or {}).get("resourceVersion")
                if want_rv and want_rv != current["metadata"]["resourceVersion"]:
                    raise _err(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": '
                                                "the object has been modified; please apply your changes to the "
                                                "latest version and try again")
                new = merge_patch(current, patch)
            elif ctype == "application/json-patch+json":
                try:
                    new = jsonpatch.apply_patch(current, patch, in_place=False)
                except jsonpatch.JsonPatchTestFailed as exc:
                    raise _err(422, "Invalid", f"the server rejected our request due to an error in our "
                                               f"request: {exc}") from None
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise _err(422, "Invalid", f"invalid JSON patch: {exc}") from None
            else:
                raise _err(415, "UnsupportedMediaType",
                           f"the emulator implements merge, JSON and apply patches only, not {ctype!r}")
            return await self._tracked_update(request, current, new)

    async def _serve_replace(self, request: rendering.Request) -> rendering.Payload:
        res, ns, name = request.resource, request.namespace, request.name
        self._info(res)
        if res is None or name is None:
            raise _err(405, "MethodNotAllowed", "PUT needs an object URL")
        body = request.data
        if not isinstance(body, dict):
            raise _err(400, "BadRequest", "the body must be a JSON object")
        async with self._lock:
            current = self._get(res, ns, name)
            if current is None:
                raise self._not_found(res, name)
            want_rv = (body.get("metadata") or {}).get("resourceVersion")
            if want_rv and want_rv != current["metadata"]["resourceVersion"]:
                raise _err(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": the object '
                                            "has been modified; please apply your changes to the latest version "
                                            "and try again")
            return await self._tracked_update(request, current, copy.deepcopy(body))

    # ------------------------------------------------------------------ eviction, binding

    async def _serve_eviction(self, request: rendering.Request) -> rendering.Payload:
        """The eviction API: refused with 429 while a matching PDB allows no disruption, else the
        pod is deleted. The budget is computed on the spot (the real disruption controller keeps it
        in the PDB's status), from Ready pods, ``minAvailable`` (number or percent) or
        ``maxUnavailable`` against the owning StatefulSet's replicas, and
        ``unhealthyPodEvictionPolicy``."""
        pod_res, ns, name = request.resource, request.namespace, request.name
        assert pod_res is not None and name is not None
        async with self._lock:
            pod = self._get(pod_res, ns, name)
            if pod is None:
                raise self._not_found(pod_res, name)
            labels = pod["metadata"].get("labels") or {}
            pdbs = [p for p in self._all(references.resource("policy", "v1", "poddisruptionbudgets"), ns)
                    if _selector_matches((p.get("spec") or {}).get("selector"), labels)]
            if len(pdbs) > 1:
                raise _err(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the eviction "
                                                 "subresource does not support.")
            if pdbs and not self._disruption_allowed(pdbs[0], pod, ns):
                raise _err(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption "
                                                   f"budget (PodDisruptionBudget {pdbs[0]['metadata']['name']}).")
            await self.delete_object(pod_res, ns, name)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def _disruption_allowed(self, pdb: Mapping[str, Any], pod: Mapping[str, Any], ns: str | None) -> bool:
        spec = pdb.get("spec") or {}
        pods = [p for p in self._live(references.resource("", "v1", "pods"), ns)
                if not p["metadata"].get("deletionTimestamp")
                and _selector_matches(spec.get("selector"), p["metadata"].get("labels") or {})]
        healthy = sum(1 for p in pods if _pod_ready(p))
        if not _pod_ready(pod) and spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow":
            return True
        expected = len(pods)
        for ref in pod["metadata"].get("ownerReferences") or []:
            if ref.get("kind") == "StatefulSet":
                owner = self._get(references.resource("apps", "v1", "statefulsets"), ns, ref["name"])
                if owner is not None:
                    expected = int((owner.get("spec") or {}).get("replicas", 1))
        if "minAvailable" in spec:
            desired = _scaled(spec["minAvailable"], expected, round_up=True)
        else:
            desired = expected - _scaled(spec.get("maxUnavailable", 0), expected, round_up=True)
        return healthy - desired > 0 and (_pod_ready(pod) or healthy >= desired)

    async def _serve_binding(self, request: rendering.Request) -> rendering.Payload:
        """``pods/binding``: what the scheduler does (sets ``spec.nodeName`` once)."""
        pod_res, ns, name = request.resource, request.namespace, request.name
        assert pod_res is not None and name is not None
        target = ((request.data or {}).get("target") or {}).get("name") if isinstance(request.data, Mapping) else None
        if not target:
            raise _err(400, "BadRequest", "a Binding needs target.name")
        async with self._lock:
            pod = self._get(pod_res, ns, name)
            if pod is None:
                raise self._not_found(pod_res, name)
            if (pod.get("spec") or {}).get("nodeName"):
                raise _err(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
            pod["spec"]["nodeName"] = target
            await self.update_object(pod_res, ns, name, pod, None, validate=False)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    # ----------------------------------------------------------------- server-side apply

    @staticmethod
    def _manager_of(request: rendering.Request) -> str:
        """``?fieldManager=``, else the User-Agent's product (what a real server records)."""
        agent = request.headers.get("User-Agent") or "unknown"
        return request.params.get("fieldManager") or agent.split("/", 1)[0].split(" ", 1)[0] or "unknown"

    def _stamp(self, obj: dict[str, Any], old: Mapping[str, Any] | None, table: fm.Managers,
               before: fm.Managers | None) -> None:
        """Render managedFields; unchanged ownership keeps the old rendering (a no-op stays a no-op)."""
        meta = obj.setdefault("metadata", {})
        if old is not None and table == before and "managedFields" in (old.get("metadata") or {}):
            meta["managedFields"] = copy.deepcopy(old["metadata"]["managedFields"])
        elif table:
            meta["managedFields"] = fm.managed_fields(table, obj.get("apiVersion", ""), _now())
        else:
            meta.pop("managedFields", None)

    async def _tracked_update(self, request: rendering.Request, current: dict[str, Any],
                              new: dict[str, Any]) -> dict[str, Any]:
        """A non-apply write (lock held): the writer takes over the fields it changed; writing
        ``managedFields: [{}]`` strips ownership."""
        res, ns, name = request.resource, request.namespace, request.name
        assert res is not None and name is not None
        key = (res, ns, name)
        before = self._managers.get(key)
        table = before
        if (new.get("metadata") or {}).get("managedFields") == [{}]:
            table = {}
        elif before is not None and request.subresource is None:
            table = fm.update(current, new, before, self._manager_of(request))
        if table is not None and request.subresource is None:
            self._stamp(new, current, table, before)
        result = await self.update_object(res, ns, name, new, request.subresource)
        if table is not None:
            self._managers[key] = table
        return result

    async def _serve_apply(self, request: rendering.Request) -> rendering.Payload:
        res, ns, name = request.resource, request.namespace, request.name
        assert res is not None and name is not None
        manager = request.params.get("fieldManager")
        if not manager:
            raise _err(422, "Invalid", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: "
                                       "is required for apply patch")
        if request.subresource is not None:
            raise _err(405, "MethodNotAllowed", f"apply to subresource {request.subresource} is not emulated")
        config = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text or "null")
        if not isinstance(config, dict) or not config.get("apiVersion") or not config.get("kind"):
            raise _err(400, "BadRequest", "an apply configuration must be an object with apiVersion and kind")
        if (config.get("metadata") or {}).get("name") != name:
            raise _err(400, "BadRequest", "the name of the object does not match the name on the URL")
        force = request.params.get("force") == "true"
        async with self._lock:
            key = (res, ns, name)
            current = self._get(res, ns, name)
            before = self._managers.get(key, {}) if current is not None else {}
            try:
                obj, table = fm.apply(current, config, before, manager, force)
            except fm.ApplyConflict as exc:
                raise _err(409, "Conflict", str(exc)) from None
            self._stamp(obj, current, table, before)
            if current is None:
                result = await self.create_object(res, ns, obj)
            else:
                result = await self.update_object(res, ns, name, obj, None)
            self._managers[key] = table
            return result

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        res, ns, name = request.resource, request.namespace, request.name
        self._info(res)
        if res is None or name is None:
            raise _err(405, "MethodNotAllowed", "collection deletion is not emulated")
        options = request.data if isinstance(request.data, Mapping) else {}
        if request.params.get("propagationPolicy"):
            options = {**options, "propagationPolicy": request.params["propagationPolicy"]}
        async with self._lock:
            return await self.delete_object(res, ns, name, options)

    def event_log(self, group: str, version: str, plural: str
                  ) -> list[tuple[int, str, dict[str, Any], dict[str, Any] | None]]:
        """Every watch event of a resource so far: (resourceVersion, type, object, previous object)."""
        return list(self._log.get(references.resource(group, version, plural), []))

    # ----------------------------------------------------------------------------- controllers

    async def _controllers(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=0.2)
            self._kick.clear()
            await asyncio.sleep(0.02)  # let a burst of writes settle, like a controller's work queue
            try:
                async with self._lock:
                    await self._statefulset_controller()
                    await self._job_controller()
            except Exception as exc:  # pragma: no cover - surfaced through kmock's error list
                self._errors[-1].append(exc) if self._errors else None

    def _owned_by(self, res: references.resource) -> dict[str, list[dict[str, Any]]]:
        """Live objects of a resource by their controller's uid (stored objects, read-only): one
        pass per controller round instead of one scan (and copy) of every pod per owner."""
        index: dict[str, list[dict[str, Any]]] = {}
        for obj in self._live(res):
            for ref in obj["metadata"].get("ownerReferences") or []:
                if ref.get("controller") and ref.get("uid"):
                    index.setdefault(ref["uid"], []).append(obj)
        return index

    async def _statefulset_controller(self) -> None:
        sts_res = references.resource("apps", "v1", "statefulsets")
        pod_res = references.resource("", "v1", "pods")
        owned = self._owned_by(pod_res)
        for sts in self._live(sts_res):
            meta, spec = sts["metadata"], sts["spec"]
            if meta.get("deletionTimestamp"):
                continue
            ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
            template = spec["template"]
            revision = f"{name}-{hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]}"
            pods = {p["metadata"]["name"]: p for p in owned.get(uid, []) if p["metadata"].get("namespace") == ns}
            replicas = int(spec.get("replicas", 1))
            for pod in list(pods.values()):
                ordinal = int(pod["metadata"]["name"].rsplit("-", 1)[1])
                phase = (pod.get("status") or {}).get("phase")
                if ordinal >= replicas or phase in ("Failed", "Succeeded"):
                    await self.delete_object(pod_res, ns, pod["metadata"]["name"])
                    pods.pop(pod["metadata"]["name"])
            for ordinal in range(replicas):
                pod_name = f"{name}-{ordinal}"
                if pod_name in pods or self._get(pod_res, ns, pod_name) is not None:
                    continue
                pod_meta = copy.deepcopy(template.get("metadata") or {})
                pod_meta["name"] = pod_name
                pod_meta["namespace"] = ns
                pod_meta.setdefault("labels", {}).update({
                    "statefulset.kubernetes.io/pod-name": pod_name,
                    "apps.kubernetes.io/pod-index": str(ordinal),
                    "controller-revision-hash": revision,
                })
                pod_meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name,
                                                "uid": uid, "controller": True, "blockOwnerDeletion": True}]
                pod_spec = copy.deepcopy(template["spec"])
                pod_spec["hostname"] = pod_name
                pod_spec["subdomain"] = spec.get("serviceName", "")
                pods[pod_name] = await self.create_object(
                    pod_res, ns, {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec},
                    validate=False)
            ready = sum(1 for p in pods.values() if any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in (p.get("status") or {}).get(
                    "conditions") or []))
            status = {"observedGeneration": meta.get("generation", 1), "replicas": len(pods),
                      "readyReplicas": ready, "availableReplicas": ready, "currentReplicas": len(pods),
                      "updatedReplicas": sum(1 for p in pods.values() if p["metadata"]["labels"].get(
                          "controller-revision-hash") == revision),
                      "currentRevision": revision, "updateRevision": revision, "collisionCount": 0}
            if sts.get("status") != status:
                await self.update_object(sts_res, ns, name, {"status": status}, "status", validate=False)

    async def _job_controller(self) -> None:
        job_res = references.resource("batch", "v1", "jobs")
        pod_res = references.resource("", "v1", "pods")
        owned = self._owned_by(pod_res)
        for job in self._live(job_res):
            meta, spec = job["metadata"], job["spec"]
            status = copy.deepcopy(job.get("status") or {})
            conditions = status.get("conditions") or []
            if meta.get("deletionTimestamp") or any(c.get("type") in ("Complete", "Failed") and
                                                    c.get("status") == "True" for c in conditions):
                continue
            ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
            pods = [p for p in owned.get(uid, []) if p["metadata"].get("namespace") == ns]
            phases = [(p.get("status") or {}).get("phase", "Pending") for p in pods]
            succeeded = phases.count("Succeeded")
            failed = phases.count("Failed")
            active = len(phases) - succeeded - failed
            now = _now()
            status.setdefault("startTime", now)
            status.update({"active": active, "succeeded": succeeded, "failed": failed})
            if succeeded:
                status["completionTime"] = now
                status["conditions"] = [
                    {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached",
                     "message": "Reached expected number of succeeded pods", "lastTransitionTime": now,
                     "lastProbeTime": now},
                    {"type": "Complete", "status": "True", "reason": "CompletionsReached",
                     "message": "Reached expected number of succeeded pods", "lastTransitionTime": now,
                     "lastProbeTime": now},
                ]
                status["active"] = 0
            elif failed > int(spec.get("backoffLimit", 6)):
                status["conditions"] = [
                    {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded",
                     "message": "Job has reached the specified backoff limit", "lastTransitionTime": now,
                     "lastProbeTime": now},
                    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                     "message": "Job has reached the specified backoff limit", "lastTransitionTime": now,
                     "lastProbeTime": now},
                ]
                status["active"] = 0
            elif active == 0:
                template = spec["template"]
                pod_meta = copy.deepcopy(template.get("metadata") or {})
                pod_meta["generateName"] = f"{name}-"
                pod_meta["namespace"] = ns
                pod_meta.setdefault("labels", {}).update({
                    "batch.kubernetes.io/job-name": name, "job-name": name,
                    "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                })
                pod_meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
                                                "controller": True, "blockOwnerDeletion": True}]
                await self.create_object(pod_res, ns, {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                                                       "spec": copy.deepcopy(template["spec"])}, validate=False)
                status["active"] = 1
            if status != (job.get("status") or {}):
                await self.update_object(job_res, ns, name, {"status": status}, "status", validate=False)


def resource(kind_path: str) -> references.resource:
    """``'apps/v1/statefulsets'`` → a kmock resource key (for ``emulator.objects[...]``)."""
    return references.resource(kind_path)


__all__ = ["KubeEmulator", "enums", "label_selector_matches", "merge_patch", "resource"]
