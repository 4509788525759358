"""Every package builds a wheel with ``uv build --package NAME``, and ``sparse-kernels`` and
``sparse-methods`` each install alone from their wheels into a fresh venv (no workspace, no source
tree on the path) and run their README's examples there.

The fresh venvs get torch and the other third-party requirements through ``uv pip install``,
constrained to the versions in ``uv.lock``: uv links them from its cache (the workspace install put
them there), offline when the cache has the index pages too, otherwise through the registry for
metadata only. The workspace's own site-packages are never shared with the venv, since that would
also expose the workspace packages, their editable sources and undeclared dependencies, which is
what this test must rule out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import ROOT, imported_modules, python_blocks, readme

PACKAGES = ["sparse-kernels", "sparse-methods", "sparse-cache", "sparse-models", "sparse-serve"]


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` sets UV to its own executable
    if uv is None:
        pytest.skip("uv is not available")
    return uv


def _run(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(list(map(str, args)), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{proc.args}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    for package in PACKAGES:
        _check(_run(_uv(), "build", "--package", package, "--wheel", "--out-dir", dist, cwd=ROOT))
    return dist


def _fresh_venv(tmp: Path, wheels: Path, package: str, requirement: str) -> Path:
    """A venv holding ``requirement`` installed from ``wheels`` (and its third-party deps at the locked versions)."""
    uv = _uv()
    constraints = tmp / "constraints.txt"
    locked = _run(uv, "export", "--frozen", "--package", package, "--all-extras", "--no-dev", "--no-hashes",
                  "--no-emit-workspace", "--format", "requirements-txt", cwd=ROOT)  # fmt: skip
    constraints.write_text(_check(locked))
    venv = tmp / "venv"
    _check(_run(uv, "venv", "--quiet", venv, "--python", sys.executable))
    python = venv / "bin" / "python"
    # No bytecode compiled at install (the project's `compile-bytecode` would apply here too): the examples run once.
    install = [uv, "pip", "install", "--python", python, "--no-compile-bytecode", "--find-links", wheels, "-c",
               constraints, requirement]  # fmt: skip
    if _run(*install[:3], "--offline", *install[3:]).returncode != 0:
        _check(_run(*install))  # the cache lacked index pages: resolve online, wheels still come from the cache
    return python


def _run_blocks(python: Path, tmp: Path, blocks: list[str], epilogue: str = "") -> str:
    script = tmp / "example.py"
    script.write_text("\n".join(blocks) + "\n" + epilogue)
    return _check(_run(python, "-I", script, cwd=tmp))  # -I: no PYTHONPATH, no script folder, no user site


def _installed(python: Path) -> set[str]:
    listing = "import importlib.metadata as m; print(*(d.name for d in m.distributions()))"
    out = _check(_run(python, "-I", "-c", listing))
    return set(out.split())


def test_every_package_builds(wheels):
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert names == sorted(p.replace("-", "_") for p in PACKAGES)


def test_sparse_kernels_alone(wheels, tmp_path):
    python = _fresh_venv(tmp_path, wheels, "sparse-kernels", "sparse-kernels")
    assert not {p for p in _installed(python) if p.startswith("sparse") and p != "sparse-kernels"}
    blocks = python_blocks(readme("sparse-kernels"))
    assert blocks
    epilogue = "import sparse_kernels, sys\nassert sys.prefix in sparse_kernels.__file__\nprint('ok')\n"
    assert _run_blocks(python, tmp_path, blocks, epilogue).endswith("ok\n")


def test_sparse_methods_alone(wheels, tmp_path):
    """Without sparse-kernels: the eviction example runs, nothing imports Triton or sparse_kernels, and the
    registry still lists the query-aware methods (their batched path imports kernels when it runs)."""
    python = _fresh_venv(tmp_path, wheels, "sparse-methods", "sparse-methods")
    assert not {p for p in _installed(python) if p.startswith("sparse") and p != "sparse-methods"}
    blocks = python_blocks(readme("sparse-methods"))
    plain = [b for b in blocks if "transformers" not in imported_modules(b)]
    hf = [b for b in blocks if "transformers" in imported_modules(b)]
    assert plain and hf
    epilogue = (
        "import importlib.util, sys, sparse_methods\n"
        "assert sys.prefix in sparse_methods.__file__\n"
        "assert importlib.util.find_spec('sparse_kernels') is None\n"
        "assert 'triton' not in sys.modules and 'sparse_kernels' not in sys.modules\n"
        "assert {'quest', 'omnikv', 'snapkv', 'h2o'} <= set(sparse_methods.method_names())\n"
        "print('ok')\n"
    )
    assert _run_blocks(python, tmp_path, plain, epilogue).endswith("ok\n")
    # The hf extra adds transformers (and still no sparse-kernels); the README's HF example runs as written.
    wheel = next(wheels.glob("sparse_methods-*.whl"))
    _check(_run(_uv(), "pip", "install", "--python", python, "--find-links", wheels, "-c",
                tmp_path / "constraints.txt", f"sparse-methods[hf] @ {wheel.as_uri()}"))  # fmt: skip
    assert not {p for p in _installed(python) if p.startswith("sparse") and p != "sparse-methods"}
    assert "slots kept per layer" in _run_blocks(python, tmp_path, hf)
