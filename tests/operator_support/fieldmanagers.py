"""Server-side apply for the emulator: field ownership per manager, the apply merge, conflicts.

A small model of the API server's structured-merge-diff, enough for an operator that applies
complete objects:

* a *field* is a path of map keys down to a leaf; a leaf is a scalar, an empty map, or a whole list
  (lists are atomic here: the API server merges some lists by key, e.g. ``containers`` by ``name``,
  but a manager that always applies the whole list sees the same result);
* each object keeps ``{(manager, operation): set of fields}``; an ``Apply`` sets the fields it
  sends, removes the fields it sent last time and no longer sends (unless another manager owns
  them), and takes fields over from other managers when forced; otherwise a field another manager
  owns with a different value is a conflict (409);
* a non-apply write (``Update``: PUT, merge or JSON patch) takes the fields whose value it changed
  away from every other manager;
* ``metadata.managedFields`` is rendered from that table (``FieldsV1``, ``f:<key>`` nesting);
  writing ``[{}]`` with a non-apply write strips it, as on a real server.

Identity fields (apiVersion, kind, metadata.name/namespace) and server-owned metadata are never
owned; ``status`` is not owned through the main resource.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

Field = tuple[str, ...]
Managers = dict[tuple[str, str], set[Field]]

APPLY, UPDATE = "Apply", "Update"
UNOWNED = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}
SERVER_METADATA = {"uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "generation",
                   "managedFields", "deletionGracePeriodSeconds", "generateName", "selfLink"}


class ApplyConflict(Exception):
    def __init__(self, conflicts: list[tuple[str, Field]]) -> None:
        self.conflicts = conflicts
        fields = "; ".join(f'conflict with "{m}": .{".".join(f)}' for m, f in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {fields}")


def fields_of(obj: Mapping[str, Any], prefix: Field = ()) -> set[Field]:
    """The owned-able leaf fields of an object (or of an apply configuration)."""
    out: set[Field] = set()
    for key, value in obj.items():
        path = (*prefix, str(key))
        if not prefix and key == "status":
            continue
        if prefix == ("metadata",) and key in SERVER_METADATA:
            continue
        if path in UNOWNED:
            continue
        if isinstance(value, Mapping) and value:
            out |= fields_of(value, path)
        else:
            out.add(path)
    return out


def value_at(obj: Any, path: Field) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return False, None
        obj = obj[key]
    return True, obj


def _set(obj: dict[str, Any], path: Field, value: Any) -> None:
    for key in path[:-1]:
        child = obj.get(key)
        if not isinstance(child, dict):
            child = obj[key] = {}
        obj = child
    obj[path[-1]] = copy.deepcopy(value)


def _remove(obj: dict[str, Any], path: Field) -> None:
    """Delete a field and the maps it leaves empty (an empty map is not kept by the server)."""
    parents = []
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        parents.append((node, key))
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    for depth, (parent, key) in reversed(list(enumerate(parents))):
        if depth == 0 or parent[key] != {}:
            break  # top-level maps (metadata, spec) stay
        del parent[key]


def _overlaps(a: Field, b: Field) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _owned(paths: Iterable[Field], field: Field) -> bool:
    return any(_overlaps(p, field) for p in paths)


def apply(current: Mapping[str, Any] | None, config: Mapping[str, Any], managers: Managers, manager: str,
          force: bool) -> tuple[dict[str, Any], Managers]:
    """The object after ``manager`` applies ``config``, and the new ownership table."""
    obj = copy.deepcopy(dict(current or {}))
    table = {key: set(paths) for key, paths in managers.items()}
    applied = fields_of(config)
    others = {key: paths for key, paths in table.items() if key != (manager, APPLY)}
    conflicts = []
    for field in sorted(applied):
        _, want = value_at(config, field)
        have_found, have = value_at(obj, field)
        for (name, _), paths in others.items():
            if _owned(paths, field) and (not have_found or have != want):
                conflicts.append((name, field))
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    taken = {field for _, field in conflicts}  # forced: the applier takes them; equal values stay shared
    for key, paths in others.items():
        table[key] = {p for p in paths if not _owned(taken, p)}
    for field in table.get((manager, APPLY), set()) - applied:
        if not _owned(applied, field) and not any(_owned(p, field) for k, p in table.items() if k != (manager, APPLY)):
            _remove(obj, field)
    for field in sorted(applied):
        _set(obj, field, value_at(config, field)[1])
    for field in UNOWNED:  # identity: set, never owned
        found, value = value_at(config, field)
        if found:
            _set(obj, field, value)
    table[(manager, APPLY)] = applied
    return obj, {k: v for k, v in table.items() if v}


def update(old: Mapping[str, Any], new: Mapping[str, Any], managers: Managers, manager: str) -> Managers:
    """Ownership after a non-apply write by ``manager``: it owns what it changed, nobody else does."""
    changed = {f for f in fields_of(old) | fields_of(new) if value_at(old, f) != value_at(new, f)}
    if not changed:
        return managers
    table = {key: {p for p in paths if not _owned(changed, p)} for key, paths in managers.items()}
    table.setdefault((manager, UPDATE), set()).update(changed)
    return {k: v for k, v in table.items() if v}


def managed_fields(managers: Managers, api_version: str, time: str) -> list[dict[str, Any]]:
    """``metadata.managedFields`` as the API server shows it (FieldsV1)."""
    entries = []
    for (name, op), paths in sorted(managers.items()):
        tree: dict[str, Any] = {}
        for path in sorted(paths):
            node = tree
            for key in path:
                node = node.setdefault(f"f:{key}", {})
        entries.append({"manager": name, "operation": op, "apiVersion": api_version, "time": time,
                        "fieldsType": "FieldsV1", "fieldsV1": tree})
    return entries


def parse_managed_fields(entries: Iterable[Mapping[str, Any]]) -> Managers:
    """The inverse of ``managed_fields`` (for tests that read ownership back from an object)."""
    table: Managers = {}

    def walk(node: Mapping[str, Any], prefix: Field, out: set[Field]) -> None:
        if not node:
            out.add(prefix)
        for key, child in node.items():
            walk(child, (*prefix, key[2:]), out)

    for entry in entries:
        paths: set[Field] = set()
        walk(entry.get("fieldsV1") or {}, (), paths)
        table[(entry["manager"], entry["operation"])] = {p for p in paths if p}
    return table
