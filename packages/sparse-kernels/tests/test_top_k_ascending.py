"""top_k_ascending (Triton and reference) against a stable descending sort: the k largest per row,
ties to the lower column, ascending output; infinities, ties and signed zeros included."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.top_k_ascending import top_k_ascending


def _expected(scores: torch.Tensor, k: int) -> torch.Tensor:
    rows = []
    for row in scores.reshape(-1, scores.shape[-1]).tolist():
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        rows.append(sorted(order))
    return torch.tensor(rows, dtype=torch.int64).view(*scores.shape[:-1], k)


def _rows(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, n, generator=gen)
    x[0, 0, : n // 2] = 0.25  # many ties at the threshold
    x[0, 1] = torch.randint(-3, 3, (n,), generator=gen).float()  # integer ties everywhere
    x[1, 0, :3] = float("inf")  # forced entries
    x[1, 0, n - 5 :] = float("-inf")  # entries past a row
    x[1, 1] = -0.0
    x[1, 1, ::3] = 0.0  # signed zeros are one value
    x[2, 0] = -torch.rand(n, generator=gen) - 1.0  # all negative
    return x


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (37, 5), (300, 128), (300, 300), (1000, 999), (8448, 128)])
def test_top_k_ascending_equals_a_stable_sort(backend, n, k, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    scores = _rows(n, seed=n + k)
    got = top_k_ascending(scores.to(device), k, backend=backend)
    assert got.dtype == torch.int64 and got.shape == (3, 2, k)
    assert torch.equal(got.cpu(), _expected(scores, k))


def test_out_is_written_in_place_and_checked(triton_device):
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    out = torch.full((4, 7), -1, dtype=torch.int64, device=triton_device)
    assert top_k_ascending(scores.to(triton_device), 7, out, backend="triton") is out
    assert torch.equal(out.cpu(), _expected(scores, 7))
    with pytest.raises(ValueError):
        top_k_ascending(scores, 51)
    with pytest.raises(ValueError):
        top_k_ascending(scores, 3, torch.empty(4, 3, dtype=torch.int32))


@pytest.mark.parametrize(("n", "k"), [(300, 10), (300, 16), (257, 28)])
def test_wide_rows_in_two_stages_equal_a_stable_sort(n, k, triton_device, monkeypatch):
    """Rows wider than one program (here made small): per-tile candidates, then the row's pick; short
    last tiles (fewer columns than k) and ties across tiles included."""
    from sparse_kernels._triton import top_k_ascending as kernel

    monkeypatch.setattr(kernel, "MAX_COLUMNS", 256)
    monkeypatch.setattr(kernel, "TILE", 32)
    assert n > kernel.MAX_COLUMNS and kernel.fits(n, k)
    scores = _rows(n, seed=7 * n + k)
    got = top_k_ascending(scores.to(triton_device), k, backend="triton")
    assert torch.equal(got.cpu(), _expected(scores, k))


def test_omnikv_bench_width_equals_the_reference(triton_device):
    """OmniKV's bench shape (2048 of 135168 tokens, sink/recent forced, tokens past the row -inf), two stages."""
    gen = torch.Generator().manual_seed(11)
    scores = torch.rand(2, 135168, generator=gen)
    scores[:, :64] = float("inf")
    scores[0, 131073 - 512 : 131073] = float("inf")
    scores[0, 131073:] = float("-inf")
    scores[1, 5000:8000] = 0.99  # a run of ties at the threshold
    got = top_k_ascending(scores.to(triton_device), 2048, backend="triton")
    assert torch.equal(got.cpu(), top_k_ascending(scores, 2048, backend="reference"))


@pytest.mark.parametrize("k", [1, 13, 50, 96, 97])
def test_ties_within_every_byte_go_to_the_lower_column(k, triton_device):
    """17 rows of 97 whose values differ only in one byte of the key (a few ulps apart, or only in the
    exponent), so each of the four radix passes decides some row; every row has runs of equal values
    across the k-th largest, which go to the lower columns."""
    gen = torch.Generator().manual_seed(k)
    ulps = torch.randint(0, 4, (17, 97), generator=gen)  # entry j of row r: ulps[r, j] steps above its base
    bases = torch.tensor(([1.0, -1.0, 3.5e-39, -(2.0**100), 0.0, 7.0] * 3)[:17])
    scores = bases[:, None].expand(17, 97).clone()
    for step in range(3):
        scores = torch.where(ulps > step, torch.nextafter(scores, torch.tensor(float("inf"))), scores)
    scores[5] = torch.ldexp(torch.ones(97), torch.randint(-3, 3, (97,), generator=gen))  # exponent byte only
    got = top_k_ascending(scores.to(triton_device), k, backend="triton")
    assert torch.equal(got.cpu(), _expected(scores, k))
