"""Every package has a README whose ```python blocks run as written (here in the workspace; the
sparse-kernels and sparse-methods ones also run from fresh wheel installs in ``test_wheels``)."""

from __future__ import annotations

import pytest
from readme_blocks import PACKAGES, python_blocks, readme


@pytest.mark.parametrize("package", PACKAGES)
def test_readme_examples_run(package):
    path = readme(package)
    blocks = python_blocks(path)
    assert blocks, f"{path} has no python example"
    # The first example is the quick start: a user should get going in about 20 lines.
    assert len(blocks[0].splitlines()) <= 25, f"{path}'s first example is longer than a quick start should be"
    for i, code in enumerate(blocks):
        exec(compile(code, f"{path}:block{i}", "exec"), {"__name__": f"readme_{i}"})
