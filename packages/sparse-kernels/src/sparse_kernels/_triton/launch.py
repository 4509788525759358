"""Launch one kernel source compiled on GPU tensors and interpreted on CPU tensors.

``triton.jit`` picks compile-or-interpret once, at decoration time, from ``TRITON_INTERPRET``, and
Triton's own library functions (``tl.max``, ``tl.cdiv``, ...) were decorated when ``triton`` was
first imported. Under ``pytest`` something (transformers, for one) imports Triton long before any
conftest could set the variable, so each kernel here keeps its plain function and builds the variant
its arguments need: ``triton.jit`` for CUDA tensors, Triton's ``InterpretedFunction`` for CPU
tensors. While an interpreted launch runs, calls to compiled-mode library functions are routed
through the interpreter too (and their language patches undone after each call), so the interpreter
works whatever the import order. With ``TRITON_INTERPRET=1`` set, ``triton.jit`` interprets itself.
Inside ``compile_check.compiling_for()``, interpreted launches are also compiled for a GPU target.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from sparse_kernels._triton import compile_check

_interpreter_lock = threading.Lock()
_rewritten: dict[Callable[..., Any], Callable[..., Any]] = {}


class Kernel:
    """``Kernel(fn)[grid](*args, **meta)``: compiled if the first tensor argument is on CUDA."""

    def __init__(self, fn: Callable[..., None]):
        self.fn = fn
        self._compiled: Any = None
        self._interpreted: Any = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **meta: Any) -> None:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            if device.type == "cpu":
                if compile_check.active_target() is not None:
                    compile_check.compile_launch(self.fn, args, meta)
                with _interpreting():
                    self._interpreter()[grid](*args, **meta)
            else:
                self._compiler()[grid](*args, **meta)

        return launch

    def _compiler(self) -> Any:
        if self._compiled is None:
            self._compiled = triton.jit(self.fn)
        return self._compiled

    def _interpreter(self) -> Any:
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    """Let compiled-mode ``@triton.jit`` library functions run inside an interpreted kernel.

    ``triton.language.core`` (what the library functions see) is patched once for the launch, the
    kernel module's ``tl`` by the interpreter itself; both are restored afterwards.
    """
    from triton.runtime import interpreter

    def call(jit_fn: JITFunction, *args: Any, **kwargs: Any) -> Any:
        fn = _rewritten.get(jit_fn.fn)
        if fn is None:
            fn = _rewritten[jit_fn.fn] = interpreter.InterpretedFunction(jit_fn.fn).rewrite()
        return fn(*args, **kwargs)

    with _interpreter_lock:
        original = JITFunction.__call__
        scope = interpreter._patch_lang(_library_fn())
        JITFunction.__call__ = call
        try:
            yield
        finally:
            JITFunction.__call__ = original
            if scope is not None:  # older Tritons leave their patches in place
                scope.restore()


def _squeeze_scalar_index() -> None:
    """Triton 3.6's interpreter (the GPU box's) turns a scalar tensor into a Python int by ``int(data)``, and its
    scalars are 1-element arrays, which NumPy 2.4 refuses to convert: an interpreted kernel that loops over
    ``range`` of a runtime argument then fails ("only 0-dimensional arrays can be converted"). Triton 3.9
    squeezes the array first; this makes every version do so, by re-patching ``__index__`` after Triton's own
    patch of the language's tensor (its scope restores both, last first)."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


_squeeze_scalar_index()


def _library_fn() -> Callable[..., Any]:
    """A plain function from Triton's library module, whose globals hold ``triton.language.core``."""
    fn = tl.standard.max
    return getattr(fn, "fn", fn)


def dot_args(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """``DOT_DTYPE`` / ``PRECISION`` constexprs for ``tl.dot`` on operands of ``dtype``.

    GPU: the storage dtype (bf16/fp16 tensor cores), with IEEE fp32 dots for fp32 (not tf32, so fp32
    matches the reference to ~1e-6). The interpreter multiplies bf16 bit patterns as integers in
    ``tl.dot``, so on CPU the operands are widened to fp32 first.
    """
    widths = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in widths:
        raise ValueError(f"unsupported dtype {dtype}; expected float32, bfloat16 or float16")
    dot_dtype = tl.float32 if device.type == "cpu" else widths[dtype]
    return {"DOT_DTYPE": dot_dtype, "PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32"}


# Programmatic dependent launch (Hopper and newer). A kernel launched with ``launch_pdl`` may be
# scheduled before the kernel ahead of it in the stream has finished. The kernels that take part
# (``USE_GDC``) wait for their predecessor (``gdc_wait``: its completion and memory flush) before
# touching memory a kernel of the step may write, and let their dependent launch once their last store
# is issued (``gdc_launch_dependents``), so a decode step's chain of small kernels overlaps each launch
# with the tail of the kernel before it. Only data no kernel of the step writes is read before the
# wait: weights and tables, and step metadata copied from the host before the step's first kernel
# (positions, slot mapping, the decode lists' offsets and lengths; a selecting method writes the list
# entries on the device, so those are read after it). Every kernel in the stream starts after that
# copy, the first one by plain stream order and each later one after its predecessor started.
# Releasing at the start of each program instead was measured 20% slower on an H200 (the waiting
# grids' blocks crowd the running one), so release is at the end only. Benchmarks flip this switch
# to measure the difference.
PDL = True


def pdl_args(device: torch.device) -> dict[str, Any]:
    """``USE_GDC`` (and ``launch_pdl``) for a kernel on ``device``: on for CUDA devices of compute
    capability 9.0 or newer while ``PDL`` is set, off elsewhere (the interpreter skips the branches)."""
    if device.type == "cuda" and PDL and _capability(device.index)[0] >= 9:
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def pdl_enter(USE_GDC: tl.constexpr):
    """Before a kernel's first memory access: wait for the predecessor's completion and memory."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_exit(USE_GDC: tl.constexpr):
    """After a program's last store: its dependent may launch (programs that return early release at exit)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
