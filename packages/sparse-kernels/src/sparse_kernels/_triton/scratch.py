"""Device scratch that outlives a launch: per device, a tuple of tensors shared by every call of one kernel family.

Launches on one stream run one after another, so one set serves them all; a kernel that counts arrivals in it (or
keeps other state) leaves it at 0 for the next launch, which also makes it safe under CUDA-graph replays. A call that
needs more grows the set; growing moves it, and the old tensors are kept alive (never reused), because a graph
captured before may still point at them. So the first call of each shape should come before a capture (the engine's
warm-up forwards)."""

from __future__ import annotations

import torch

_RETIRED: list[tuple[torch.Tensor, ...]] = []


def grown(
    store: dict[torch.device, tuple[torch.Tensor, ...]],
    device: torch.device,
    specs: tuple[tuple[int, torch.dtype, bool], ...],
) -> tuple[torch.Tensor, ...]:
    """``store[device]``: one tensor per ``(elements, dtype, zeroed)`` spec with at least that many elements,
    (re)allocated when one is short (``zeroed``: filled with 0 when allocated, else uninitialised)."""
    have = store.get(device)
    if have is None or any(t.numel() < n for t, (n, _, _) in zip(have, specs, strict=True)):
        old = have if have is not None else (None,) * len(specs)
        sizes = [n if t is None else max(n, t.numel()) for (n, _, _), t in zip(specs, old, strict=True)]
        if have is not None:
            _RETIRED.append(have)
        store[device] = tuple(
            (torch.zeros if zeroed else torch.empty)(size, dtype=dtype, device=device)
            for size, (_, dtype, zeroed) in zip(sizes, specs, strict=True)
        )
    return store[device]
