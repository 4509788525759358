"""compile_check: interpreted launches are also compiled for a GPU target, which catches kernels the
interpreter runs but the compiler rejects (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sparse_kernels._triton import compile_check
from sparse_kernels._triton.launch import Kernel


@triton.jit
def _row_or_column(x, AS_ROW: tl.constexpr):
    # Returns [1, 16] or [16, 1]: fine for the interpreter; with AS_ROW the compiler visits the return
    # after the taken branch too and rejects the function ("Inconsistent return types"): the mistake
    # this check exists for.
    if AS_ROW:
        return x[None, :]
    return x[:, None]


def _bad_kernel(x_ptr, out_ptr, AS_ROW: tl.constexpr):
    offs = tl.arange(0, 16)
    tl.store(out_ptr + offs, tl.sum(_row_or_column(tl.load(x_ptr + offs), AS_ROW), 0 if AS_ROW else 1))


def _good_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def test_interpreter_runs_what_the_compiler_rejects():
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty(16)
    with compile_check.compiling_for(None):  # interpreted only (the suite compiles otherwise): runs
        Kernel(_bad_kernel)[(1,)](x, out, AS_ROW=True)
    torch.testing.assert_close(out, x)
    with compile_check.compiling_for("cuda", 90, 32), pytest.raises(triton.compiler.errors.CompilationError):
        Kernel(_bad_kernel)[(1,)](x, out, AS_ROW=True)


def test_good_kernel_compiles_and_still_runs():
    x = torch.randn(10)
    out = torch.empty_like(x)
    with compile_check.compiling_for("cuda", 90, 32):
        assert compile_check.active_target() == ("cuda", 90, 32)
        Kernel(_good_kernel)[(1,)](x, out, 10, 2.0, BLOCK=16)
    torch.testing.assert_close(out, x * 2)


def test_argument_types():
    assert compile_check._arg_type("p", torch.zeros(1, dtype=torch.int32)) == "*i32"
    assert compile_check._arg_type("n", 7) == "i32" and compile_check._arg_type("n", 2**40) == "i64"
    assert compile_check._arg_type("f", True) == "i1" and compile_check._arg_type("s", 0.5) == "fp32"
    with pytest.raises(TypeError, match="cannot type"):
        compile_check._arg_type("o", object())
    # On the GPU, 16-bit operands take 16-bit dots and PDL is on.
    assert compile_check._gpu_constexpr("DOT_DTYPE", tl.float32, torch.bfloat16) == tl.bfloat16
    assert compile_check._gpu_constexpr("PRECISION", "ieee", torch.float16) == "tf32"
    assert compile_check._gpu_constexpr("DOT_DTYPE", tl.float32, None) == tl.float32
    assert compile_check._gpu_constexpr("USE_GDC", False, None) is True
