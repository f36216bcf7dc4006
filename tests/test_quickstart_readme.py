"""README's quick-start tables are what scripts/demo.sh's `vexpert simulate` and the "where it does
not win" sweep print (issue 24: the README had rows the demo never printed and lacked rows it did).

Cheap enough for every run (≈ 10 s): the README blocks equal the saved outputs in
benchmarks/results/quickstart/, those were made by the commands demo.sh runs today, and the
static and EPLB rows reproduce now from a fresh trace. ``scripts/readme_quickstart.py write``
regenerates everything after a change that moves the numbers.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_quickstart", REPO / "scripts" / "readme_quickstart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_quickstart_tables_are_the_commands_output() -> None:
    problems = load_script().check()
    assert not problems, "\n".join(problems)


def test_a_changed_readme_row_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check compares numbers, not just the presence of a block: one digit changed fails it."""
    script = load_script()
    readme = tmp_path / "README.md"
    text = script.README.read_text()
    edited = re.sub(r"(\nvexpert {2,}0\.8)39", r"\g<1>40", text, count=1)
    assert edited != text
    readme.write_text(edited)
    monkeypatch.setattr(script, "README", readme)
    monkeypatch.setattr(script, "run", lambda command, cwd, extra=None: script.SAVED.joinpath("simulate.txt").read_text())
    problems = script.check()
    assert any("quickstart:simulate" in p for p in problems)


def test_the_readme_names_every_quickstart_command() -> None:
    """The blocks sit next to the commands that print them: demo.sh's simulate in the quick start,
    the sweep's command inside its block."""
    script = load_script()
    readme = script.README.read_text()
    assert "./scripts/demo.sh" in readme
    assert f"$ {script.SWEEP}" in readme
