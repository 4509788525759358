"""``sparse_kernels``, imported when a device-batched selection first runs (the ``kernels`` extra).

The eviction methods are plain torch; the query-aware methods (Quest, OmniKV) select only through
kernels (their reference backends on CPU), so ``sparse-methods`` alone does not install them.
"""

from __future__ import annotations

from types import ModuleType


def kernels() -> ModuleType:
    try:
        import sparse_kernels
    except ImportError as e:
        raise ImportError(
            "this method's batched selection runs sparse-kernels: pip install 'sparse-methods[kernels]'"
        ) from e
    return sparse_kernels
