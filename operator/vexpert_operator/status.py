"""Status helpers: conditions with stable transition times, phase from conditions. Pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .api import Condition, VExpertDeploymentStatus

CONDITION_TYPES = ("Invalid", "Calibrated", "Progressing", "Ready", "Degraded")


def set_condition(conditions: Sequence[Condition], type_: str, status: bool | None, reason: str, message: str,
                  now: str, generation: int | None) -> list[Condition]:
    """Replace (or add) one condition; ``lastTransitionTime`` moves only when the status flips."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type == type_:
            found = True
            changed = cond.status != value
            out.append(Condition(type=type_, status=value, reason=reason, message=message,
                                 last_transition_time=now if changed or not cond.last_transition_time
                                 else cond.last_transition_time,
                                 observed_generation=generation))
        else:
            out.append(cond)
    if not found:
        out.append(Condition(type=type_, status=value, reason=reason, message=message,
                             last_transition_time=now, observed_generation=generation))
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(c.type, len(order)))


def get_condition(status: VExpertDeploymentStatus, type_: str) -> Condition | None:
    for cond in status.conditions:
        if cond.type == type_:
            return cond
    return None


def is_true(status: VExpertDeploymentStatus, type_: str) -> bool:
    cond = get_condition(status, type_)
    return cond is not None and cond.status == "True"


def status_patch(status: VExpertDeploymentStatus) -> dict:
    """The status as the API stores it (camelCase, no nulls)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def merge_patch_between(stored: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch turning ``stored`` into ``desired``.

    A merge patch keeps every key it does not mention, so a field that became null (e.g. the
    balance ratio when a scrape found no pods) must be sent as an explicit null or the stale value
    stays. Lists are replaced whole, as merge patches do.
    """
    patch: dict[str, Any] = {}
    for key in stored.keys() - desired.keys():
        patch[key] = None
    for key, value in desired.items():
        old = stored.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            nested = merge_patch_between(old, value)
            if nested:
                patch[key] = nested
        elif value != old or key not in stored:
            patch[key] = value
    return patch
