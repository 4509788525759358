"""window_probs (Triton and reference) against a per-request loop of torch.softmax.

The pool comes from ``make_paged_batch``: shuffled blocks, NaN in every slot no request owns, so a
read past a row's keys poisons its output. Block tables are padded with -1 past each row's blocks.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import window_probs

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2e-2, "atol": 1e-5},  # 16-bit dots on a GPU; the interpreter widens to fp32
}


def oracle(queries: torch.Tensor, k_seqs: list[torch.Tensor], scale: float, width: int) -> torch.Tensor:
    """Each request alone: causal softmax of its window queries over its keys, averaged over them."""
    batch, n, num_qo_heads, _ = queries.shape
    out = torch.zeros(batch, num_qo_heads, width)
    for b, keys in enumerate(k_seqs):
        kv_len = keys.shape[0]
        if kv_len <= n:
            continue
        group = num_qo_heads // keys.shape[1]
        for hq in range(num_qo_heads):
            logits = queries[b, :, hq].float() @ keys[:, hq // group].float().T * scale  # [n, kv_len]
            for j in range(n):
                logits[j, kv_len - n + j + 1 :] = float("-inf")
            probs = torch.softmax(logits, dim=-1)[:, : kv_len - n].mean(0)
            cols = min(width, kv_len - n)
            out[b, hq, :cols] = probs[:cols]
    return out


def block_table(batch) -> torch.Tensor:
    """The CSR block lists as an int32 ``[B, max_blocks]`` table, -1 past each row's blocks."""
    counts = (batch.kv_indptr[1:] - batch.kv_indptr[:-1]).tolist()
    table = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32)
    for b, count in enumerate(counts):
        start = int(batch.kv_indptr[b])
        table[b, :count] = batch.kv_indices[start : start + count]
    return table


def _inputs(paged_batch, kv_lens, group, n, dtype, seed=0):
    batch = paged_batch(
        [1] * len(kv_lens),
        kv_lens,
        block_size=BLOCK_SIZE,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    queries = torch.randn(len(kv_lens), n, group * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return queries, batch


# Every group size and window length, each with both dtypes (each case compiles its own kernels).
CASES = [
    (g, n, (torch.float32, torch.bfloat16)[(i + k) % 2])
    for i, g in enumerate([1, 2, 4])
    for k, n in enumerate([1, 3, 8])
]


@pytest.mark.parametrize(("group", "n", "dtype"), CASES)
def test_kernel_and_reference_equal_the_per_request_softmax(group, n, dtype, paged_batch, triton_device):
    """Ragged rows: empty window (len <= n), one scored token, partial and whole blocks."""
    kv_lens = [n, n + 1, 37, 80, 5 + n]
    queries, batch = _inputs(paged_batch, kv_lens, group, n, dtype, seed=group * 10 + n)
    table = block_table(batch)
    lens = torch.tensor(kv_lens, dtype=torch.int32 if n % 2 else torch.int64)
    expected = oracle(queries, batch.k_seqs, SCALE, table.shape[1] * BLOCK_SIZE)
    reference = window_probs(queries, batch.k_cache, table, lens, SCALE, backend="reference")
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-7)
    args = (queries, batch.k_cache, table, lens)
    out = window_probs(*(a.to(triton_device) for a in args), SCALE, backend="triton")
    torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("max_len", [50, 200])
def test_many_chunks_and_explicit_width(max_len, paged_batch, triton_device, monkeypatch):
    """Chunks of one tile each (the log-sum-exp merged from many partials), an output narrower or
    wider than the table; rows longer than ``max_len`` still normalize over all their keys."""
    from sparse_kernels._triton import stream_split
    from sparse_kernels._triton import window_scores as kernel

    monkeypatch.setattr(stream_split, "TARGET_PROGRAMS", 4096)
    monkeypatch.setitem(kernel.CONFIG, "BLOCK_T", 16)
    monkeypatch.setitem(kernel.CONFIG, "min_tiles", 1)
    kv_lens = [150, 9, 64, 65]
    queries, batch = _inputs(paged_batch, kv_lens, 2, 5, torch.float32, seed=3)
    table = block_table(batch)
    lens = torch.tensor(kv_lens)
    expected = oracle(queries, batch.k_seqs, SCALE, max_len)
    args = (queries, batch.k_cache, table, lens)
    for backend, device in (("reference", "cpu"), ("triton", triton_device)):
        out = window_probs(*(a.to(device) for a in args), SCALE, max_len=max_len, backend=backend)
        torch.testing.assert_close(out.cpu(), expected, **TOL[torch.float32])


def test_window_longer_than_a_tile_takes_the_reference(paged_batch):
    """``n > MAX_WINDOW`` queries do not fit one query tile: the Triton backend hands them to the reference."""
    from sparse_kernels._triton.window_scores import MAX_WINDOW

    n = MAX_WINDOW + 2
    kv_lens = [n + 40, n - 1]
    queries, batch = _inputs(paged_batch, kv_lens, 1, n, torch.float32, seed=7)
    out = window_probs(queries, batch.k_cache, block_table(batch), torch.tensor(kv_lens), SCALE, backend="triton")
    torch.testing.assert_close(out, oracle(queries, batch.k_seqs, SCALE, out.shape[2]), rtol=1e-5, atol=1e-7)


def test_mass_before_the_window_is_at_most_one(paged_batch, triton_device):
    """Each head's scores sum to the window's mean probability mass on the tokens before it: in
    (0, 1], and exactly what is left after the window's own keys."""
    kv_lens = [100, 33]
    queries, batch = _inputs(paged_batch, kv_lens, 4, 8, torch.float32, seed=5)
    table = block_table(batch).to(triton_device)
    out = window_probs(queries.to(triton_device), batch.k_cache.to(triton_device), table,
                       torch.tensor(kv_lens, device=triton_device), SCALE, backend="triton").cpu()  # fmt: skip
    mass = out.sum(-1)
    assert bool(((mass > 0) & (mass <= 1 + 1e-5)).all())
    for b, keys in enumerate(batch.k_seqs):
        in_window = 1 - oracle(queries[b : b + 1], [keys], SCALE, kv_lens[b]).sum(-1)[0]
        torch.testing.assert_close(mass[b], 1 - in_window, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_full_size_matches_the_reference():
    """SnapKV's real shape on the GPU: B=8, L=8448, Hq=32, Hkv=8, D=128, n=32, bf16, ragged lengths."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, n, length, block_size = 8, 32, 8448, 16
    num_blocks = batch * length // block_size
    k_cache = torch.randn(num_blocks + 7, block_size, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    table = torch.randperm(num_blocks + 7, device="cuda", generator=gen)[:num_blocks].view(batch, -1).int()
    queries = torch.randn(batch, n, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    kv_lens = torch.tensor([8448, 8000, 4097, 33, 32, 1000, 8447, 6000], device="cuda")
    out = window_probs(queries, k_cache, table, kv_lens, 128**-0.5, backend="triton")
    expected = window_probs(queries, k_cache, table, kv_lens, 128**-0.5, backend="reference")
    torch.testing.assert_close(out, expected, rtol=5e-3, atol=1e-6)
    # The tokens a method keeps (top scores) are the reference's.
    top, top_ref = (x[:3, :, :4000].topk(256, dim=-1).indices.sort(-1).values for x in (out, expected))
    overlap = torch.stack([torch.isin(a, b) for a, b in zip(top.flatten(0, 1), top_ref.flatten(0, 1), strict=True)])
    assert overlap.float().mean() > 0.99
