"""The module-level switches that change kernel timings, for reports to record with their numbers."""

from __future__ import annotations

import sys


def launch_settings() -> dict:
    """``pdl``: decode-path kernels use programmatic dependent launch on Hopper
    (``sparse_kernels._triton.launch.PDL``); ``small_m_linear_max_rows``: the most rows the small-M
    linear kernel takes (``sparse_kernels.linear.SMALL_M_MAX``)."""
    from sparse_kernels._triton import launch

    linear_module = sys.modules["sparse_kernels.linear"]  # the package attribute of that name is the function
    return {"pdl": launch.PDL, "small_m_linear_max_rows": linear_module.SMALL_M_MAX}
