"""Kubernetes resource quantities ("64Gi", "1.5G", "500m") ↔ numbers. Pure functions."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

_SUFFIX = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?\s*$")

MIB = 2**20
GIB = 2**30


def parse_quantity(value: str | int | float) -> Decimal:
    """Parse a quantity into its value in base units (bytes for memory, cores for CPU)."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _RE.match(str(value))
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex already guarantees a number
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None
    return number * _SUFFIX[match.group(2) or ""]


def parse_bytes(value: str | int | float) -> int:
    """A memory quantity in whole bytes (rounded up)."""
    return math.ceil(parse_quantity(value))


def format_mebibytes(nbytes: int) -> str:
    """Bytes → ``"<n>Mi"``, rounded up to a whole MiB (what the kubelet accounts in)."""
    return f"{max(0, math.ceil(nbytes / MIB))}Mi"


def format_bytes_human(nbytes: int) -> str:
    """Bytes → a short human string for messages (GiB with one decimal)."""
    return f"{nbytes / GIB:.1f} GiB"
