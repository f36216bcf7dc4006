"""One error type for bad user input, so the CLI can print one clear line and exit 2."""

from __future__ import annotations


class VExpertInputError(ValueError):
    """Bad input from a user: names the offending field and how to fix it.

    The CLI turns it into a single ``error: <field>: <problem> (<fix>)`` line and exit code 2.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        # what follows the field's name: a process that passes the error on by field and text sends this
        self.detail = f"{problem} (fix: {fix})" if fix else problem
        super().__init__(f"{field}: {self.detail}")


def require_at_least(flag: str, value: float | None, minimum: float, meaning: str) -> None:
    """Refuse a flag below its minimum in the promised form: ``--cpu-workers: must be ≥ 1, got 0
    (fix: pass --cpu-workers 1 or more: <meaning>)``. ``None`` (flag not given) passes."""
    if value is not None and value < minimum:
        raise VExpertInputError(flag, f"must be ≥ {minimum:g}, got {value:g}", f"pass {flag} {minimum:g} or more: {meaning}")


CPU_WORKERS_MEANING = "one CPU worker process per EP rank; leave the flag out on a GPU node for one worker per GPU"
