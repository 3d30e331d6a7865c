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


def _import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Every module of the packages -> the modules of them it imports, anywhere in the file: at
    the top, under ``if TYPE_CHECKING:`` and inside functions alike."""
    paths = {_module_name(p): p for package in packages for p in modules_of(package)}

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


# -- bench/: entry points over one kit ---------------------------------------------------------
#
# A module at the top of bench/ is a script: a benchmark's entry point (or a child process one
# starts), with a ``__main__`` guard; no script imports another. What benchmarks of different
# families share is the kit (bench/kit/), which imports nothing else of bench/. A family's own
# pieces live in a folder of its own, whose ``__init__`` names the scripts it serves in
# ``SCRIPTS``: only they, and the folder's own modules, import it.

BENCH_KIT = "bench.kit"


def _is_script(path: Path) -> bool:
    """The module has an ``if __name__ == "__main__":`` at its top level."""
    for node in ast.parse(path.read_text(), str(path)).body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
        ):
            return True
    return False


def _family_scripts(init: Path) -> tuple[str, ...]:
    """The ``SCRIPTS`` a family folder's ``__init__`` names (none when it names none)."""
    for node in ast.parse(init.read_text(), str(init)).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "SCRIPTS" for t in targets):
                scripts: tuple[str, ...] = ast.literal_eval(node.value)
                return scripts
    return ()


def _bench_layout_faults(
    graph: dict[str, set[str]], scripts: set[str], families: dict[str, tuple[str, ...]]
) -> list[str]:
    """What breaks the rules above in ``graph`` (bench's modules -> those of bench they import).

    Args:
        graph: Every module of bench/ and the modules of bench/ it imports.
        scripts: The top-level modules that are scripts (``bench.NAME``).
        families: Each family folder (``bench.NAME``) and the scripts it serves (bare names).
    """
    faults = []
    for module, targets in sorted(graph.items()):
        parts = module.split(".")
        if len(parts) == 2 and module not in scripts | families.keys() | {BENCH_KIT}:
            faults.append(f"{module} is at the top of bench/ but has no __main__ guard")
        folder = ".".join(parts[:2]) if len(parts) > 2 else None
        for target in sorted(targets):
            home = ".".join(target.split(".")[:2])
            if target in scripts:
                faults.append(f"{module} imports the script {target}")
            elif module.startswith(BENCH_KIT + ".") and not target.startswith(BENCH_KIT):
                faults.append(f"the kit's {module} imports {target}, outside the kit")
            elif home in families and home != folder:
                allowed = {f"bench.{name}" for name in families[home]}
                if module not in allowed:
                    faults.append(f"{module} imports {target}, of a family it does not belong to")
    for family, served in sorted(families.items()):
        if not served:
            faults.append(f"{family} names no SCRIPTS it serves")
        faults += [
            f"{family} serves {name}, no script"
            for name in served
            if f"bench.{name}" not in scripts
        ]
    return faults


def test_the_bench_layout_rules_find_what_breaks_them() -> None:
    graph = {
        "bench.a": {"bench.b", "bench.kit.x"},  # a script importing a script
        "bench.b": {"bench.fam.y"},  # a family's piece used by a script it does not serve
        "bench.helper": set(),  # no __main__ guard at the top
        "bench.kit.x": {"bench.fam.y"},  # the kit reaching out
        "bench.fam.y": {"bench.kit.x"},
    }
    faults = _bench_layout_faults(graph, {"bench.a", "bench.b"}, {"bench.fam": ("a", "gone")})
    assert faults == [
        "bench.a imports the script bench.b",
        "bench.b imports bench.fam.y, of a family it does not belong to",
        "bench.helper is at the top of bench/ but has no __main__ guard",
        "the kit's bench.kit.x imports bench.fam.y, outside the kit",
        "bench.fam serves gone, no script",
    ]


def test_bench_is_entry_points_over_one_kit_without_import_circles() -> None:
    graph = _import_graph(("bench",))
    assert _circles(graph) == []
    graph.pop("bench")  # the package itself: its __init__ holds nothing
    top = [p for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py"]
    scripts = {_module_name(p) for p in top if _is_script(p)}
    families = {
        _module_name(init.parent): _family_scripts(init)
        for init in (ROOT / "bench").glob("*/__init__.py")
        if init.parent.name != "kit"
    }
    assert _bench_layout_faults(graph, scripts, families) == []


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
