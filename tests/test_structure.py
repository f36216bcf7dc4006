"""The code's shape, held as tests (issue 23): rooms with one job each stay that way.

In ``runtime/vexpert_runtime`` and ``operator/vexpert_operator``: no class over 400 lines, no
function over 100, no import cycle between modules, and the model-family names spelled in one
module. Read with :mod:`ast` only (nothing is imported, so the checks need neither torch nor a GPU),
and every check lists all of its offenders, not the first.

The architecture page (``docs/architecture.md``) stays true with the code: every file it names exists,
and its table of the runtime's rooms lists every module where it lives.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (source root, top-level package): the two packages whose structure is held
PACKAGES = (("runtime", "vexpert_runtime"), ("operator", "vexpert_operator"))

MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 100
FAMILY_NAME = "deepseek_v3"  # one family's name: where it sits in a ``Literal``, the family names are defined
# (a Literal that also holds names that are not families — "hermes", a tool-call format — is another list)
FAMILY_LITERAL_VALUES = {"deepseek_v3", "qwen2_moe", "auto"}


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as imported: ``vexpert_runtime.node.supervisor``; a package is its ``__init__``
    path: Path
    is_package: bool

    @property
    def where(self) -> str:
        return str(self.path.relative_to(REPO))


@cache
def modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for root, package in PACKAGES:
        base = REPO / root
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            found[name] = Module(name, path, is_package)
    return found


@cache
def tree(module: Module) -> ast.Module:
    return ast.parse(module.path.read_text(), filename=str(module.path))


def span(node: ast.stmt) -> int:
    """Lines from the ``def``/``class`` line to the last one (decorators not counted)."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def oversized(kinds: tuple[type[ast.stmt], ...], limit: int) -> list[str]:
    """Every definition of these kinds, nested ones included, longer than ``limit`` lines."""
    offenders = []
    for module in modules().values():
        for node in ast.walk(tree(module)):
            if isinstance(node, kinds) and span(node) > limit:
                name = getattr(node, "name", "?")
                offenders.append(f"{module.where}:{node.lineno} {name} ({span(node)} lines)")
    return offenders


def test_no_class_is_over_400_lines() -> None:
    offenders = oversized((ast.ClassDef,), MAX_CLASS_LINES)
    assert not offenders, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(offenders)


def test_no_function_is_over_100_lines() -> None:
    offenders = oversized((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


# ------------------------------------------------------------------------------------------- imports


def absolute_base(module: Module, node: ast.ImportFrom) -> str:
    """The module a ``from … import`` reads from, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    # a package's ``from . import x`` is relative to the package itself, a module's to its package
    parts = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def imported_modules(module: Module) -> Iterator[str]:
    """The package's modules that ``module`` imports, wherever the import stands (inside a function,
    under ``TYPE_CHECKING``): each is a dependency, and a cycle through it is one all the same.
    ``from pkg import sub`` depends on ``pkg.sub`` when that is a module, else on ``pkg`` itself."""
    known = modules()
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    yield submodule
                elif base in known:
                    yield base


def import_graph() -> dict[str, set[str]]:
    return {name: set(imported_modules(module)) - {name} for name, module in modules().items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iterative (no recursion limit); the ones of two or more modules are the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph[successor]))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return components


def cycle_report(component: list[str], graph: dict[str, set[str]]) -> str:
    """A cycle's modules and the imports that tie them, e.g. ``a -> b, b -> a``."""
    members = set(component)
    edges = [f"{source} -> {target}" for source in component for target in sorted(graph[source] & members)]
    return f"{' ↔ '.join(component)}: " + ", ".join(edges)


def test_strongly_connected_finds_cycles_and_leaves_chains() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]


def test_relative_imports_resolve_against_the_module_or_package() -> None:
    module = Module("pkg.sub.mod", Path("mod.py"), is_package=False)
    package = Module("pkg.sub", Path("__init__.py"), is_package=True)
    parse = lambda text: ast.parse(text).body[0]  # noqa: E731
    assert absolute_base(module, parse("from . import x")) == "pkg.sub"
    assert absolute_base(module, parse("from ..other import x")) == "pkg.other"
    assert absolute_base(package, parse("from . import x")) == "pkg.sub"
    assert absolute_base(package, parse("from .. import x")) == "pkg"
    assert absolute_base(module, parse("from pkg.abs import x")) == "pkg.abs"


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    cycles = [cycle_report(c, graph) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(cycles)


# ------------------------------------------------------------------------------------ model families


def is_literal(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Literal") or \
        (isinstance(node, ast.Attribute) and node.attr == "Literal")


def family_literals() -> list[str]:
    """Every ``Literal[...]`` that spells a model family's name."""
    found = []
    for module in modules().values():
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Subscript) and is_literal(node.value):
                values = {c.value for c in ast.walk(node.slice) if isinstance(c, ast.Constant)}
                if FAMILY_NAME in values and values <= FAMILY_LITERAL_VALUES:
                    found.append(f"{module.where}:{node.lineno}")
    return found


def test_the_model_family_names_are_defined_in_one_module() -> None:
    found = family_literals()
    assert len(found) == 1, (
        f"the model-family names must be one Literal in one module (the family registry), which the "
        f"config and the operator's API import; Literal[...] with {FAMILY_NAME!r} found at: {found or 'nowhere'}")


# ------------------------------------------------------------------------------ the architecture page

ARCHITECTURE = REPO / "docs" / "architecture.md"
RUNTIME = REPO / "runtime" / "vexpert_runtime"
# where a path the page names may start (it names runtime modules from inside the package)
PATH_ROOTS = (REPO, REPO / "runtime", RUNTIME, REPO / "operator" / "vexpert_operator")
PY_PATH = re.compile(r"(?<![\w/.])((?:[\w*]+/)*[\w*]+\.py)\b")


def package_files() -> list[Path]:
    return [module.path for module in modules().values()]


def named_file_exists(name: str) -> bool:
    """A path with folders exists under one of :data:`PATH_ROOTS` (``*`` a wildcard); a bare file
    name is some module's of the two packages."""
    if "/" not in name:
        return any(path.match(name) for path in package_files())
    return any(any(root.glob(name)) for root in PATH_ROOTS)


def architecture_rooms() -> dict[str, list[str]]:
    """The page's table of the runtime's rooms: folder (``""`` for the package's top level) → the
    modules its row lists (``attention*``: several; ``commands/*``: a folder)."""
    rooms: dict[str, list[str]] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        folder = re.fullmatch(r"`(\w+)/`", cells[0])
        if len(cells) > 2 and (folder or cells[0] == "top level"):
            rooms[folder.group(1) if folder else ""] = re.findall(r"`([\w*/]+)`", cells[1])
    return rooms


def listed_modules(folder: str, name: str) -> list[Path]:
    return sorted((RUNTIME / folder).glob(f"{name}.py"))


def test_every_file_the_architecture_page_names_exists() -> None:
    missing = sorted({name for name in PY_PATH.findall(ARCHITECTURE.read_text()) if not named_file_exists(name)})
    assert not missing, "docs/architecture.md names files that do not exist: " + ", ".join(missing)


def test_the_architecture_page_lists_every_runtime_module_in_its_room() -> None:
    """A module added, moved or removed shows up here until the page's room table says so."""
    rooms = architecture_rooms()
    assert rooms, "docs/architecture.md has no table of the runtime's rooms"
    listed: set[Path] = set()
    unknown = []
    for folder, names in rooms.items():
        for name in names:
            found = listed_modules(folder, name)
            listed.update(found)
            if not found:
                unknown.append(f"{folder or '(top level)'}: {name}")
    actual = {path for path in RUNTIME.rglob("*.py") if path.stem not in ("__init__", "__main__")}
    unlisted = sorted(str(path.relative_to(RUNTIME)) for path in actual - listed)
    assert not unknown and not unlisted, (
        "docs/architecture.md's room table is out of date:\n"
        f"  listed but not in the package: {unknown}\n  in the package but not listed: {unlisted}")
