"""The split kernel's own merge (``MERGE``: the split that finishes a (request, KV head) last merges its
group's partials) against the separate reduce launch: the same outputs and log-sum-exps, dense, windowed and
head-sparse lists, split counts from 1 to past the list lengths; and the arrival counters back at 0 after every
launch, so repeated runs (CUDA-graph replays) agree."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_kernels._triton import decode_launch

HEADS, GROUP, DIM, BLOCK = 2, 4, 32, 16
SHAPE = dict(block_size=BLOCK, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, head_dim=DIM)


def _run(batch, lists, device, splits, merge_max, monkeypatch, window_left=-1):
    monkeypatch.setattr(decode_launch, "MERGE_MAX_SPLITS", merge_max)
    wrapper = BatchDecodeWithPagedKVCache(device, backend="triton", num_splits=splits)
    if lists is None:
        batch.plan_decode(wrapper, window_left=window_left)
    else:
        lists.plan(wrapper, batch)
    lse = torch.full((batch.q.shape[0], HEADS * GROUP), float("nan"), device=device)
    outs = [wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=lse).float().clone() for _ in range(2)]
    return outs, lse.clone(), wrapper._buffers.arrivals


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("kind", ["dense", "window", "head_sparse"])
def test_merge_in_kernel_equals_the_reduce_launch(paged_batch, head_lists, triton_device, splits, kind, monkeypatch):
    batch = paged_batch([1] * 4, [1, 97, 40, 300], **SHAPE).to(triton_device)
    lists = head_lists(batch, slots=True, seed=2) if kind == "head_sparse" else None
    window = 50 if kind == "window" else -1
    (merged, again), lse, arrivals = _run(batch, lists, triton_device, splits, 32, monkeypatch, window)
    (reduced, _), lse_reduced, _ = _run(batch, lists, triton_device, splits, 0, monkeypatch, window)
    torch.testing.assert_close(merged, reduced, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_reduced, atol=1e-6, rtol=1e-6)
    assert torch.equal(merged, again)  # the counters were reset: the second launch merged as well
    assert int(arrivals.count_nonzero()) == 0
    if kind == "dense":
        torch.testing.assert_close(merged.cpu(), batch.reference(causal=False).float(), atol=1e-5, rtol=1e-5)
