"""The interpreter runs kernels that loop over ``range`` of a runtime argument on every Triton the project meets:
Triton 3.6 (the GPU box's) turns a scalar into an int by ``int(data)`` of a 1-element array, which NumPy 2.4
refuses; ``launch`` makes it squeeze first, as Triton 3.9 does."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime import interpreter

from sparse_kernels._triton import launch
from sparse_kernels._triton.launch import Kernel


def _sum_first(x_ptr, out_ptr, n, step, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, step):  # runtime bounds
        total += tl.load(x_ptr + start + tl.arange(0, BLOCK))
    for _ in range(n // step):  # a runtime count alone
        total += 0.0
    tl.store(out_ptr + tl.arange(0, BLOCK), total)


def test_interpreted_range_over_runtime_arguments():
    x = torch.arange(64, dtype=torch.float32)
    out = torch.empty(8)
    Kernel(_sum_first)[(1,)](x, out, 48, 8, BLOCK=8)
    assert torch.equal(out, x[:48].view(6, 8).sum(0))


def test_the_patch_wraps_the_interpreter_once():
    patched = interpreter._patch_lang_tensor
    assert getattr(patched, "squeezes_index", False)
    launch._squeeze_scalar_index()  # again: no second wrapper
    assert interpreter._patch_lang_tensor is patched
