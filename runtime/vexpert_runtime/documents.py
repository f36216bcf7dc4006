"""Reading the YAML and JSON files users hand to vexpert (``runtime.yaml``, profiles, deployments).

One ladder of checks for every such file, so each bad file is one ``error: <field>: <problem> (fix:
…)`` line naming the file and, for a syntax error or an invalid value, the line: a missing file, a
file that is not UTF-8, an unreadable one, a YAML/JSON syntax error (PyYAML's own message spans
several lines and names ``"<unicode string>"``), a top level that is not a mapping, and a value the
schema refuses. Torch-free: the operator uses it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from vexpert_runtime.errors import VExpertInputError

Format = Literal["yaml", "json"]


@dataclass(frozen=True)
class Document:
    """A file's parsed content, with its text kept to find a field's line."""

    path: Path
    data: Any
    text: str

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """1-based line of the value at ``loc`` (keys and list indices), or of its closest parent
        that exists; None when the text cannot be composed (it parsed, so rarely)."""
        try:
            node = yaml.compose(self.text)
        except yaml.YAMLError:
            return None
        line = None if node is None else node.start_mark.line + 1
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
                if match is None:
                    break
                line, node = match[0].start_mark.line + 1, match[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                break
        return line


def _syntax_hint(problem: str) -> str:
    if "\t" in problem or "'\\t'" in problem:
        return "indent with spaces, not tabs"
    if any(s in problem for s in ("mapping values are not allowed", "expected <block end>",
                                  "could not find expected ':'", "did not find expected key")):
        return "check its indentation (the keys of one section line up) and quote a value that holds ': '"
    return "it must be valid YAML"


def _read_text(p: Path, field: str, fix: str) -> str:
    if not p.is_file():
        raise VExpertInputError(field, f"no such file: {p}", fix)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise VExpertInputError(field, f"{p} is not UTF-8 text", fix) from None
    except OSError as exc:
        raise VExpertInputError(field, f"cannot read {p}: {exc.strerror}", "check the file's permissions") from None


def _yaml_error(exc: yaml.YAMLError, p: Path, field: str, fix: str) -> VExpertInputError:
    mark = getattr(exc, "problem_mark", None)
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    if mark is None:
        return VExpertInputError(field, f"{p} is not valid YAML: {problem}", fix)
    return VExpertInputError(field, f"{p} line {mark.line + 1}, column {mark.column + 1}: {problem}",
                             f"correct line {mark.line + 1}: {_syntax_hint(problem)}")


def read_document(path: str | Path, field: str, fix: str, fmt: Format = "yaml") -> Document:
    """Read and parse one file whose top level is a mapping (an empty YAML file is ``{}``). Every
    failure is a :class:`VExpertInputError` for ``field`` (the flag that named the file), with
    ``fix`` where nothing more specific helps."""
    p = Path(path)
    text = _read_text(p, field, fix)
    try:
        data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise VExpertInputError(field, f"{p} line {exc.lineno}, column {exc.colno}: not JSON: {exc.msg}",
                                f"correct line {exc.lineno}; {fix}") from None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, p, field, fix) from None
    if data is None and fmt == "yaml":
        data = {}
    if not isinstance(data, dict) and fmt == "json":
        raise VExpertInputError(field, f"{p} is a JSON {type(data).__name__}, not an object", fix)
    if not isinstance(data, dict):
        raise VExpertInputError(field, f"{p} holds a YAML {type(data).__name__}, not a mapping of sections",
                                "the top level must be `section: …` keys")
    return Document(p, data, text)


def read_documents(path: str | Path, field: str, fix: str) -> list[dict[str, Any]]:
    """Every non-empty document of a multi-document YAML file, each a mapping."""
    p = Path(path)
    text = _read_text(p, field, fix)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, p, field, fix) from None
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise VExpertInputError(field, f"{p}: document {i + 1} is a {type(d).__name__}, not a mapping",
                                    "every document must be a Kubernetes object (`apiVersion`, `kind`, …)")
    return docs


_FIXES = {
    "extra_forbidden": "remove the key or correct its spelling",
    "missing": "add it",
    "literal_error": "use one of the values named",
    "enum": "use one of the values named",
}


def validation_error(exc: ValidationError, origin: str, fix: str, document: Document | None = None) -> VExpertInputError:
    """The first of pydantic's errors as one :class:`VExpertInputError`: the field is ``origin``
    (with the line when ``document`` holds the text) and the dotted location."""
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"]) or "(root)"
    line = document.line_of(first["loc"]) if document is not None else None
    where = f"{origin} line {line}" if line is not None else origin
    kind = str(first.get("type", ""))
    specific = _FIXES.get(kind)
    if specific is None and kind.startswith(("greater_than", "less_than", "too_", "multiple_of")):
        specific = "use a value within the bound named"
    if specific is None and kind.endswith(("_type", "_parsing")):
        specific = "write the value as the type named"
    return VExpertInputError(f"{where}: {loc}", str(first["msg"]).removeprefix("Value error, "),
                             specific or fix)
