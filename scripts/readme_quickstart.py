#!/usr/bin/env python3
"""README's quick-start tables are what the commands print.

The quick start's simulation table in README.md is the output of the ``vexpert simulate`` command
in scripts/demo.sh, and the "where it does not win" table is the output of SWEEP below, both kept
verbatim (with the commands) in benchmarks/results/quickstart/ and copied into README between
``<!-- quickstart:NAME -->`` markers.

  scripts/readme_quickstart.py write    # run the commands (≈ 1–2 min quiet), save outputs, rewrite README
  scripts/readme_quickstart.py check    # cheap (≈ 10 s): README = saved outputs, saved commands =
                                        # demo.sh's, and the static/EPLB rows reproduce now

tests/test_quickstart_readme.py runs ``check`` in the suite.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "scripts" / "demo.sh"
README = REPO / "README.md"
SAVED = REPO / "benchmarks" / "results" / "quickstart"
TRACE = "out/deepseek-v3-drift.npz"
# EPLB with one redundant expert per GPU (its strong, global policy) rebalanced every 10 and every 500
# iterations, with its own even split and with the same per-iteration all-reduced dispatch as vexpert.
SWEEP = (f"vexpert simulate {TRACE} --gpus 64 --nodes 8 --k 10 --group-size 2 --vmax 1 --warmup 50 "
         "--policies static --eplb-policy global --eplb-sweep 10,500")
CHEAP_POLICIES = "static,eplb,eplb-redundant"  # rows `check` re-runs: seconds, not minutes


def demo_commands() -> dict[str, str]:
    """The ``vexpert trace build`` and ``vexpert simulate`` commands of demo.sh (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", DEMO.read_text())
    found = {}
    for line in text.splitlines():
        line = line.strip()
        for name in ("trace build", "simulate"):
            if line.startswith(f"vexpert {name} "):
                found[name] = " ".join(line.split())
    missing = {"trace build", "simulate"} - set(found)
    if missing:
        raise SystemExit(f"scripts/demo.sh runs no `vexpert {' / '.join(sorted(missing))}`")
    return found


def run(command: str, cwd: Path, extra: list[str] | None = None) -> str:
    """stdout of a ``vexpert`` command line (its --plot dropped), run with this Python's vexpert."""
    argv = shlex.split(command)
    if "--plot" in argv:
        i = argv.index("--plot")
        del argv[i : i + 2]
    argv = [sys.executable, "-m", "vexpert_runtime", *argv[1:], *(extra or [])]
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"`{command}` failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def table(output: str) -> list[str]:
    """The table of a ``vexpert simulate`` run: header, rule and one line per policy (no timing line)."""
    lines = output.rstrip("\n").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    rows = lines[start:]
    end = next((i for i, line in enumerate(rows) if not line.strip()), len(rows))
    return rows[:end]


def saved(name: str) -> tuple[str, list[str]]:
    """(command, table) of a saved output: its first line is ``$ command``."""
    path = SAVED / f"{name}.txt"
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(REPO)} is missing: run scripts/readme_quickstart.py write")
    first, _, rest = path.read_text().partition("\n")
    return first.removeprefix("$ "), table(rest)


def block(name: str, command: str | None, rows: list[str]) -> str:
    body = (f"$ {command}\n" if command else "") + "\n".join(rows)
    return (f"<!-- quickstart:{name} (scripts/readme_quickstart.py write; do not edit) -->\n"
            f"```\n{body}\n```\n<!-- /quickstart:{name} -->")


def readme_block(text: str, name: str) -> str:
    match = re.search(rf"<!-- quickstart:{name} .*?<!-- /quickstart:{name} -->", text, flags=re.S)
    if not match:
        raise SystemExit(f"README.md has no quickstart:{name} block")
    return match.group(0)


def expected_blocks() -> dict[str, str]:
    _, sim_rows = saved("simulate")
    sweep_command, sweep_rows = saved("eplb_sweep")
    return {"simulate": block("simulate", None, sim_rows), "eplb-sweep": block("eplb-sweep", sweep_command, sweep_rows)}


def write() -> None:
    commands = demo_commands()
    SAVED.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "out").mkdir()
        run(commands["trace build"], work)
        for name, command in (("simulate", commands["simulate"]), ("eplb_sweep", SWEEP)):
            out = run(command, work)
            (SAVED / f"{name}.txt").write_text(f"$ {command}\n{out}")
            print(f"saved {SAVED.relative_to(REPO)}/{name}.txt")
    text = README.read_text()
    for name, new in expected_blocks().items():
        text = text.replace(readme_block(text, name), new)
    README.write_text(text)
    print("README.md quick-start blocks rewritten")


def check() -> list[str]:
    """Every mismatch, as a line (empty: README is what the commands print)."""
    problems = []
    commands = demo_commands()
    sim_command, sim_rows = saved("simulate")
    if sim_command != commands["simulate"]:
        problems.append(f"benchmarks/results/quickstart/simulate.txt was made by `{sim_command}`, "
                        f"demo.sh runs `{commands['simulate']}`: run scripts/readme_quickstart.py write")
    sweep_command, _ = saved("eplb_sweep")
    if sweep_command != SWEEP:
        problems.append("benchmarks/results/quickstart/eplb_sweep.txt is not SWEEP's output: run write")
    text = README.read_text()
    for name, want in expected_blocks().items():
        if readme_block(text, name) != want:
            problems.append(f"README.md's quickstart:{name} block differs from the saved output: run write")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "out").mkdir()
        run(commands["trace build"], work)
        now = table(run(commands["simulate"], work, ["--policies", CHEAP_POLICIES]))
    by_name = {row.split()[0]: row for row in sim_rows[2:]}
    for row in now[2:]:
        name = row.split()[0]
        if by_name.get(name) != row:
            problems.append(f"demo.sh's simulate prints today\n  {row}\nREADME has\n  {by_name.get(name)}")
    return problems


def main(argv: list[str]) -> int:
    if argv[1:] == ["write"]:
        write()
        return 0
    if argv[1:] == ["check"]:
        problems = check()
        print("\n".join(problems) if problems else "README quick-start tables match the commands' output")
        return 1 if problems else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
