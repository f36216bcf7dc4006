"""Output paths checked before the work that fills them, so a typo costs no measurement or simulation."""

from __future__ import annotations

import os
from pathlib import Path

from vexpert_runtime.errors import VExpertInputError


def check_output_path(path: str | Path, field: str) -> Path:
    """``path`` as a Path if a file can be written there; else a :class:`VExpertInputError` naming ``field``."""
    p = Path(path)
    if p.is_dir():
        raise VExpertInputError(field, f"{p} is a directory", "pass a file path")
    parent = p.parent
    if not parent.is_dir():
        raise VExpertInputError(field, f"directory {parent} does not exist", "create it or pick another path")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise VExpertInputError(field, f"{p} is not writable", "pick a path you can write to")
    return p
