"""The docs say what the code and the chart do (issue 24: a newcomer found them contradicting it).

* Every ``vexpert <command> … --flag`` quoted in README.md, the operator README, the chart README and
  the benchmarks README names a flag that command takes (the operator README listed
  ``calibrate model --checkpoint PATH --architecture ARCH``).
* Every ``kubectl apply|delete -f PATH`` in those docs and in the chart's NOTES.txt names a file or
  folder of the repository (there were two install manifests; one remains).
* The chart README's values table covers every key of values.yaml (it lacked ``replicaCount``,
  ``leaderElection.*``, ``podDisruptionBudget.enabled``), and no doc calls the operator one replica
  while the chart installs ``replicaCount`` of them.
* The operator README's Code section names every module of the package exactly once.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vexpert_runtime.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "vexpert-operator"
OPERATOR = REPO / "operator" / "vexpert_operator"
DOCS = [REPO / "README.md", OPERATOR / "README.md", CHART / "README.md", REPO / "benchmarks" / "README.md"]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _invocations(text: str) -> list[tuple[str, str]]:
    """(``vexpert …`` command text, where) from code blocks (a line, with its ``\\`` continuations)
    and from code spans in prose (a span may wrap onto the next line)."""
    pieces: list[tuple[str, str]] = []
    blocks = re.split(r"^```.*$", text, flags=re.M)
    for i, chunk in enumerate(blocks):
        where = f"block {i // 2 + 1}" if i % 2 else f"text {i // 2 + 1}"
        if i % 2:  # inside a fenced block
            pieces += [(line, where) for line in re.sub(r"\\\n\s*", " ", chunk).splitlines()]
        else:
            pieces += [(m.group(1).replace("\n", " "), where) for m in re.finditer(r"`([^`]+)`", chunk)]
    found = []
    for piece, where in pieces:
        for m in re.finditer(r"(?:^|[\s(])vexpert ((?:[a-z][\w-]* ?){1,2}[^#|;&]*)", piece):
            found.append((m.group(1), where))
    return found


def test_every_quoted_vexpert_flag_exists() -> None:
    commands = _subcommands(build_parser())
    bad: list[str] = []
    checked = 0
    for doc in DOCS:
        for command, where in _invocations(doc.read_text()):
            words = command.split()
            parser = commands.get(words[0])
            if parser is None:
                continue  # prose ("vexpert slots"), not a command
            rest = words[1:]
            sub = _subcommands(parser)
            if sub and rest and rest[0] in sub:
                parser, rest = sub[rest[0]], rest[1:]
            known = _flags(parser)
            for word in rest:
                flag = word.split("=")[0].rstrip(".,;:)")
                if re.fullmatch(r"--[a-z][\w-]*", flag):
                    checked += 1
                    if flag not in known:
                        bad.append(f"{doc.relative_to(REPO)} {where}: `vexpert {command.strip()}`: no {flag}")
    assert checked > 30, "the scan found almost no flags: the pattern is broken"
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", [*DOCS, CHART / "templates" / "NOTES.txt"], ids=lambda p: str(p.relative_to(REPO)))
def test_kubectl_file_arguments_exist(doc: Path) -> None:
    missing = []
    for m in re.finditer(r"kubectl (?:apply|delete|create)[^\n`]*? -f ([\w./-]+)", doc.read_text()):
        path = m.group(1)
        if path != "-" and not path.startswith(("http", "<")) and not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{doc.relative_to(REPO)} applies files that do not exist: {missing}"


def _leaves(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [leaf for key, sub in values.items() for leaf in _leaves(sub, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def _table_keys(readme: str) -> list[str]:
    """First-column keys of the values table: "`image.repository` / `tag`" → image.repository,
    image.tag; "`settings.*`" stays a wildcard."""
    keys: list[str] = []
    for line in readme.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        parent, end = "", 0
        for m in re.finditer(r"`([^`]+)`", cell):
            key = m.group(1)
            if parent and "/" in cell[end : m.start()]:
                key = parent + key  # "`a.b` / `c`": c is a.c
            else:
                parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
            keys.append(key)
            end = m.end()
    return keys


def test_chart_readme_values_table_covers_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    keys = _table_keys((CHART / "README.md").read_text())
    assert "replicaCount" in keys and "leaderElection.enabled" in keys

    def covered(leaf: str) -> bool:
        return any(leaf == k or leaf.startswith(k.rstrip("*").rstrip(".") + ".") for k in keys)

    uncovered = [leaf for leaf in _leaves(values) if not covered(leaf)]
    assert not uncovered, f"values.yaml keys missing from the chart README's table: {uncovered}"


def test_no_doc_says_the_operator_runs_one_replica() -> None:
    """The chart installs ``replicaCount`` operators (2, leader election, RollingUpdate); the docs
    said "one replica (`Recreate`)" in four places."""
    replicas = yaml.safe_load((CHART / "values.yaml").read_text())["replicaCount"]
    assert replicas == 2
    for doc in [REPO / "README.md", CHART / "README.md", CHART / "templates" / "NOTES.txt"]:
        text = doc.read_text()
        assert not re.search(r"\bone replica\b", text), f"{doc.relative_to(REPO)} says one replica"
    assert f"{replicas} replicas" in (REPO / "README.md").read_text()
    assert f"{replicas} replicas" in (CHART / "README.md").read_text()


def test_operator_readme_code_section_lists_each_module_once() -> None:
    text = (OPERATOR / "README.md").read_text()
    code = text.split("## Code", 1)[1]
    named = re.findall(r"`([\w/]+\.py)`", code)
    modules = sorted(p.name for p in OPERATOR.glob("*.py") if p.name != "__init__.py")
    twice = sorted({n for n in named if named.count(n) > 1})
    assert not twice, f"listed more than once: {twice}"
    assert sorted(set(modules) - set(named)) == [], "modules the Code section leaves out"
    assert sorted(set(named) - set(modules)) == [], "modules the Code section names that do not exist"
