"""Imports flow serve -> {models, methods, cache} -> kernels, and each package declares what it imports.

A workspace package imported at module level is a dependency; one imported only inside functions
(``sparse_methods`` calls ``sparse_kernels`` only from the query-aware methods' batched selection) may
be an optional one (an extra). Every internal requirement names a compatible version range that admits
the version in the tree, so a wheel never accepts an incompatible sibling.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "sparse_kernels": set(),
    "sparse_methods": {"sparse_kernels"},
    "sparse_cache": {"sparse_kernels"},
    "sparse_models": {"sparse_kernels"},
    "sparse_serve": {"sparse_kernels", "sparse_methods", "sparse_cache", "sparse_models"},
}


def _sparse_names(node: ast.AST) -> set[str]:
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module]
    return {n.split(".")[0] for n in names if n.startswith("sparse_")}


def _imports(src: Path, own: str) -> tuple[set[str], set[str]]:
    """Workspace packages imported at module level, and those imported anywhere."""
    top, anywhere = set(), set()
    for file in src.rglob("*.py"):
        tree = ast.parse(file.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        inside = {id(n) for f in functions for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = _sparse_names(node)
            anywhere |= names
            if id(node) not in inside:
                top |= names
    return top - {own}, anywhere - {own}


def _project(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package.replace("_", "-") / "pyproject.toml").read_text())["project"]


def _internal(requirements: list[str]) -> dict[str, Requirement]:
    reqs = map(Requirement, requirements)
    return {r.name.replace("-", "_"): r for r in reqs if r.name.startswith("sparse-")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction_and_declared_dependencies(package):
    top, anywhere = _imports(ROOT / "packages" / package.replace("_", "-") / "src" / package, package)
    assert anywhere <= ALLOWED[package], f"{package} imports {sorted(anywhere - ALLOWED[package])}"
    project = _project(package)
    required = set(_internal(project["dependencies"]))
    optional = {name for extra in project.get("optional-dependencies", {}).values() for name in _internal(extra)}
    assert top == required, "workspace packages imported at module level != declared dependencies"
    assert anywhere == required | optional, "workspace packages imported in functions != declared (optional) deps"


def test_internal_requirements_carry_compatible_versions():
    for package in sorted(ALLOWED):
        project = _project(package)
        lists = [project["dependencies"], *project.get("optional-dependencies", {}).values()]
        for name, req in (item for reqs in lists for item in _internal(reqs).items()):
            ops = {spec.operator for spec in req.specifier}
            assert ops == {">=", "<"} or ops == {"~="}, f"{package} needs {req}: give a compatible range"
            assert Version(_project(name)["version"]) in req.specifier, f"{req} excludes the tree's {name}"
