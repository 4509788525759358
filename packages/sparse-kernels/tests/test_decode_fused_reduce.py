"""The split kernel's in-kernel merge (``FUSED``) against the two-launch split + reduce and the references.

Each live split of a (request, KV head) counts itself in ``DecodeBuffers.arrivals``; the last one merges
and resets the counter. Triton's interpreter runs programs one after another, so on CPU the last split
in grid order merges, which still exercises the counting, the reset and the merge; on a GPU the order
is arbitrary. Both paths are forced with ``decode_launch.FUSED_REDUCE_MAX_SPLITS``; only the order of
the split sums differs between them (fp32 1e-5).
"""

from __future__ import annotations

import functools

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_kernels._triton import decode_launch

NUM_KV_HEADS = 2
TOL = {"atol": 1e-5, "rtol": 1e-5}
SCORE_TOL = {"atol": 1e-4, "rtol": 1e-3}

# (kv_lens, block_size, group, forced splits, window_left, merge unroll). On CPU BLOCK_N is 64, so a
# list of n tokens has min(splits, cdiv(n, 64)) live splits (over its window) and the rest are empty.
CASES = {
    "ragged-empty-splits": ([1, 97, 300, 64, 65], 16, 4, 7, -1, 8),
    "many-splits-partial-groups": ([1100, 5, 700], 16, 2, 20, -1, 8),  # 18 live: merge steps 8, 8, 2
    "group3-padded-heads": ([200, 1, 129], 1, 3, 4, -1, 3),  # BLOCK_H 4 with one padding head
    "mha-window": ([300, 40, 1000], 16, 1, 6, 150, 4),
}


def _run(wrapper, batch, scores_cols):
    out = torch.full_like(batch.q, float("nan"))
    scores = torch.full((NUM_KV_HEADS, scores_cols), float("nan"), device=batch.q.device)
    wrapper.run(batch.q, batch.k_cache, batch.v_cache, out=out, scores_out=scores)
    return out.cpu(), scores.cpu()


@pytest.mark.parametrize("case", CASES)
def test_fused_equals_two_launch_and_reference(paged_batch, triton_device, monkeypatch, case):
    kv_lens, block_size, group, splits, window_left, unroll = CASES[case]
    batch = paged_batch(
        [1] * len(kv_lens), kv_lens, block_size=block_size, num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS, head_dim=64, seed=len(case),
    ).to(triton_device)  # fmt: skip
    cols = int(batch.kv_indptr[-1]) * block_size
    reference = BatchDecodeWithPagedKVCache(triton_device, backend="reference")
    batch.plan_decode(reference, window_left=window_left)
    expected = _run(reference, batch, cols)
    monkeypatch.setattr(decode_launch, "MERGE_SPLITS", unroll)
    results = {}
    for fused, max_splits in (("fused", splits), ("two-launch", 0)):
        monkeypatch.setattr(decode_launch, "FUSED_REDUCE_MAX_SPLITS", max_splits)
        wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", num_splits=splits)
        batch.plan_decode(wrapper, window_left=window_left)
        results[fused] = _run(wrapper, batch, cols)
        assert not wrapper._buffers.arrivals.any()  # every counter reset by its merging split
    for out, scores in results.values():
        torch.testing.assert_close(out, expected[0], **TOL)
        torch.testing.assert_close(scores, expected[1], **SCORE_TOL)
    torch.testing.assert_close(results["fused"][0], results["two-launch"][0], **TOL)


def test_counters_serve_repeated_launches_and_new_plans(paged_batch, triton_device, head_lists, monkeypatch):
    # Graph-replay semantics: one buffer set, many launches (layers, then the next step's plan), no
    # re-zeroing between them; a head-sparse plan counts per (request, KV head) in the same counters.
    monkeypatch.setattr(decode_launch, "FUSED_REDUCE_MAX_SPLITS", 64)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", max_batch_size=4, num_splits=5)
    counters = None
    for step, kv_lens in enumerate([[300, 2, 190], [97, 260, 1, 129]]):
        batch = paged_batch(
            [1] * len(kv_lens), kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=NUM_KV_HEADS,
            head_dim=32, seed=step,
        ).to(triton_device)  # fmt: skip
        lists = head_lists(batch, slots=step == 1, seed=step)
        for plan in (batch.plan_decode, functools.partial(lists.plan, batch=batch)):
            reference = BatchDecodeWithPagedKVCache(triton_device, backend="reference")
            plan(reference)
            plan(wrapper)
            for layer in range(3):
                k_cache = batch.k_cache * (1 + 0.5 * layer)
                expected = reference.run(batch.q, k_cache, batch.v_cache)
                out = wrapper.run(batch.q, k_cache, batch.v_cache)
                torch.testing.assert_close(out.cpu(), expected.cpu(), **TOL)
                assert not wrapper._buffers.arrivals.any()
        counters = counters or wrapper._buffers.arrivals.data_ptr()
        assert wrapper._buffers.arrivals.data_ptr() == counters  # fixed capacity: the address a graph records


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-launch"])
def test_cuda_graph_replays_fused_merge(paged_batch, monkeypatch, fused):
    # On the GPU the splits of a (request, head) arrive in any order; a graph of several layers replays
    # over new plans and keeps matching the reference, with every counter back at 0 after each replay.
    monkeypatch.setattr(decode_launch, "FUSED_REDUCE_MAX_SPLITS", 64 if fused else 0)
    wrapper = BatchDecodeWithPagedKVCache("cuda", max_batch_size=6, max_num_pages=2048)
    q = torch.zeros(6, 8, 128, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty_like(q) for _ in range(4)]
    steps = [[9000, 1, 4097, 300, 17, 8192], [1, 8192, 64, 9000, 5000, 2]]
    batches = [
        paged_batch([1] * 6, lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                    dtype=torch.bfloat16, seed=s).to("cuda")
        for s, lens in enumerate(steps)
    ]  # fmt: skip
    pools = [(b.k_cache.clone(), b.v_cache.clone()) for b in batches]
    k_static, v_static = (torch.zeros(2048, 16, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def forward():
        for layer, out in enumerate(outs):
            wrapper.run(q, k_static * (1 + layer), v_static, out=out)

    batches[0].plan_decode(wrapper)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        for batch, (k, v) in zip(batches, pools, strict=True):
            batch.plan_decode(wrapper)
            q.copy_(batch.q)
            k_static[: k.shape[0]].copy_(k)
            v_static[: v.shape[0]].copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            assert not wrapper._buffers.arrivals.any()
            reference = BatchDecodeWithPagedKVCache("cuda", backend="reference")
            batch.plan_decode(reference)
            for layer, out in enumerate(outs):
                expected = reference.run(batch.q, k * (1 + layer), v)
                torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
