"""RMSNorm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467), alone or fused with the residual add
that precedes it in a pre-norm decoder: Triton kernel + reference.

Rounding follows HF's ``LlamaRMSNorm``: the statistic and the scaling in fp32, the result cast back to
the input dtype, and only then multiplied by the weight (a bf16 x bf16 product rounded once). The
residual sum is rounded to the input dtype before it is normalised, as a separate ``x + residual``
would be. The Triton kernel rounds at the same points, so bf16 outputs differ from the reference only
where the fp32 sum of squares (another reduction order) lands on the other side of a rounding edge.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., N]``, any float dtype; the last dimension must have unit stride on the Triton path
        (other strides are read in place for 2-D inputs).
    weight : torch.Tensor
        ``[N]``.
    eps : float
        Added to the mean square before the reciprocal square root.
    backend : str
        ``"auto"`` (Triton on CUDA, reference on CPU; ``SPARSE_KERNELS_BACKEND`` overrides),
        ``"triton"`` or ``"reference"``.

    Returns
    -------
    ``[..., N]`` in ``promote_types(x.dtype, weight.dtype)``, a new tensor.
    """
    _check(x, weight, None)
    if x.numel() and resolve_backend(backend, x.device) == "triton":
        from sparse_kernels._triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, None)[0]
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``, then ``(rms_norm(h), h)`` in one pass over the rows.

    A pre-norm block carries ``h`` (the residual stream) to the next norm, so the add that closes one
    sub-block and the norm that opens the next read and write the hidden state once instead of three
    times. Shapes and dtypes as ``rms_norm``; ``residual`` has ``x``'s shape and dtype.

    Returns
    -------
    ``(normed, h)``: both new tensors; ``h`` in ``x.dtype`` (the sum rounded once, as ``x + residual``).
    """
    _check(x, weight, residual)
    if x.numel() and resolve_backend(backend, x.device) == "triton":
        from sparse_kernels._triton.rms_norm import rms_norm_triton

        out, h = rms_norm_triton(x, weight, eps, residual)
        return out, h
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch ``rms_norm``: HF's order of operations, bit for bit."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1] if x.dim() else '?'}], got {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({x.dtype} {list(x.shape)}), got {residual.dtype} {list(residual.shape)}"
        )
