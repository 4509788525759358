"""Quantized paged prefill (fp8, KIVI, TurboQuant) against causal attention over the dequantized KV.

Each request's queries are the last ``qo_len`` of its ``kv_len`` tokens (their K/V already stored: for
KIVI the incomplete last page sits in the request's tail row). Runs natively on CUDA where present, else
under Triton's interpreter. Tolerances as in ``test_quantized_decode``: IEEE fp32 dots on CPU (only the
summation order differs), fp16 dot operands on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchPrefillWithPagedKVCache, causal_attention
from sparse_kernels._triton.compile_check import compiling_for

NUM_KV_HEADS = 2
SCHEMES = [("fp8", 8), ("kivi", 2), ("kivi", 4), ("turboquant", 2), ("turboquant", 3), ("turboquant", 4)]
TOL = {"cpu": {"atol": 1e-4, "rtol": 1e-4}, "cuda": {"atol": 2e-2, "rtol": 2e-2}}
# (kv_lens, qo_lens, block_size, group, head_dim): partial and full last pages, chunks over a history.
CASES = {
    "bs16-g2": ([1, 17, 97, 32], [1, 9, 40, 32], 16, 2, 32),
    "bs32-g3": ([45, 64], [45, 5], 32, 3, 32),
}
COMPILE = {"bs16-g2": ("cuda", 90, 32), "bs32-g3": (None,)}


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(("scheme", "bits"), SCHEMES, ids=[f"{s}{b}" for s, b in SCHEMES])
@pytest.mark.parametrize("case", CASES)
def test_quantized_prefill_matches_dequantized_attention(quantized_batch, triton_device, scheme, bits, case):
    kv_lens, qo_lens, block_size, group, head_dim = CASES[case]
    batch = quantized_batch(
        kv_lens, scheme=scheme, bits=bits, block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim
    )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(qo_lens), group * NUM_KV_HEADS, head_dim, generator=gen)
    qo_indptr = _indptr(qo_lens)
    expected = torch.cat(
        [
            causal_attention(q[int(qo_indptr[b]) : int(qo_indptr[b + 1])], k, v)
            for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True))
        ]
    )
    kv = batch.kv_on(triton_device)
    for backend in ("triton", "reference"):
        wrapper = BatchPrefillWithPagedKVCache(triton_device, backend=backend)
        wrapper.plan(
            qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_len, num_qo_heads=group * NUM_KV_HEADS,
            **batch.layout(), tail_index=batch.tail_index,
        )  # fmt: skip
        out = torch.full_like(q, float("nan")).to(triton_device)
        with compiling_for(*COMPILE[case]):  # the sm_90 compile check runs once per scheme
            assert wrapper.run_quantized(q.to(triton_device), kv, out=out) is out
        torch.testing.assert_close(out.cpu(), expected, **TOL[torch.device(triton_device).type], msg=backend)


def test_kivi_prefill_without_tail_rows_raises(quantized_batch):
    batch = quantized_batch([17], scheme="kivi", bits=4, block_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=32)
    wrapper = BatchPrefillWithPagedKVCache("cpu", backend="reference")
    qo_indptr = torch.tensor([0, 3], dtype=torch.int32)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_len, num_qo_heads=2, **batch.layout())
    with pytest.raises(ValueError, match="incomplete last page needs"):
        wrapper.run_quantized(torch.zeros(3, 2, 32), batch.kv)
