"""Linear projection ``y = x W^T (+ b)`` with a Triton kernel for decode's few-row inputs.

At decode every projection reads its whole weight for one to a few token rows, so its time is the
weight's bytes over memory bandwidth. cuBLAS picks split-K kernels for these shapes and adds a reduce
launch per call; ``sparse_kernels._triton.linear`` streams each weight once in a single launch. Rows
above ``SMALL_M_MAX`` (prefill, large batches), other dtypes on ``auto``, and the reference backend use
``torch.nn.functional.linear``, which is also the reference the kernel is tested against.

Between a decoder's projections sit small kernels (SiLU * up, the residual add and RMSNorm) whose launches
cost a decode step more than their bytes: ``gated_linear``, ``residual_linear`` and ``norm_linear`` carry
them inside the projections' launches, each equal to its unfused composition (the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparse_kernels._backend import check_backend, resolve_backend

# Rows up to which the Triton kernel runs (on CUDA, bf16/fp16, backend "auto").
SMALL_M_MAX = 16
_AUTO_DTYPES = (torch.bfloat16, torch.float16)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the small-M Triton kernel where it applies.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]``.
    weight : torch.Tensor
        ``[N, K]`` in ``x.dtype``; unit stride along K where the kernel runs.
    bias : torch.Tensor, optional
        ``[N]`` in ``x.dtype``.
    backend : str
        ``"auto"``: the kernel for CUDA bf16/fp16 inputs of at most ``SMALL_M_MAX`` rows, else
        ``F.linear`` (``SPARSE_KERNELS_BACKEND`` may force the reference); ``"triton"``: the kernel for
        any row count and float dtype (CPU tensors run under the interpreter: tests); ``"reference"``:
        ``F.linear``.

    Returns
    -------
    ``[..., N]`` in ``x.dtype``: fp32 accumulation, one rounding (bias added before it).
    """
    _check(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    backend = check_backend(backend)
    if not rows or not _use_triton(backend, x, rows):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)``: a SwiGLU MLP's down projection over the merged
    ``[..., 2K]`` gate/up output, with SiLU * up computed as the kernel reads its input tiles (one launch
    instead of two where the kernel runs; the product rounded as ``silu_and_mul`` rounds it)."""
    if x.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"x must be [..., 2 * K] = [..., {2 * weight.shape[-1]}], got {list(x.shape)}")
    from sparse_kernels.silu_mul import silu_and_mul

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not rows or not _use_triton(check_backend(backend), x, rows):
        return linear(silu_and_mul(x, backend=backend), weight, bias, backend=backend)
    _check(x[..., : weight.shape[-1]], weight, bias)
    out = _launch(x, weight, bias, gated=True)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def residual_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h, squares)``: ``h = linear(x, weight, bias) + residual`` (each rounded as its own op), the
    residual stream after a pre-norm block's projection; with ``gated``, ``x`` is ``[gate | up]`` as in
    ``gated_linear``. Where the kernel runs it also leaves each row's sum of squares of ``h`` as partial
    sums per column tile (``squares``, ``[rows, tiles]`` fp32) for ``norm_linear``, so the next RMSNorm
    needs no pass of its own; elsewhere ``squares`` is None."""
    if residual.shape != (*x.shape[:-1], weight.shape[0]) or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must be [{', '.join(map(str, (*x.shape[:-1], weight.shape[0])))}] in {x.dtype}, "
            f"got {list(residual.shape)} in {residual.dtype}"
        )
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not rows or not _use_triton(check_backend(backend), x, rows):
        y = gated_linear(x, weight, bias, backend=backend) if gated else linear(x, weight, bias, backend=backend)
        return y + residual, None
    _check(x[..., : weight.shape[-1]] if gated else x, weight, bias)
    if gated and x.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"x must be [..., 2 * K] = [..., {2 * weight.shape[-1]}], got {list(x.shape)}")
    r2 = residual.reshape(rows, weight.shape[0])
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    out, squares = _launch(x, weight, bias, gated=gated, residual=r2)
    return out.reshape(residual.shape), squares


def norm_linear(
    h: torch.Tensor,
    squares: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``linear(rms_norm(h, norm_weight, eps), weight, bias)``: a pre-norm block's first projection. With
    ``squares`` from the ``residual_linear`` that wrote ``h``, the kernel normalises each input tile as it
    reads it (no norm launch; ``rms_norm``'s roundings, the row's statistic summed in another order);
    without them, or off the kernel, ``rms_norm`` then ``linear``."""
    from sparse_kernels.rms_norm import rms_norm

    rows = h.numel() // h.shape[-1] if h.shape[-1] else 0
    if squares is None or not rows or not _use_triton(check_backend(backend), h, rows):
        return linear(rms_norm(h, norm_weight, eps, backend=backend), weight, bias, backend=backend)
    _check(h, weight, bias)
    if norm_weight.shape != (h.shape[-1],) or norm_weight.dtype != h.dtype:
        raise ValueError(f"norm_weight must be [{h.shape[-1]}] in {h.dtype}, got {list(norm_weight.shape)}")
    if squares.dim() != 2 or squares.shape[0] != rows or squares.dtype != torch.float32:
        raise ValueError(f"squares must be [{rows}, tiles] float32 (from residual_linear), got {list(squares.shape)}")
    out = _launch(h, weight, bias, norm=(squares, norm_weight, float(eps)))
    return out.reshape(*h.shape[:-1], weight.shape[0])


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **fused):
    """The small-M kernel over ``x``'s rows with the fused parts (``small_m_linear_triton``'s keywords)."""
    if weight.stride(1) != 1:
        raise ValueError("the Triton path needs the weight with unit stride along K")
    from sparse_kernels._triton.linear import small_m_linear_triton

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    config = linear_config(x2.shape[0], weight.shape[0], weight.shape[1])
    return small_m_linear_triton(x2, weight, bias, config, **fused)


def linear_config(rows: int, n: int, k: int) -> dict:
    """Launch shape of the small-M kernel for ``rows`` x ``[n, k]``.

    From ``benchmarks/small_m_linear.py`` on an H200 (bf16, Qwen3-8B's projections, M = 1-16): wide
    outputs (merged gate/up, vocabulary heads) stream 64-row tiles; a single row of a narrow output
    uses 4-row tiles without ``tl.dot``, which keeps a thousand programs in flight; the rest use
    32 x 256 tiles on ``tl.dot``. Against cuBLAS, per call: o-proj 11.6 vs 13.2 us, down 27.9 vs
    29.9, gate/up 48.2 vs 49.8, lm head 282 vs 298, qkv 15.6 vs 15.5 (cuBLAS adds a split-K reduce
    launch to o and down). Narrow outputs of 2+ rows (o, down: 128 column tiles) split K in three,
    reduced in the same launch: at 5 rows o 11.8 -> 11.3 us, down 28.3 -> 27.3 (session 10 sweep,
    ``--split-k``); qkv and gate/up gained nothing.
    """
    if n >= 16384:
        return {"USE_DOT": True, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if rows == 1 and n <= 4096:
        return {"USE_DOT": False, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 4}
    if n <= 4096:  # 128 column tiles: three K slices keep every SM streaming
        return {"USE_DOT": True, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 3}
    return {"USE_DOT": True, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}


def _use_triton(backend: str, x: torch.Tensor, rows: int) -> bool:
    if backend == "triton":
        return resolve_backend(backend, x.device) == "triton"
    if backend == "reference" or rows > SMALL_M_MAX or x.dtype not in _AUTO_DTYPES:
        return False
    return resolve_backend(backend, x.device) == "triton"


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] expected, got {list(x.shape)} and {list(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
            f"{None if bias is None else bias.dtype}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got {list(bias.shape)}")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
