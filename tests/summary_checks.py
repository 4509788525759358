"""Block summaries as tests see them: the bounds a store's summaries stand for (model dtype or int8 codes
with a scale, ``sparse_kernels.summary_codes``), and the check that they summarize a block's keys."""

from __future__ import annotations

import torch

from sparse_kernels.summary_codes import decode_summary, encode_summary


def fast_args(pool, layer: int) -> tuple[tuple, dict]:
    """``(k_cache, v_cache, kmin, kmax)`` and ``{"kscale": ...}`` as the engine hands them to ``run_batched``."""
    kmin, kmax, kscale = pool.summary(layer)
    return (pool.k[layer], pool.v[layer], kmin, kmax), {"kscale": kscale}


def assert_summarizes(kmin, kmax, kscale, keys: torch.Tensor, atol: float = 0.0) -> None:
    """``kmin`` / ``kmax`` ``[..., Hkv, D]`` (with ``kscale [..., Hkv]`` for codes) summarize ``keys [..., n, Hkv,
    D]`` (leading dims: several blocks checked at once): in the model dtype exactly their min / max; as codes, a
    fresh encoding of them (``encode_summary``), rounded outward (every key inside the decoded bounds).
    ``atol``: for keys dequantized again by the test (a quantized store)."""
    lo, hi = keys.amin(-3), keys.amax(-3)
    if kscale is None:
        torch.testing.assert_close(kmin, lo.to(kmin.dtype), rtol=atol, atol=atol)
        torch.testing.assert_close(kmax, hi.to(kmax.dtype), rtol=atol, atol=atol)
        return
    fresh_min, fresh_max, fresh_scale = encode_summary(lo, hi)
    torch.testing.assert_close(kscale, fresh_scale, rtol=1e-6, atol=0)
    dlo, dhi = decode_summary(kmin, kmax, kscale)
    slack = 1e-5 * kscale[..., None] * 127 + atol
    assert bool((dlo <= lo.float() + slack).all()) and bool((dhi >= hi.float() - slack).all())
    assert torch.equal(kmin, fresh_min) and torch.equal(kmax, fresh_max)
