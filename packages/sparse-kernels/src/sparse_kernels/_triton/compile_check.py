"""Compile interpreted launches for a GPU target too, so CPU-only CI catches compiled-mode errors.

Triton's interpreter runs a kernel as Python, so code the compiler rejects (a ``@triton.jit`` helper
whose branches return differently shaped tensors, an op with no lowering) can pass every CPU test and
fail on the first GPU. Inside ``compiling_for()``, each interpreted launch of a ``Kernel`` is also
compiled ahead of time, to a cubin for the given target (Hopper by default), from the launch's own
arguments. No GPU is needed: Triton compiles for a ``GPUTarget`` on any host.

The launch's arguments become the signature: tensors their pointer type, ints ``i32`` (``i64`` past
32 bits), floats ``fp32``, bools ``i1``. Constexprs are kept, except the ones that differ between the
interpreter and the GPU: ``DOT_DTYPE`` / ``PRECISION`` are what ``dot_args`` picks on CUDA for the
launch's 16-bit tensors, and ``USE_GDC`` (programmatic dependent launch) is on, as on Hopper.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

_POINTER = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
    torch.float8_e4m3fn: "*fp8e4nv",
}
_compiled: set[tuple] = set()
_target: tuple[str, int, int] | None = None


@contextlib.contextmanager
def compiling_for(backend: str | None = "cuda", arch: int = 90, warp_size: int = 32) -> Iterator[None]:
    """While active, every interpreted launch is also compiled for ``GPUTarget(backend, arch, warp_size)``;
    ``backend=None`` turns the check off inside an enclosing one."""
    global _target
    previous, _target = _target, (None if backend is None else (backend, arch, warp_size))
    try:
        yield
    finally:
        _target = previous


def active_target() -> tuple[str, int, int] | None:
    return _target


def compile_launch(fn: Any, args: tuple, meta: dict) -> None:
    """Compile ``fn`` (a plain kernel function) for the active target with these launch arguments.

    Raises ``triton.compiler.errors.CompilationError`` (or the backend's error) where the compiler
    rejects the kernel. Each distinct signature compiles once per process.
    """
    from triton.backends.compiler import GPUTarget

    params = list(inspect.signature(fn).parameters)
    options = {k: meta[k] for k in ("num_warps", "num_stages") if k in meta}
    values = dict(zip(params, args, strict=False))
    values.update({k: v for k, v in meta.items() if k in params})
    half = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in _HALF), None)
    signature, constexprs = {}, {}
    positional = set(params[: len(args)])
    for name in params:
        value = values[name]
        if fn.__annotations__.get(name) in ("tl.constexpr", tl.constexpr) or name not in positional:
            signature[name] = "constexpr"
            constexprs[name] = _gpu_constexpr(name, value, half)
        else:
            signature[name] = _arg_type(name, value)
    if constexprs.get("USE_GDC"):
        options["launch_pdl"] = True
    key = (
        fn,
        _target,
        tuple(signature.items()),
        tuple((k, str(v)) for k, v in constexprs.items()),
        tuple(options.items()),
    )
    if key in _compiled:
        return
    source = triton.compiler.ASTSource(fn=triton.jit(fn), signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget(*_target), options=options)
    _compiled.add(key)


_HALF = (torch.bfloat16, torch.float16)


def _gpu_constexpr(name: str, value: Any, half: torch.dtype | None) -> Any:
    if name == "USE_GDC":
        return True
    if name == "DOT_DTYPE" and value == tl.float32 and half is not None:
        return tl.bfloat16 if half == torch.bfloat16 else tl.float16
    if name == "PRECISION" and value == "ieee" and half is not None:
        return "tf32"
    return value


def _arg_type(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTER:
            raise TypeError(f"argument {name}: no pointer type for {value.dtype}")
        return _POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__} for compilation")
