"""The frontend imports of the worker only its public surface: the package itself, for
``validate_worker_args``, and ``worker_ingress.engines``. (The other package boundaries are
import-linter contracts in pyproject.toml, checked by ``scripts/check``.)
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
