"""RetroInfer's ranking logits straight from the arena: the reference (float32) equals a per-column loop, Triton equals
the reference (rows at different bases, columns past a row's count, empty clusters, clamped columns; a tile a
program, or several in one program's loop, the last program's running past the tiles); the tiles' softmax
statistics, merged, are each head's max and sum of exponentials over all its columns."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_kernels.cluster_logits import cluster_logits


def _case(dtype, seed=0, n=3, q_heads=4, heads=2, total=300, dim=24):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(n, q_heads, dim, generator=gen).to(dtype)
    centroids = torch.randn(heads, total, dim, generator=gen).to(dtype)
    sizes = torch.randint(0, 9, (heads, total), generator=gen, dtype=torch.int32)
    bases = torch.tensor([0, 100, 250][:n])  # the last row's columns run past the arena: clamped
    counts = torch.tensor([90, 7, 140][:n])
    return query, centroids, sizes, bases, counts


def test_reference_equals_per_column_loop():
    query, centroids, sizes, bases, counts = _case(torch.float64)
    logits, size, tile_max, tile_sum = cluster_logits(
        query, centroids, sizes, bases, counts, 130, scale=0.3, backend="reference"
    )
    assert logits.shape == (3, 2, 2, 130) and size.shape == (3, 2, 130) and tile_max.shape == (3, 2, 2, 1)
    for r in range(3):
        for h in range(2):
            for c in range(130):
                col = min(int(bases[r]) + c, 299)
                s = int(sizes[h, col]) if c < counts[r] else 0
                assert size[r, h, c] == s
                for g in range(2):
                    want = float("-inf") if s == 0 else 0.3 * float(query[r, h * 2 + g] @ centroids[h, col])
                    got = float(logits[r, h, g, c])
                    assert got == want if s == 0 else abs(got - want) < 1e-5 * (1 + abs(want))
            for g in range(2):
                live = [float(x) for x in logits[r, h, g] if x > float("-inf")]
                top = max(live, default=float("-inf"))
                assert float(tile_max[r, h, g, 0]) == top
                want = sum(math.exp(x - top) for x in live)
                assert abs(float(tile_sum[r, h, g, 0]) - want) < 1e-6 * (1 + want)  # float32 logits


def _merged(tile_max, tile_sum):
    top = tile_max.amax(-1)
    return top, (tile_sum * (tile_max - top.nan_to_num(neginf=0.0)[..., None]).exp()).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [130, 256])
@pytest.mark.parametrize("block_c, tiles_per_program", [(128, 1), (32, 3)])  # 3: the last program runs past
def test_triton_equals_reference(dtype, columns, block_c, tiles_per_program, triton_device, monkeypatch):
    from sparse_kernels._triton import cluster_logits as logits_mod

    monkeypatch.setattr(logits_mod, "BLOCK_C", block_c)
    monkeypatch.setattr(logits_mod, "TILES_PER_PROGRAM", tiles_per_program)
    query, centroids, sizes, bases, counts = _case(dtype, seed=1)
    want = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=0.3, backend="reference")
    args = [t.to(triton_device) for t in (query, centroids, sizes, bases, counts)]
    got = cluster_logits(*args, columns, scale=0.3, backend="triton")
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    assert got[2].shape[-1] == -(-columns // block_c) > 1  # statistics per tile
    for g, w in zip(_merged(*got[2:]), _merged(*want[2:]), strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_refused():
    query, centroids, sizes, bases, counts = _case(torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        cluster_logits(query[:, :3], centroids, sizes, bases, counts, 10, scale=1.0)
    with pytest.raises(ValueError, match="columns"):
        cluster_logits(query, centroids, sizes, bases, counts, 0, scale=1.0)


def test_an_empty_clusters_centroid_is_never_used(triton_device):
    """An empty cluster's logit is -inf whatever its centroid holds: NaN there changes nothing."""
    query, centroids, sizes, bases, counts = _case(torch.float32, seed=3)
    want = cluster_logits(query, centroids, sizes, bases, counts, 130, scale=0.3, backend="reference")
    dirty = centroids.clone()
    dirty[sizes == 0] = float("nan")
    args = [t.to(triton_device) for t in (query, dirty, sizes, bases, counts)]
    got = cluster_logits(*args, 130, scale=0.3, backend="triton")
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    for g, w in zip(_merged(*got[2:]), _merged(*want[2:]), strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)


def test_centroid_codes_round_to_nearest_and_stand_for_their_centroid():
    """Codes against the formula written out: scale = amax / 127 per centroid, code = round(x / scale), the
    largest magnitude coded +-127 exactly; a zero centroid has scale 1 and codes 0; decoding is off by at most
    half a step."""
    from sparse_kernels.cluster_logits import decode_centroids, encode_centroids

    gen = torch.Generator().manual_seed(5)
    centroids = torch.randn(2, 9, 16, generator=gen).bfloat16()
    centroids[1, 4] = 0
    codes, scale = encode_centroids(centroids)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2, 9)
    x = centroids.float()
    for h in range(2):
        for c in range(9):
            amax = float(x[h, c].abs().max())
            s = amax / 127 if amax > 0 else 1.0
            assert math.isclose(float(scale[h, c]), s, rel_tol=1e-6)
            want = [max(-127, min(127, round(float(v) / float(scale[h, c])))) for v in x[h, c]]
            assert codes[h, c].tolist() == want
    assert codes[1, 4].abs().sum() == 0 and scale[1, 4] == 1
    assert (codes.abs().amax(-1)[scale != 1] == 127).all()
    err = (decode_centroids(codes, scale) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_coded_centroids_triton_equals_the_decoded_reference(dtype, triton_device):
    """int8 codes with a scale per centroid: the reference's logits are those of the decoded centroids (exactly
    the reference over ``decode_centroids``), and the Triton kernel's equal them."""
    from sparse_kernels.cluster_logits import decode_centroids, encode_centroids

    query, centroids, sizes, bases, counts = _case(dtype, seed=4)
    codes, cscale = encode_centroids(centroids)
    want = cluster_logits(
        query, codes, sizes, bases, counts, 130, scale=0.3, centroid_scale=cscale, backend="reference"
    )
    plain = cluster_logits(query, decode_centroids(codes, cscale), sizes, bases, counts, 130, scale=0.3)
    for a, b in zip(want, plain, strict=True):
        assert torch.equal(a, b)
    args = [t.to(triton_device) for t in (query, codes, sizes, bases, counts)]
    got = cluster_logits(*args, 130, scale=0.3, centroid_scale=cscale.to(triton_device), backend="triton")
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-4)
    for g, w in zip(_merged(*got[2:]), _merged(*want[2:]), strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="centroid_scale"):
        cluster_logits(query, codes, sizes, bases, counts, 130, scale=0.3)
    with pytest.raises(ValueError, match="centroid_scale"):
        cluster_logits(query, centroids, sizes, bases, counts, 130, scale=0.3, centroid_scale=cscale)
