"""The layout of the product packages: the frontend imports of the worker only its public
surface (the package itself, for ``local_worker_parameters`` and ``validate_worker_args``, and
``worker_ingress.engines``), no import circle, and every module, there and in the benchmarks,
the examples and the tests, says what it is, with the few past the look-again size named. (The
other package boundaries are import-linter contracts in pyproject.toml, checked by
``scripts/check``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRONTEND_MAY_IMPORT = {"worker_ingress", "worker_ingress.engines"}


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports (``from X import y`` also counts as ``X.y``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules_of("frontend_shim"), ids=str)
def test_the_frontend_imports_only_the_public_surface_of_the_worker(path: Path) -> None:
    worker = {m for m in imported_modules(path) if m.split(".")[0] == "worker_ingress"}
    assert worker <= FRONTEND_MAY_IMPORT


# -- doors open one way: no import circle, hidden or not ---------------------------------------

PACKAGES = ("shim_common", "worker_ingress", "frontend_shim")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Every module of the three packages -> the modules of them it imports, anywhere in the
    file: at the top, under ``if TYPE_CHECKING:`` and inside functions alike."""
    paths = {_module_name(p): p for package in PACKAGES for p in modules_of(package)}

    def owner(name: str) -> str | None:
        # ``from a.b import c`` names a module ``a.b.c`` or a name in ``a.b``: the longest match.
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for name in names:
                target = owner(name)
                if target is not None and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules() -> None:
    assert _circles(_import_graph()) == []


# -- rooms by concept: each module says what it is ---------------------------------------------

#: Where every module says what it is: the product packages, the benchmarks, the examples and
#: the tests.
DESCRIBED_FOLDERS = (*PACKAGES, "bench", "examples", "tests")
#: A module past this many lines is looked at again: either it holds more than one concept and
#: is split where its concept splits, or it is one and is named in :data:`LOOKED_AT`. Not a
#: limit to stay under: a room is split by what it does, never by its count of lines.
LOOK_AGAIN_LINES = 1500
#: The modules past :data:`LOOK_AGAIN_LINES` that were looked at and are one concept, each with
#: why (a path relative to the repository's root -> the reason).
LOOKED_AT: dict[str, str] = {}


def _described_modules() -> list[Path]:
    return [path for folder in DESCRIBED_FOLDERS for path in modules_of(folder)]


@pytest.mark.parametrize("path", _described_modules(), ids=str)
def test_every_module_says_what_it_is(path: Path) -> None:
    text = path.read_text()
    if not text.strip():
        return  # an empty package marker holds nothing to describe
    docstring = ast.get_docstring(ast.parse(text, str(path)))
    assert docstring, f"{path.relative_to(ROOT)} has no docstring saying what it is"


def test_a_module_past_the_look_again_size_was_looked_at() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in _described_modules()
    }
    big = {name for name, lines in sizes.items() if lines > LOOK_AGAIN_LINES}
    unexplained = {name: sizes[name] for name in sorted(big - LOOKED_AT.keys())}
    assert not unexplained, (
        f"past {LOOK_AGAIN_LINES} lines: {unexplained}; split each where its concept splits, or"
        " name it in LOOKED_AT with why it is one concept"
    )
    assert not LOOKED_AT.keys() - big, "LOOKED_AT names a module no longer past the size"
