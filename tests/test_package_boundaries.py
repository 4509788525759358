"""Imports flow serve -> {models, methods, cache} -> kernels, and each package declares what it imports."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "sparse_kernels": set(),
    "sparse_methods": {"sparse_kernels"},
    "sparse_cache": {"sparse_kernels"},
    "sparse_models": {"sparse_kernels"},
    "sparse_serve": {"sparse_kernels", "sparse_methods", "sparse_cache", "sparse_models"},
}


def _imported_sparse_packages(src: Path, own: str) -> set[str]:
    found = set()
    for file in src.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found.update(n.split(".")[0] for n in names if n.startswith("sparse_"))
    return found - {own}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction_and_declared_dependencies(package):
    pkg_dir = ROOT / "packages" / package.replace("_", "-")
    imported = _imported_sparse_packages(pkg_dir / "src" / package, package)
    assert imported <= ALLOWED[package], f"{package} imports {sorted(imported - ALLOWED[package])}"
    deps = tomllib.loads((pkg_dir / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {d.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for d in deps}
    assert imported == {d for d in declared if d.startswith("sparse_")}, "declared workspace deps != imports"
