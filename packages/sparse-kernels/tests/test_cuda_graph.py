"""GPU only: run paths make no host sync and replay correctly under CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache, store_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to_cuda(batch):
    for name in ("k_cache", "v_cache", "q"):
        setattr(batch, name, getattr(batch, name).cuda())
    return batch


def test_run_and_store_make_no_host_sync(paged_batch, lengths):
    qo_lens, kv_lens = lengths(17)
    batch = _to_cuda(paged_batch(qo_lens, kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64))
    prefill = BatchPrefillWithPagedKVCache("cuda", max_tile_elements=200_000)  # several tiles
    batch.plan_prefill(prefill)
    spare = torch.tensor([-1, -1], dtype=torch.int32, device="cuda")
    rows = torch.zeros(2, 2, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = prefill.run(batch.q, batch.k_cache, batch.v_cache)
        store_kv(rows, rows, batch.k_cache, batch.v_cache, spare)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), batch.reference().cpu(), atol=1e-4, rtol=1e-4)


def test_decode_step_replays_under_cuda_graph(paged_batch):
    # Batch bucket of 8 with 5 real requests: padded rows carry slot -1 and are skipped by store_kv.
    kv_lens = [1, 97, 300, 16, 17]
    batch = _to_cuda(paged_batch([1] * 5, kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64))
    decode = BatchDecodeWithPagedKVCache("cuda")
    batch.plan_decode(decode)
    k_flat = batch.k_cache.view(-1, 2, 64)
    last_slots = []
    for b, n in enumerate(kv_lens):  # the newest token's slot, rewritten by the captured store
        block = int(batch.kv_indices[int(batch.kv_indptr[b + 1]) - 1])
        last_slots.append(block * 16 + (n - 1) % 16)
    slot_mapping = torch.tensor(last_slots + [-1, -1, -1], dtype=torch.int32, device="cuda")
    new_k = torch.zeros(8, 2, 64, device="cuda")
    new_v = torch.zeros(8, 2, 64, device="cuda")
    q_static = torch.zeros(5, 8, 64, device="cuda")
    out_static = torch.empty_like(q_static)

    def step():
        store_kv(new_k, new_v, batch.k_cache, batch.v_cache, slot_mapping)
        decode.run(q_static, batch.k_cache, batch.v_cache, out=out_static)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture, as CUDA-graph users do
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    pool_before = k_flat.clone()
    new_k.copy_(torch.randn(8, 2, 64, device="cuda"))
    new_v.copy_(torch.randn(8, 2, 64, device="cuda"))
    new_k[5:] = float("nan")  # padded rows: must never land
    q_static.copy_(batch.q)
    graph.replay()
    torch.cuda.synchronize()
    for b in range(5):
        batch.k_seqs[b][-1] = new_k[b].cpu()
        batch.v_seqs[b][-1] = new_v[b].cpu()
    torch.testing.assert_close(out_static.cpu(), batch.reference().cpu(), atol=1e-4, rtol=1e-4)
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool, device="cuda")
    untouched[torch.tensor(last_slots, device="cuda")] = False
    assert torch.equal(k_flat[untouched].isnan(), pool_before[untouched].isnan())
    torch.testing.assert_close(k_flat[untouched], pool_before[untouched], equal_nan=True, atol=0, rtol=0)


def _static_pool(batches):
    """One pool tensor pair big enough for every batch's pool (graphs record its address)."""
    rows = max(b.k_cache.shape[0] for b in batches)
    shape = (rows, *batches[0].k_cache.shape[1:])
    return torch.full(shape, float("nan"), device="cuda"), torch.full(shape, float("nan"), device="cuda")


@pytest.mark.parametrize("head_sparse", [False, True], ids=["dense", "head-sparse"])
def test_triton_decode_graph_replays_after_a_new_plan(paged_batch, head_lists, scores_oracle, head_sparse):
    # Capture once with step A's plan, then plan step B (same batch size, other lengths and blocks),
    # refill the static inputs and replay: the graph must compute step B.
    layout = dict(block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    steps = [
        paged_batch([1] * 5, [1, 97, 300, 16, 17], **layout, seed=1),
        paged_batch([1] * 5, [1200, 2, 33, 64, 4097], **layout, seed=2),
    ]
    plans = [head_lists(s, slots=False, seed=3) if head_sparse else s for s in steps]
    k_static, v_static = _static_pool(steps)
    q_static = torch.zeros(5, 8, 64, device="cuda")
    out_static = torch.full_like(q_static, float("nan"))
    rows = () if head_sparse else (2,)
    scores_buf = torch.full((*rows, 8192), float("nan"), device="cuda")  # capacity columns, sliced per step
    decode = BatchDecodeWithPagedKVCache("cuda", max_batch_size=8, max_num_pages=512)
    assert decode.backend == "triton"

    def load(i):
        step, plan = steps[i], plans[i]
        if head_sparse:
            plan.plan(decode, step)
        else:
            step.plan_decode(decode)
        k_static[: step.k_cache.shape[0]].copy_(step.k_cache)
        v_static[: step.v_cache.shape[0]].copy_(step.v_cache)
        q_static.copy_(step.q)
        page_size = plan.page_size if head_sparse else 16
        return scores_buf[..., : int(plan.kv_indptr[-1]) * page_size]

    scores_a = load(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode.run(q_static, k_static, v_static, out=out_static, scores_out=scores_a)  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(q_static, k_static, v_static, out=out_static, scores_out=scores_a)

    for i in (1, 0, 1):
        scores = load(i)
        out_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        step, plan = steps[i], plans[i]
        if head_sparse:
            out, expected_scores = plan.reference(step)
        else:
            out, expected_scores = step.reference(), scores_oracle(step)
        torch.testing.assert_close(out_static.cpu(), out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores.cpu(), expected_scores, atol=1e-4, rtol=1e-3)


def test_triton_decode_plan_and_run_make_no_host_sync(paged_batch):
    batch = _to_cuda(paged_batch([1] * 3, [5, 97, 40], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64))
    decode = BatchDecodeWithPagedKVCache("cuda", max_batch_size=4, max_num_pages=64)
    batch.plan_decode(decode)
    decode.run(batch.q, batch.k_cache, batch.v_cache)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.plan_decode(decode)
        out = decode.run(batch.q, batch.k_cache, batch.v_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), batch.reference(), atol=1e-5, rtol=1e-5)


def test_pdl_chain_in_a_graph_equals_the_plain_launches(paged_batch, monkeypatch):
    # A decode layer's chain of PDL kernels (norm, projection, store, attention, activation, projection),
    # captured in a graph and replayed 20 times, must equal the same chain launched without PDL: each
    # kernel waits for its predecessor before touching memory, whatever overlap the launches get.
    from sparse_kernels import fused_add_rms_norm, linear, silu_and_mul
    from sparse_kernels._triton import launch

    batch = _to_cuda(
        paged_batch(
            [1] * 4,
            [300, 1, 2000, 64],
            block_size=16,
            num_qo_heads=8,
            num_kv_heads=2,
            head_dim=64,
            dtype=torch.bfloat16,
        )
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = 512
    w_q = torch.randn(8 * 64, hidden, device="cuda", generator=g, dtype=torch.bfloat16) / hidden**0.5
    w_up = torch.randn(2 * 1024, 8 * 64, device="cuda", generator=g, dtype=torch.bfloat16) / 23
    w_down = torch.randn(hidden, 1024, device="cuda", generator=g, dtype=torch.bfloat16) / 32
    norm_w = torch.rand(hidden, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    x = torch.randn(4, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    res = torch.randn(4, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    kv_new = torch.randn(4, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 7, 9], dtype=torch.int32, device="cuda")
    wrapper = BatchDecodeWithPagedKVCache("cuda", backend="triton", max_batch_size=4)
    batch.plan_decode(wrapper)

    def layer():
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        h, r = fused_add_rms_norm(x, res, norm_w, 1e-6)
        q = linear(h, w_q).view(4, 8, 64)
        store_kv(kv_new, kv_new, k_cache, v_cache, slots)
        o = wrapper.run(q, k_cache, v_cache).reshape(4, 8 * 64)
        return linear(silu_and_mul(linear(o, w_up)), w_down) + r

    monkeypatch.setattr(launch, "PDL", False)
    expected = layer()
    monkeypatch.setattr(launch, "PDL", True)
    assert torch.equal(layer(), expected)  # eager PDL launches
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)
