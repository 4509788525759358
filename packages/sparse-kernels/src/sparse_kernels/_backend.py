"""Which implementation runs: Triton kernels on CUDA by default, the plain-torch reference on CPU.

``backend`` is ``"auto"``, ``"triton"`` or ``"reference"``. An explicit constructor / call argument
wins; ``"auto"`` defers to the ``SPARSE_KERNELS_BACKEND`` environment variable, and when that is unset
(or ``auto``) picks Triton for CUDA tensors where Triton imports, else the reference. Triton on CPU
tensors runs under Triton's interpreter (see ``_triton.launch``): slow, meant for tests.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "reference")
BACKEND_ENV = "SPARSE_KERNELS_BACKEND"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``"triton"`` or ``"reference"`` for work on ``device``.

    Raises
    ------
    ValueError
        On an unknown name (argument or environment), or Triton asked for where it does not import.
    """
    choice = check_backend(backend)
    if choice == "auto":
        env = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
        if env not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {env!r}")
        choice = env
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "reference"
    if choice == "triton" and not triton_available():
        raise ValueError("backend 'triton' was requested but triton is not installed")
    return choice


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy plan metadata to ``device``: pinned + non-blocking for CUDA (the caching host allocator
    keeps the pinned block alive until the copy has run), a plain copy otherwise."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_host_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:len(src)] = src`` from the host into a persistent device buffer, pinned + non-blocking on CUDA."""
    if dst.device.type == "cuda":
        dst[: src.numel()].copy_(src.pin_memory(), non_blocking=True)
    else:
        dst[: src.numel()].copy_(src)
