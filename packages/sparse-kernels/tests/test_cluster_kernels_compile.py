"""RetroInfer's Triton kernels (ranking logits, order, picks, estimation from the centroids and from the ranking's
logits, the in-place merge) also compile for Hopper from the launches the CPU tests make (``compile_check``), so
compiled-mode errors show without a GPU; outputs still equal the references."""

from __future__ import annotations

import torch

from sparse_kernels._triton import cluster_picks as picks_module
from sparse_kernels._triton import cluster_select as select_module
from sparse_kernels._triton.compile_check import compiling_for
from sparse_kernels.cluster_estimation import cluster_estimation
from sparse_kernels.cluster_logits import cluster_logits
from sparse_kernels.cluster_picks import cluster_picks
from sparse_kernels.cluster_select import cluster_select
from sparse_kernels.merge_states import merge_states, merge_states_


def test_retroinfer_kernels_compile_for_hopper():
    gen = torch.Generator().manual_seed(0)
    n, heads, group, dim, total, columns = 2, 2, 4, 64, 96, 40
    query = torch.randn(n, heads * group, dim, generator=gen).to(torch.bfloat16)
    centroids = torch.randn(heads, total, dim, generator=gen).to(torch.bfloat16)
    sizes = torch.randint(0, 4, (heads, total), generator=gen, dtype=torch.int32)
    bases, counts = torch.tensor([0, 48]), torch.tensor([40, 30])
    with compiling_for():
        logits, size, tile_max, tile_sum = cluster_logits(
            query, centroids, sizes, bases, counts, columns, scale=0.1, backend="triton"
        )
    want = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=0.1, backend="reference")
    torch.testing.assert_close(logits, want[0], rtol=1e-3, atol=1e-3)

    counts = (torch.tensor([6, 5]), torch.tensor([9, 8]))
    with compiling_for():  # one chunk of columns; then several
        stats = dict(tile_max=tile_max, tile_sum=tile_sum)
        one = cluster_select(logits, size, *counts, read_width=6, estimate_width=9, **stats, backend="triton")
        select_module.CHUNK, chunk = 16, select_module.CHUNK
        try:
            several = cluster_select(logits, size, *counts, read_width=6, estimate_width=9, backend="triton")
        finally:
            select_module.CHUNK = chunk
    want = cluster_select(logits, size, *counts, read_width=6, estimate_width=9, backend="reference")
    assert torch.equal(one, want) and torch.equal(several, want)

    order = one  # a selection's order
    offsets = torch.randint(0, 50, (heads, total), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 500, (heads, 200), generator=gen, dtype=torch.int32)
    plan = torch.tensor([[0, 100], [0, 48], [40, 30], [300, 280], [20, 35], [6, 5], [7, 9]])
    kv = torch.tensor([310, 290])
    args = (order[..., :30], size, offsets, positions, plan, kv)
    kw = dict(sink=4, width=60, reach=56, estimate_width=15)
    want = cluster_picks(*args, **kw, backend="reference")
    for one_launch in (False, True):  # the running sums' kernel then the slots'; the one kernel
        picks_module.ONE_LAUNCH, default = one_launch, picks_module.ONE_LAUNCH
        try:
            with compiling_for():
                got = cluster_picks(*args, **kw, backend="triton")
        finally:
            picks_module.ONE_LAUNCH = default
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    value_sums = torch.randn(heads, total, dim, generator=gen)
    with compiling_for():
        out, lse = cluster_estimation(query, centroids, value_sums, sizes, got[1], scale=0.1, backend="triton")
    ref = cluster_estimation(query, centroids, value_sums, sizes, got[1], scale=0.1, backend="reference")
    torch.testing.assert_close(out, ref[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse, ref[1], rtol=1e-4, atol=1e-4)
    from_logits = dict(logits=logits, bases=bases, logits_scale=0.1)  # the scores from the ranking's logits
    est_args = (query, centroids, value_sums, sizes, got[1])
    with compiling_for():
        got = cluster_estimation(*est_args, scale=0.1, **from_logits, backend="triton")
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)

    lse_a = torch.randn(n, heads * group, generator=gen)
    decoded = torch.randn(n, heads * group, dim, generator=gen).to(torch.bfloat16)
    want = merge_states(decoded.float(), lse_a, out, lse).to(torch.bfloat16)
    with compiling_for():
        merge_states_(decoded, lse_a, out, lse, backend="triton")
    torch.testing.assert_close(decoded, want, rtol=1e-2, atol=1e-2)
