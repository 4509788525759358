"""RetroInfer's device selection (``cluster_selection``) equals its full-sort, per-context-token reference
(``cluster_selection_reference``) exactly over random arenas: decode rows with an index (any cluster
counts, empty clusters, tied scores, budgets cut inside a cluster or past the retrieved clusters, 0 to many
clusters retrieved and estimated), rows without an index yet, a graph's padding rows, rows that read past the
selection width, garbage in the arena around the rows' indexes. The ranking keeps the reference's retrieved
clusters in order and its estimated ones as a set, the slots are the same and so are the estimated clusters
(as sets). On CUDA the half-precision ranking (one matmul accumulating in
float32) equals the reference where the dot products are exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_kernels.cluster_index import ClusterIndex
from sparse_methods import ClusterArena
from sparse_methods.base import DecodeBatch
from sparse_methods.cluster_selection import (
    estimate_clusters,
    pick_clusters,
    rank_arena_clusters,
)
from sparse_methods.cluster_selection_reference import (
    cluster_slots_reference,
    estimated_cluster_ids_reference,
    rank_arena_clusters_reference,
)

DIM = 4


def _index(sizes: list[list[int]], perms: list[list[int]], sink: int, gen, dtype, values: int) -> ClusterIndex:
    """An index of ``sum(sizes[h])`` tokens from ``sink`` per KV head: head ``h``'s tokens ``perms[h]`` (a
    permutation) dealt to its clusters in order, each cluster's ascending (as ``build_cluster_index`` keeps
    them); centroids of small integers when ``values`` (ties), standard normal otherwise."""
    heads, count = len(sizes), len(sizes[0])
    size = torch.tensor(sizes, dtype=torch.int64)
    offsets = size.cumsum(1) - size
    positions = torch.tensor(perms, dtype=torch.int64).reshape(heads, sum(sizes[0])) + sink
    for h in range(heads):
        for c in range(count):
            o, s = int(offsets[h, c]), int(size[h, c])
            positions[h, o : o + s] = positions[h, o : o + s].sort().values
    return ClusterIndex(
        start=sink,
        end=sink + positions.shape[1],
        centroids=_values(gen, (heads, count, DIM), values).to(dtype),
        value_sums=torch.randn(heads, count, DIM, generator=gen),
        sizes=size.to(torch.int32),
        offsets=offsets,
        sorted_positions=positions.to(torch.int32),
    )


def _values(gen, shape, values: int) -> torch.Tensor:
    if values:
        return torch.randint(-values, values + 1, shape, generator=gen).float()
    return torch.randn(shape, generator=gen)


@st.composite
def _partition(draw, total: int, parts: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


@st.composite
def _scenario(draw):
    """``(arena, batch, sink, width, widths, avg)`` as a step's plan makes them: every selecting row's budget at
    most ``width - sink``, its retrieved and estimated counts within ``widths`` and together at most its
    clusters; its index's positions a permutation of ``[sink, end)``, then a tail of at least one token. The
    arena holds garbage wherever no index was written."""
    heads, group, sink = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 4))
    avg, block = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4]))
    width, estimating = draw(st.integers(1, 24)), draw(st.booleans())
    kinds = draw(st.lists(st.sampled_from(["indexed", "indexed", "unindexed", "padding"]), min_size=1, max_size=4))
    values, dtype = draw(st.sampled_from([0, 1, 2])), draw(st.sampled_from([torch.float32, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = []
    for kind in kinds:
        if kind == "indexed":
            count, tokens = draw(st.integers(1, 7)), draw(st.integers(0, 14))
            sizes = [draw(_partition(tokens, count)) for _ in range(heads)]
            perms = [draw(st.permutations(range(tokens))) for _ in range(heads)]
            kv = sink + tokens + draw(st.integers(1, 6))
            budget = draw(st.integers(0, max(0, width - sink)))
            rows.append((kind, _index(sizes, perms, sink, gen, dtype, values), kv, budget))
        elif kind == "unindexed":  # reads the sink and [end, kv)
            kv = draw(st.integers(1, 20))
            rows.append((kind, draw(st.integers(0, kv + 1)), kv, 0))
        else:
            rows.append((kind, None, draw(st.integers(0, 3)), 0))
    indexes = [r[1] for r in rows if r[0] == "indexed"]
    cap_tokens = max([i.sorted_positions.shape[1] for i in indexes] + [1]) + draw(st.integers(0, 2))
    cap_clusters = max([i.num_clusters for i in indexes] + [1]) + draw(st.integers(0, 2))
    need = max([kv for _, _, kv, _ in rows] + [cap_clusters * avg])
    max_pages = -(-need // block) + draw(st.integers(0, 1))
    num_rows = max(1, len(indexes)) + draw(st.integers(0, 1))
    codes = draw(st.booleans())  # centroids as int8 codes with a scale each
    arena = ClusterArena(
        1, num_rows, cap_tokens, cap_clusters, heads, DIM, dtype, "cpu", plan_rows=len(rows) + 1, centroid_codes=codes
    )
    _garbage(arena, gen, values, cap_tokens)
    for i in draw(st.permutations(range(len(indexes)))):  # decode rows in another order than arena rows
        arena.write(i, 0, indexes[i])
    columns = max(1, max_pages * block // avg)
    widths = (draw(st.integers(1, columns)), draw(st.integers(1, columns)) if estimating else 0)
    plan, written = [], 0
    for kind, index, _, budget in rows:
        if kind == "indexed":
            tokens, clusters = arena.bases(written)
            count = index.num_clusters
            retrieved = draw(st.integers(1, min(count, widths[0])))
            estimated = draw(st.integers(0, min(count - retrieved, widths[1])))
            plan.append((tokens, clusters, count, index.end, budget, retrieved, estimated))
            written += 1
        else:
            plan.append((0, 0, 0, index or 0, 0, 0, 0))
    arena.plan_rows(plan)
    query = _values(gen, (len(rows), heads * group, DIM), values).to(dtype)
    kv_lens = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int32)
    batch = DecodeBatch(query, kv_lens, empty, torch.zeros_like(kv_lens), max_pages, block, sm_scale=DIM**-0.5)
    return arena, batch, sink, width, widths, avg


def _garbage(arena: ClusterArena, gen, values: int, tokens: int) -> None:
    """Arena contents no row's plan reads as its own (a row's columns run past its index into the next)."""
    centroids, sizes, offsets, positions, value_sums = arena.layers[0]
    if arena.centroid_scales is None:
        centroids.copy_(_values(gen, centroids.shape, values))
    else:
        centroids.copy_(torch.randint(-127, 128, centroids.shape, generator=gen))
        arena.centroid_scales[0].copy_(torch.rand(arena.centroid_scales[0].shape, generator=gen))
    sizes.copy_(torch.randint(0, 5, sizes.shape, generator=gen))
    offsets.copy_(torch.randint(0, tokens, offsets.shape, generator=gen))
    positions.copy_(torch.randint(0, 3, positions.shape, generator=gen))
    value_sums.copy_(torch.randn(value_sums.shape, generator=gen))


def _both(arena, batch, sink: int, width: int, widths: tuple[int, int], avg: int = 1):
    fast = rank_arena_clusters(arena, 0, batch, avg, DIM, widths=widths)
    ref = rank_arena_clusters_reference(arena, 0, batch, avg, DIM, widths=widths)
    return fast, ref


def _assert_equal(arena, batch, sink, width, widths, avg: int = 1, backend: str = "auto") -> None:
    fast, ref = _both(arena, batch, sink, width, widths, avg)
    assert fast.columns == ref.columns and torch.equal(fast.order, ref.order)  # the same layout
    slots, ids = pick_clusters(arena, 0, batch, fast, sink=sink, width=width, widths=widths, backend=backend)
    want = cluster_slots_reference(arena, 0, batch, ref, sink=sink, width=width)
    assert torch.equal(slots.sort(-1).values, want)  # the same slots; the fast path leaves them in rank order
    assert (ids is None) == (widths[1] == 0)
    if widths[1] > 0:
        want = estimated_cluster_ids_reference(arena, batch, ref, sum(widths))
        assert torch.equal(ids, want)


@settings(max_examples=250, deadline=None)
@given(case=_scenario())
def test_fast_selection_equals_the_full_sort_reference(case):
    _assert_equal(*case)


@settings(max_examples=30, deadline=None)
@given(case=_scenario(), small_one_launch=st.booleans())
def test_triton_picks_equal_the_full_sort_reference(case, small_one_launch):
    """The picks' Triton kernels (interpreted on CPU, native on CUDA) give the torch path's slots, in the same
    rank order, and its estimated clusters: both variants (``ONE_LAUNCH``: one kernel, or the running sums' then
    the slots') at the default tiles; at small tiles (several of the running sums, of the ids and of the slots)
    the one drawn, which costs no more test time than one variant."""
    from sparse_kernels._triton import cluster_picks as picks_mod

    arena, batch, sink, width, widths, avg = case
    fast = _both(*case)[0]
    want = pick_clusters(arena, 0, batch, fast, sink=sink, width=width, widths=widths, backend="reference")
    saved = picks_mod.BLOCK, picks_mod.BLOCK_E, picks_mod.BLOCK_W, picks_mod.ONE_LAUNCH
    try:
        picks_mod.ONE_LAUNCH = True
        _assert_equal(*case, backend="triton")
        for small, one_launch in ((False, False), (True, small_one_launch)):
            picks_mod.ONE_LAUNCH = one_launch
            if small:
                picks_mod.BLOCK, picks_mod.BLOCK_E, picks_mod.BLOCK_W = 2, 2, 4
            got = pick_clusters(arena, 0, batch, fast, sink=sink, width=width, widths=widths, backend="triton")
            assert torch.equal(got[0], want[0]) and (widths[1] == 0 or torch.equal(got[1], want[1]))
    finally:
        picks_mod.BLOCK, picks_mod.BLOCK_E, picks_mod.BLOCK_W, picks_mod.ONE_LAUNCH = saved


def _single_token_clusters(heads: int = 2, count: int = 12, sink: int = 2):
    """One row of ``count`` one-token clusters (the most clusters a budget can reach), centroids all equal
    but two (ties everywhere), and a padding row."""
    gen = torch.Generator().manual_seed(3)
    perms = [torch.randperm(count, generator=gen).tolist() for _ in range(heads)]
    index = _index([[1] * count] * heads, perms, sink, gen, torch.float32, values=0)
    index.centroids.zero_()
    index.centroids[:, 5] = 1.0
    index.centroids[:, 9] = 1.0
    arena = ClusterArena(1, 1, count, count, heads, DIM, torch.float32, "cpu", plan_rows=2)
    arena.write("a", 0, index)
    query = torch.ones(2, heads, DIM)
    batch = DecodeBatch(query, torch.tensor([index.end + 3, 1]), torch.zeros(0), torch.zeros(2), count + 5, 1)
    return arena, batch, index


@pytest.mark.parametrize(("budget", "retrieved"), [(0, 3), (1, 3), (2, 3), (5, 3), (9, 3), (5, 12)])
def test_a_budget_reads_the_retrieved_clusters_first_and_the_rest_are_estimated(budget, retrieved):
    """One-token clusters (the most clusters a budget can reach): a row reads ``budget`` clusters in the
    selection's order, the retrieved ones best first (ties to the lower cluster), then the estimated ones in
    cluster order; the best ``retrieved + estimated`` it does not read are estimated."""
    sink, width, estimated = 2, 2 + budget, 4
    arena, batch, index = _single_token_clusters(sink=sink)
    arena.plan_rows([(0, 0, index.num_clusters, index.end, budget, retrieved, estimated)])
    widths = (index.num_clusters, estimated)
    _assert_equal(arena, batch, sink, width, widths)
    fast = _both(arena, batch, sink, width, widths)[0]
    assert fast.order[0, :, :3].tolist() == [[5, 9, 0]] * 2  # the two best, then ties to the lower cluster
    _, ids = pick_clusters(arena, 0, batch, fast, sink=sink, width=width, widths=widths)
    read, ranked = min(budget, index.num_clusters), min(retrieved + estimated, index.num_clusters)
    assert (ids[0] >= 0).sum(-1).tolist() == [max(0, ranked - read)] * 2
    assert torch.equal(ids[0, :, : max(0, ranked - read)], fast.order[0, :, read:ranked])
    state = estimate_clusters(arena, 0, batch, ids)
    assert bool(state.lse[0].isfinite().all()) == (read < ranked) and not state.lse[1].isfinite().any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the half-precision ranking runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_ranking_equals_the_reference(dtype):
    """bf16/fp16 centroids and queries multiply in one matmul accumulating in float32 (no float32 copy of
    the centroids): with small integers every product and sum is exact, so it equals the reference's
    float32 einsum bit for bit, and so do the slots and estimated clusters."""
    gen = torch.Generator().manual_seed(5)
    heads, count, sink, width, widths = 4, 64, 3, 40, (12, 16)
    arena = ClusterArena(1, 3, 4 * count, count, heads, DIM, dtype, "cuda", plan_rows=3)
    plan = []
    for r in range(3):
        sizes = [torch.multinomial(torch.ones(count), 4 * count, True, generator=gen).bincount(minlength=count)]
        perms = [torch.randperm(4 * count, generator=gen).tolist() for _ in range(heads)]
        index = _index([sizes[0].tolist()] * heads, perms, sink, gen, dtype, values=2)
        arena.write(r, 0, ClusterIndex(*[t.cuda() if torch.is_tensor(t) else t for t in _fields(index)]))
        plan.append((*arena.bases(r), count, index.end, width - sink - 5 * r, 10 + r, 14 + r))
    arena.plan_rows(plan)
    query = _values(gen, (3, heads * 2, DIM), 2).to(dtype).cuda()
    kv = torch.tensor([4 * count + sink + 4] * 3, device="cuda")
    batch = DecodeBatch(query, kv, kv[:0], kv, -(-int(kv[0]) // 16), 16, sm_scale=DIM**-0.5)
    _assert_equal(arena, batch, sink, width, widths)


def _fields(index: ClusterIndex) -> tuple:
    return tuple(getattr(index, name) for name in ClusterIndex.__slots__)
