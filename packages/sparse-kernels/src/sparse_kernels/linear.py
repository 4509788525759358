"""Linear projection ``y = x W^T (+ b)`` with a Triton kernel for decode's few-row inputs.

At decode every projection reads its whole weight for one to a few token rows, so its time is the
weight's bytes over memory bandwidth. cuBLAS picks split-K kernels for these shapes and adds a reduce
launch per call; ``sparse_kernels._triton.linear`` streams each weight once in a single launch. Rows
above ``SMALL_M_MAX`` (prefill, large batches), other dtypes on ``auto``, and the reference backend use
``torch.nn.functional.linear``, which is also the reference the kernel is tested against.
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
    if weight.stride(1) != 1:
        raise ValueError("the Triton path needs the weight with unit stride along K")
    config = linear_config(rows, weight.shape[0], weight.shape[1])
    from sparse_kernels._triton.linear import small_m_linear_triton

    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = small_m_linear_triton(x2, weight, bias, config)
    return out.reshape(*x.shape[:-1], weight.shape[0])


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
