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
        message = f"{field}: {problem}"
        if fix:
            message += f" (fix: {fix})"
        super().__init__(message)
