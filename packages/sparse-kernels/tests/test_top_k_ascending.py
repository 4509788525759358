"""top_k_ascending (Triton and reference) against a stable descending sort: the k largest per row,
ties to the lower column, ascending output; infinities, ties and signed zeros included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("variant", ["packed2", "packed3", "serial", "stages"])
@pytest.mark.parametrize(("n", "k"), [(37, 5), (300, 128), (200, 28)])
def test_bfloat16_scores_equal_a_stable_sort(backend, variant, n, k, triton_device, monkeypatch):
    """bfloat16 rows (16-bit keys: half the radix passes), ties, signed zeros, infinities and negatives
    included, in one program or through candidate stages (whose kept values stay bfloat16)."""
    from sparse_kernels._triton import top_k_ascending as kernel

    if variant == "stages":
        monkeypatch.setitem(kernel.CONFIG, "single", 64)
        monkeypatch.setitem(kernel.CONFIG, "merge", 64)
        monkeypatch.setitem(kernel.CONFIG, "tile", 32)
        monkeypatch.setitem(kernel.CONFIG, "tile_per_k", 2)
    else:
        select, bits = ("serial", 2) if variant == "serial" else ("packed", int(variant[-1]))
        monkeypatch.setitem(kernel.CONFIG, "select", select)
        monkeypatch.setitem(kernel.CONFIG, "bits", bits)
    monkeypatch.setitem(kernel.CONFIG, "fused", False)
    device = triton_device if backend == "triton" else "cpu"
    scores = _rows(n, seed=5 * n + k).bfloat16()
    scores[2, 1] = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16() * 1e-3  # many near ties
    got = top_k_ascending(scores.to(device), k, backend=backend)
    assert torch.equal(got.cpu(), _expected(scores.float(), k))


def test_out_is_written_in_place_and_checked(triton_device):
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    out = torch.full((4, 7), -1, dtype=torch.int64, device=triton_device)
    assert top_k_ascending(scores.to(triton_device), 7, out, backend="triton") is out
    assert torch.equal(out.cpu(), _expected(scores, 7))
    with pytest.raises(ValueError):
        top_k_ascending(scores, 51)
    with pytest.raises(ValueError):
        top_k_ascending(scores, 3, torch.empty(4, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        top_k_ascending(scores.half(), 3)


@pytest.mark.parametrize(("n", "k"), [(300, 10), (300, 16), (257, 28)])
def test_wide_rows_in_two_stages_equal_a_stable_sort(n, k, triton_device, monkeypatch):
    """Rows wider than one program (here made small): per-tile candidates, then the row's pick; short
    last tiles (fewer columns than k) and ties across tiles included."""
    from sparse_kernels._triton import top_k_ascending as kernel

    monkeypatch.setitem(kernel.CONFIG, "single", 256)
    monkeypatch.setitem(kernel.CONFIG, "tile", 32)
    assert n > 256 and len(kernel.stages(n, k)) == 1
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


# Selectable kernels (``CONFIG`` of the Triton module): the packed passes reduce their digit counts
# word by word here (``fused`` False), which the interpreter runs fast; the fused reduction has its
# own test below.
VARIANTS = {
    "serial": {"select": "serial"},
    **{f"packed{bits}": {"select": "packed", "bits": bits, "fused": False} for bits in (1, 2, 3, 4)},
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request, monkeypatch):
    from sparse_kernels._triton import top_k_ascending as kernel

    for key, value in VARIANTS[request.param].items():
        monkeypatch.setitem(kernel.CONFIG, key, value)
    return kernel


@pytest.mark.parametrize(("n", "k"), [(1, 1), (37, 5), (97, 97), (200, 28)])
def test_every_variant_equals_a_stable_sort(variant, n, k, triton_device, monkeypatch):
    """One program per row up to 64 columns, else candidate stages of 64-column tiles (200 columns and
    k 28: 4 tiles, then 2 over the candidates, then the row's pick). Rows of ties, and of infinities."""
    monkeypatch.setitem(variant.CONFIG, "single", 64)
    monkeypatch.setitem(variant.CONFIG, "merge", 64)
    monkeypatch.setitem(variant.CONFIG, "tile", 32)
    monkeypatch.setitem(variant.CONFIG, "tile_per_k", 2)
    assert len(variant.stages(n, k)) == (2 if n == 200 else 0)
    scores = _rows(n, seed=3 * n + k)[:2, 0]
    got = top_k_ascending(scores.to(triton_device), k, backend="triton")
    assert torch.equal(got.cpu(), _expected(scores, k))


@pytest.mark.parametrize("bits", [3, 4])
def test_fused_digit_counts_equal_a_stable_sort(bits, triton_device, monkeypatch):
    """The packed select with every digit count in one reduction (its GPU setting)."""
    from sparse_kernels._triton import top_k_ascending as kernel

    monkeypatch.setitem(kernel.CONFIG, "select", "packed")
    monkeypatch.setitem(kernel.CONFIG, "bits", bits)
    monkeypatch.setitem(kernel.CONFIG, "fused", True)
    scores = _rows(20, seed=bits)[:2, 0]
    got = top_k_ascending(scores.to(triton_device), 6, backend="triton")
    assert torch.equal(got.cpu(), _expected(scores, 6))


_POOL = [float("-inf"), -3.0, -1.0, -1e-45, -0.0, 0.0, 1e-45, 0.5, 0.50000006, 2.0, float("inf")]


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(VARIANTS)),
    values=st.lists(st.one_of(st.sampled_from(_POOL), st.floats(allow_nan=False, width=32)), min_size=1, max_size=150),
    tile=st.sampled_from([16, 32, 64]),
    data=st.data(),
)
def test_variants_property(name, values, tile, data):
    """Random rows drawn around ties, signed zeros, subnormals and infinities, any k, rows of one
    program or several candidate stages: every variant equals a stable descending sort."""
    from sparse_kernels._triton import top_k_ascending as kernel
    from sparse_kernels._triton.compile_check import compiling_for

    k = data.draw(st.integers(1, len(values)))
    scores = torch.tensor([values, values[::-1]], dtype=torch.float32)
    saved = dict(kernel.CONFIG)
    try:
        kernel.CONFIG.update(VARIANTS[name], single=tile, merge=tile, tile=tile)
        with compiling_for(None):  # every variant compiles in the tests above; here only the interpreter
            got = top_k_ascending(scores, k, backend="triton")
    finally:
        kernel.CONFIG.update(saved)
    assert torch.equal(got, _expected(scores, k))


@pytest.mark.parametrize(("n", "k"), [(8448, 128), (135168, 2048), (40000, 10000), (10**6, 2048)])
@pytest.mark.parametrize("tile", [16, 1024, 16384])
@pytest.mark.parametrize("single", [64, 2048, 32768])
@pytest.mark.parametrize("merge", [64, 32768])
def test_stage_plans_shrink_to_one_program(n, k, tile, single, merge, monkeypatch):
    """Each candidate stage keeps at most half its input plus one short tile, and the last candidates
    fit one program; the default plan is one program up to its ``single`` width, else candidate tiles."""
    from sparse_kernels._triton import top_k_ascending as kernel

    default, default_single = kernel.stages(n, k), kernel.CONFIG["single"]
    monkeypatch.setitem(kernel.CONFIG, "single", single)
    monkeypatch.setitem(kernel.CONFIG, "merge", merge)
    monkeypatch.setitem(kernel.CONFIG, "tile", tile)
    plan, width = kernel.stages(n, k), n
    for tile in plan:
        assert 2 * k <= tile <= kernel.MAX_COLUMNS
        shrunk = -(-width // tile) * k
        assert shrunk <= width // 2 + k and shrunk < width
        width = shrunk
    assert width <= kernel.MAX_COLUMNS
    assert n > single and width <= max(merge, plan[0]) if plan else n <= max(single, kernel.MAX_COLUMNS)
    assert bool(default) == (n > default_single)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("n", "k"), [(8448, 128), (135168, 2048)])
@pytest.mark.parametrize("tile", [1024, 16384])
def test_every_variant_in_a_cuda_graph(variant, n, k, tile, monkeypatch):
    """Quest's and OmniKV's rows, one program or candidate stages, replayed from a CUDA graph on new
    scores: equal to a stable sort (fixed grids, no host sync)."""
    monkeypatch.setitem(variant.CONFIG, "fused", True)
    monkeypatch.setitem(variant.CONFIG, "single", tile)
    monkeypatch.setitem(variant.CONFIG, "tile", tile)
    scores = torch.randn(6, n, device="cuda")
    out = torch.empty(6, k, dtype=torch.int64, device="cuda")
    top_k_ascending(scores, k, out, backend="triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top_k_ascending(scores, k, out, backend="triton")
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        scores.copy_(torch.randint(-50, 50, (6, n), generator=gen, device="cuda").float() / 8)  # ties
        graph.replay()
        assert torch.equal(out, top_k_ascending(scores, k, backend="reference"))
