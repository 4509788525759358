"""RetroInfer's estimation term: Triton equals the reference (padding ids, empty clusters, rows that
estimate nothing), the reference equals a per-cluster loop, the scores from the ranking's logits equal those
from the centroids, and merging it with the exact part is one softmax."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_kernels.cluster_estimation import cluster_estimation
from sparse_kernels.cluster_logits import cluster_logits
from sparse_kernels.merge_states import merge_states, merge_states_


def _case(dtype, seed=0, batch=3, q_heads=4, heads=2, count=40, dim=24, est=37):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    centroids = torch.randn(heads, count, dim, generator=gen).to(dtype)
    value_sums = torch.randn(heads, count, dim, generator=gen) * 5
    sizes = torch.randint(0, 30, (heads, count), generator=gen, dtype=torch.int32)
    sizes[:, :3] = 0  # empty clusters
    clusters = torch.stack([torch.randperm(count, generator=gen)[:est] for _ in range(batch * heads)]).view(
        batch, heads, est
    )
    clusters[0, :, -5:] = -1  # padding
    if batch > 2:
        clusters[2, 1] = -1  # a row that estimates nothing
    return query, centroids, value_sums, sizes, clusters


def test_bf16_value_sums_are_read_as_their_float32_values():
    query, centroids, value_sums, sizes, clusters = _case(torch.float32, seed=3)
    half = value_sums.to(torch.bfloat16)
    got = cluster_estimation(query, centroids, half, sizes, clusters, scale=0.2, backend="reference")
    want = cluster_estimation(query, centroids, half.float(), sizes, clusters, scale=0.2, backend="reference")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].dtype == torch.float32
    with pytest.raises(ValueError, match="value_sums"):
        cluster_estimation(query, centroids, value_sums.to(torch.int32), sizes, clusters, scale=0.2)


def test_reference_equals_per_cluster_loop():
    query, centroids, value_sums, sizes, clusters = _case(torch.float64)
    out, lse = cluster_estimation(query, centroids, value_sums, sizes, clusters, scale=0.2, backend="reference")
    group = query.shape[1] // centroids.shape[0]
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            kv = h // group
            num, den = torch.zeros(query.shape[2], dtype=torch.float64), 0.0
            for c in clusters[b, kv].tolist():
                if c >= 0 and sizes[kv, c] > 0:
                    w = math.exp(0.2 * float(query[b, h].double() @ centroids[kv, c].double()))
                    num, den = num + w * value_sums[kv, c].double(), den + w * int(sizes[kv, c])
            if den == 0:
                assert lse[b, h] == float("-inf") and (out[b, h] == 0).all()
            else:
                torch.testing.assert_close(out[b, h].double(), num / den, rtol=1e-5, atol=1e-5)
                assert abs(float(lse[b, h]) - math.log(den)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(batch=1, q_heads=2, heads=1, count=80, est=70)])  # 2, 3 splits
@pytest.mark.parametrize("sums", [torch.float32, torch.bfloat16])  # the arena's value sums: float32 or bf16
def test_triton_equals_reference(dtype, shape, sums, triton_device, ieee_values):
    query, centroids, value_sums, sizes, clusters = _case(dtype, seed=1, **shape)
    value_sums = value_sums.to(sums)
    want = cluster_estimation(query, centroids, value_sums, sizes, clusters, scale=0.2, backend="reference")
    args = [t.to(triton_device) for t in (query, centroids, value_sums, sizes, clusters)]
    got = cluster_estimation(*args, scale=0.2, backend="triton")
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [dict(), dict(batch=1, q_heads=2, heads=1, count=80, est=70)])  # 2, 3 splits
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_partial_states_reduce_to_the_merged_one(shape, backend, triton_device, ieee_values):
    """``partial=True``: the Triton path's split states unmerged (``S`` of them, the reference one), and
    ``reduce_states`` of them equals the merged estimation (rows that estimate nothing: all splits empty)."""
    from sparse_kernels.merge_states import reduce_states

    device = triton_device if backend == "triton" else "cpu"
    args = [t.to(device) for t in _case(torch.float32, seed=2, **shape)]
    want = cluster_estimation(*args, scale=0.2, backend=backend)
    out, lse = cluster_estimation(*args, scale=0.2, partial=True, backend=backend)
    batch, q_heads = args[0].shape[:2]
    assert out.shape[:2] == (batch, q_heads) and out.shape[3] == args[0].shape[2] and lse.shape == out.shape[:3]
    assert out.shape[2] == (1 if backend == "reference" else out.shape[2]) and out.stride(3) == 1
    if backend == "triton" and not shape:
        assert out.shape[2] > 1  # the default case runs several splits
    got = reduce_states(out, lse)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.fixture
def ieee_values(monkeypatch):
    """The value-sum product in IEEE float32 on CUDA too (the interpreter's always is), so the Triton path is
    held to the reference at float32 rounding; ``test_tf32_value_product_within_its_rounding`` covers TF32."""
    from sparse_kernels._triton import cluster_estimation as est_mod

    monkeypatch.setattr(est_mod, "VALUE_PRECISION", "ieee")


@pytest.mark.parametrize("sums", [torch.float32, torch.bfloat16])
def test_tf32_value_product_within_its_rounding(sums, triton_device):
    """The default on CUDA: the weights and the value sums enter one TF32 product (10-bit mantissas), so each
    term is off by at most ~2 ** -10 of itself: the output within 2 ** -10 of the sum of the terms' magnitudes
    (from the reference), the log-sum-exp (not in that product) at float32 rounding."""
    query, centroids, value_sums, sizes, clusters = _case(torch.bfloat16, seed=4)
    value_sums = value_sums.to(sums)
    want = cluster_estimation(query, centroids, value_sums, sizes, clusters, scale=0.2, backend="reference")
    bound = cluster_estimation(query, centroids, value_sums.abs(), sizes, clusters, scale=0.2, backend="reference")
    args = [t.to(triton_device) for t in (query, centroids, value_sums, sizes, clusters)]
    got = cluster_estimation(*args, scale=0.2, backend="triton")
    assert ((got[0].cpu() - want[0]).abs() <= 2**-10 * bound[0] + 1e-5).all()
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


def _logits_case(dtype, seed=3, n=3, group=2, heads=2, dim=24, columns=40, est=40):  # 2 splits
    """An arena of ``n`` rows' clusters (row ``r``'s at ``bases[r] + c``, ``counts[r]`` of them), the ranking's
    logits at scale 0.3 over ``columns`` columns, and estimated ids: arena ids of the row's columns, of
    columns past its count (``-inf`` logits) or past the logits' width or before the row's base (another
    row's clusters), and ``-1``."""
    gen = torch.Generator().manual_seed(seed)
    bases, counts = torch.tensor([0, 34, 70][:n]), torch.tensor([30, 22, 25][:n])
    total = 110
    query = torch.randn(n, heads * group, dim, generator=gen).to(dtype)
    centroids = torch.randn(heads, total, dim, generator=gen).to(dtype)
    value_sums = torch.randn(heads, total, dim, generator=gen) * 5
    sizes = torch.randint(0, 30, (heads, total), generator=gen, dtype=torch.int32)
    sizes[:, bases] = 0  # each row's first cluster is empty
    ranked = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=0.3, backend="reference")
    cols = torch.stack([torch.randperm(columns + 6, generator=gen)[:est] - 3 for _ in range(n * heads)])
    ids = cols.view(n, heads, est) + bases[:, None, None]
    ids[0, :, -4:] = -1  # padding
    ids[n - 1, 0] = -1  # a row and KV head that estimate nothing
    col = ids - bases[:, None, None]
    counted = torch.where((ids >= 0) & (col >= 0) & (col < counts[:, None, None]), ids, -1)  # what counts
    assert ((counted < 0) & (ids >= 0)).sum() > 8  # ids past a row's count or logits, or another row's
    return query, centroids, value_sums, sizes, ids, counted, ranked.logits, bases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimation_from_the_rankings_logits_equals_from_centroids(dtype, triton_device, ieee_values):
    """Scores from the ranking's logits (made at scale 0.3, the attention's 0.2) equal those from the
    centroids, on the torch and the Triton path: empty clusters, ``-1`` ids, columns past a row's count or
    outside its logits count nothing (the centroid path is given those ids as ``-1``)."""
    query, centroids, value_sums, sizes, ids, counted, logits, bases = _logits_case(dtype)
    want = cluster_estimation(query, centroids, value_sums, sizes, counted, scale=0.2, backend="reference")
    assert want[1].isfinite().any() and not want[1].isfinite().all()
    fast = dict(logits=logits, bases=bases, logits_scale=0.3)
    got = cluster_estimation(query, centroids, value_sums, sizes, ids, scale=0.2, **fast, backend="reference")
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    args = [t.to(triton_device) for t in (query, centroids, value_sums, sizes, ids)]
    fast = dict(logits=logits.to(triton_device), bases=bases.to(triton_device), logits_scale=0.3)
    got = cluster_estimation(*args, scale=0.2, **fast, backend="triton")
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


def test_estimation_from_logits_checks_its_inputs():
    query, centroids, value_sums, sizes, ids, _, logits, bases = _logits_case(torch.float32)
    args = (query, centroids, value_sums, sizes, ids)
    with pytest.raises(ValueError, match="bases"):
        cluster_estimation(*args, scale=0.2, logits=logits, logits_scale=0.3)
    with pytest.raises(ValueError, match="logits must be"):
        cluster_estimation(*args, scale=0.2, logits=logits[:, :1], bases=bases, logits_scale=0.3)


def test_merge_is_one_softmax():
    gen = torch.Generator().manual_seed(2)
    logits, values = (
        torch.randn(3, 50, generator=gen, dtype=torch.float64),
        torch.randn(50, 8, generator=gen, dtype=torch.float64),
    )
    parts = []
    for sl in (slice(0, 20), slice(20, 50)):
        parts += [torch.softmax(logits[:, sl], -1) @ values[sl], torch.logsumexp(logits[:, sl], -1)]
    torch.testing.assert_close(merge_states(*parts), torch.softmax(logits, -1) @ values)
    empty = merge_states(
        parts[0], parts[1], torch.zeros(3, 8, dtype=torch.float64), torch.full((3,), float("-inf"), dtype=torch.float64)
    )
    torch.testing.assert_close(empty, parts[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_merge_equals_merge_states(dtype, triton_device):
    """``merge_states_`` (Triton, and the reference) writes ``merge_states`` into the first output, including a
    strided one and rows whose second state is empty (``lse -inf``)."""
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(3, 6, 40, generator=gen).to(dtype)
    out_a = big[:, ::2, :24]  # [3, 3, 24], strided rows
    lse_a, lse_b = torch.randn(3, 3, generator=gen), torch.randn(3, 3, generator=gen)
    out_b = torch.randn(3, 3, 24, generator=gen)
    lse_b[1, 2] = float("-inf")
    out_b[1, 2] = 0.0
    want = merge_states(out_a.float(), lse_a, out_b, lse_b).to(dtype)
    for backend in ("reference", "triton"):
        dev = big.to(triton_device, copy=True)
        args = [t.to(triton_device) for t in (lse_a, out_b, lse_b)]
        got = merge_states_(dev[:, ::2, :24], args[0], args[1], args[2], backend=backend)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding step apart at most
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(dev[:, 1::2].cpu(), big[:, 1::2])  # the rows between are untouched
    with pytest.raises(ValueError, match="share a shape"):
        merge_states_(out_a, lse_a, out_b[:, :2], lse_b)


def test_in_place_merge_reads_transposed_second_states(triton_device):
    """The cascade prefill's merge: the second state comes as a transposed view (``[T, H, D]`` of a head-major
    ``[H, T, D]`` tensor, in bf16) and its LSE as the transpose of ``[H, T]``; both merge without a copy into
    the first state, equal to ``merge_states`` on contiguous copies."""
    gen = torch.Generator().manual_seed(9)
    t, h, d = 5, 4, 24
    out_a = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    lse_a = torch.randn(t, h, generator=gen)
    out_b = torch.randn(h, t, d, generator=gen).to(torch.bfloat16).transpose(0, 1)
    lse_b = torch.randn(h, t, generator=gen).T
    want = merge_states(out_a.float(), lse_a, out_b.float().contiguous(), lse_b.contiguous()).to(torch.bfloat16)
    for backend in ("reference", "triton"):
        dev = out_a.to(triton_device, copy=True)
        args = [x.to(triton_device) for x in (lse_a, out_b, lse_b)]
        got = merge_states_(dev, args[0], args[1], args[2], backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)


def test_merge_into_a_third_tensor(triton_device):
    """The cascade prefill's square + prefix merge: both states as cuDNN returns them (token-major, bf16), written
    into a row slice of the step's output; the two states stay as they were."""
    gen = torch.Generator().manual_seed(10)
    t, h, d = 6, 4, 24
    out_a = torch.randn(h, t, d, generator=gen).to(torch.bfloat16).transpose(0, 1)
    out_b = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    lse_a, lse_b = torch.randn(t, h, generator=gen), torch.randn(h, t, generator=gen).T
    want = merge_states(out_a.float(), lse_a, out_b.float(), lse_b.contiguous()).to(torch.bfloat16)
    for backend in ("reference", "triton"):
        a, b, la, lb = (x.to(triton_device, copy=True) for x in (out_a, out_b, lse_a, lse_b))
        step = torch.zeros(t + 3, h, d, dtype=torch.bfloat16, device=triton_device)
        got = merge_states_(a, la, b, lb, out=step[2 : 2 + t], backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)
        assert torch.equal(a.cpu(), out_a) and torch.equal(b.cpu(), out_b)
        assert not step[:2].any() and not step[2 + t :].any()


@pytest.mark.parametrize("from_logits", [False, True])
def test_an_empty_clusters_rows_are_never_used(from_logits, triton_device, ieee_values):
    """The Triton path reads an empty cluster's centroid and value sum without waiting for its size (the loads
    are issued together) and drops them after: NaN there changes nothing."""
    query, centroids, value_sums, sizes, clusters = _case(torch.float32, seed=2)
    want = cluster_estimation(query, centroids, value_sums, sizes, clusters, scale=0.2, backend="reference")
    empty = sizes == 0
    dirty_c, dirty_v = centroids.clone(), value_sums.clone()
    dirty_c[empty], dirty_v[empty] = float("nan"), float("nan")
    args = [t.to(triton_device) for t in (query, dirty_c, dirty_v, sizes, clusters)]
    kwargs = {}
    if from_logits:
        bases = torch.zeros(3, dtype=torch.int64, device=triton_device)
        counts = torch.full((3,), 40, device=triton_device)
        ranked = cluster_logits(args[0], args[1], args[3], bases, counts, 40, scale=0.2, backend="triton")
        kwargs = dict(logits=ranked.logits, bases=bases, logits_scale=0.2)
    got = cluster_estimation(*args, scale=0.2, backend="triton", **kwargs)
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)
