"""RetroInfer's estimation term: Triton equals the reference (padding ids, empty clusters, rows that
estimate nothing), the reference equals a per-cluster loop, and merging it with the exact part is one softmax."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_kernels.cluster_estimation import cluster_estimation
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
def test_triton_equals_reference(dtype, shape, triton_device):
    query, centroids, value_sums, sizes, clusters = _case(dtype, seed=1, **shape)
    want = cluster_estimation(query, centroids, value_sums, sizes, clusters, scale=0.2, backend="reference")
    args = [t.to(triton_device) for t in (query, centroids, value_sums, sizes, clusters)]
    got = cluster_estimation(*args, scale=0.2, backend="triton")
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


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
