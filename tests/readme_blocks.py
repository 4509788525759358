"""The ```python blocks of a README, and the top-level modules each one imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["sparse-kernels", "sparse-methods", "sparse-cache", "sparse-models", "sparse-serve"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme(package: str) -> Path:
    return ROOT / "packages" / package / "README.md"


def python_blocks(path: Path) -> list[str]:
    return _BLOCK.findall(path.read_text())


def imported_modules(code: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found
