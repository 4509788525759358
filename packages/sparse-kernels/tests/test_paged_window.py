"""Sliding windows (``window_left``) in the paged decode and prefill wrappers.

The oracle is plain masked attention of each request: a query at position ``p`` sees keys
``p - window_left .. p``. The Triton decode must equal it (and the reference backend) while never
reading a token before the window: those slots are poisoned with NaN in the Triton tests.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache

NUM_KV_HEADS = 2
TOL = {"atol": 1e-5, "rtol": 1e-5}
SCORE_TOL = {"atol": 1e-4, "rtol": 1e-3}
WINDOWS = [0, 5, 40, 2000]  # 2000: longer than every request, so equal to no window


def windowed_attention(batch, window_left: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Oracle ``(out [T, Hq, D], per-request probs summed per KV head [Hkv, Tq, n])``."""
    outs, probs_out = [], []
    for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True)):
        q = batch.q[int(batch.qo_indptr[b]) : int(batch.qo_indptr[b + 1])].cpu().float()
        n, num_q, group = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
        pos = torch.arange(n - num_q, n)[:, None]
        key = torch.arange(n)[None, :]
        visible = (key <= pos) & (key >= pos - window_left)
        kk, vv = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, kk) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [Hq, Tq, n]
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv))
        probs_out.append(probs.view(k.shape[1], group, num_q, n).sum(1))
    return torch.cat(outs), probs_out


def _batch(paged_batch, qo_lens, kv_lens, block_size, group=4, seed=0):
    return paged_batch(
        qo_lens,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        seed=seed,
    )


def _poison_before_window(batch, window_left: int) -> None:
    """NaN into every slot a decode query must not read (positions before its window)."""
    block_size = batch.k_cache.shape[1]
    for b, k in enumerate(batch.k_seqs):
        first = max(0, k.shape[0] - 1 - window_left)
        blocks = batch.kv_indices[int(batch.kv_indptr[b]) : int(batch.kv_indptr[b + 1])].to(torch.int64)
        pos = torch.arange(first)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        batch.k_cache.view(-1, *batch.k_cache.shape[2:])[slots.to(batch.k_cache.device)] = float("nan")
        batch.v_cache.view(-1, *batch.v_cache.shape[2:])[slots.to(batch.v_cache.device)] = float("nan")


@pytest.mark.parametrize("window_left", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_prefill_window_matches_masked_attention(paged_batch, block_size, window_left):
    batch = _batch(paged_batch, [70, 1, 9, 33], [130, 97, 9, 33], block_size, seed=1)
    wrapper = BatchPrefillWithPagedKVCache("cpu", backend="reference", max_tile_elements=2**16)  # several tiles
    batch.plan_prefill(wrapper, window_left=window_left)
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out, windowed_attention(batch, window_left)[0], **TOL)


@pytest.mark.parametrize("window_left", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_decode_window_matches_masked_attention(paged_batch, block_size, window_left):
    kv_lens = [1, 97, 300, 16, 17, 40, 41]
    batch = _batch(paged_batch, [1] * len(kv_lens), kv_lens, block_size, seed=2)
    expected, probs = windowed_attention(batch, window_left)
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    batch.plan_decode(wrapper, window_left=window_left)
    torch.testing.assert_close(wrapper.run(batch.q, batch.k_cache, batch.v_cache), expected, **TOL)
    # The per-list reference (scores_out) applies the same window, with 0 before it.
    scores = torch.full((NUM_KV_HEADS, int(batch.kv_indptr[-1]) * block_size), float("nan"))
    torch.testing.assert_close(wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores), expected, **TOL)
    torch.testing.assert_close(scores, _dense_scores(batch, probs), **SCORE_TOL)


def _dense_scores(batch, probs: list[torch.Tensor]) -> torch.Tensor:
    block_size = batch.k_cache.shape[1]
    scores = torch.zeros(NUM_KV_HEADS, int(batch.kv_indptr[-1]) * block_size)
    for b, p in enumerate(probs):
        start = int(batch.kv_indptr[b]) * block_size
        scores[:, start : start + p.shape[-1]] = p[:, 0]
    return scores


@pytest.mark.parametrize("window_left", [0, 5, 40, 2000])
@pytest.mark.parametrize(("block_size", "splits"), [(16, None), (16, 5), (1, 3)])
def test_triton_decode_window_skips_old_pages(paged_batch, triton_device, block_size, splits, window_left):
    kv_lens = [1, 97, 300, 16, 17, 64, 65]
    batch = _batch(paged_batch, [1] * len(kv_lens), kv_lens, block_size, seed=3)
    expected, probs = windowed_attention(batch, window_left)
    _poison_before_window(batch, window_left)
    batch.to(triton_device)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", num_splits=splits)
    batch.plan_decode(wrapper, window_left=window_left)
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out.cpu(), expected, **TOL)
    scores = torch.full((NUM_KV_HEADS, int(batch.kv_indptr[-1]) * block_size), float("nan"), device=triton_device)
    wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores)
    torch.testing.assert_close(scores.cpu(), _dense_scores(batch, probs), **SCORE_TOL)


def test_window_left_is_validated(paged_batch):
    batch = _batch(paged_batch, [1, 1], [5, 9], 4)
    for wrapper, plan in (
        (BatchDecodeWithPagedKVCache("cpu", backend="reference"), batch.plan_decode),
        (BatchPrefillWithPagedKVCache("cpu", backend="reference"), batch.plan_prefill),
    ):
        for bad in (-2, 1.5, True):
            with pytest.raises(ValueError, match="window_left"):
                plan(wrapper, window_left=bad)


def test_triton_prefill_plan_threads_window(paged_batch, triton_device):
    batch = _batch(paged_batch, [40, 1, 9], [90, 33, 9], 16, seed=5)
    expected = windowed_attention(batch, 7)[0]
    batch.to(triton_device)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper, window_left=7)
    torch.testing.assert_close(wrapper.run(batch.q, batch.k_cache, batch.v_cache).cpu(), expected, **TOL)
