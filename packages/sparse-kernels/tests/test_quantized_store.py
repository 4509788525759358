"""store_kv_quantized: rows encoded into their slots (fp8, TurboQuant), KIVI through the tail with the
page encoded when it fills (decode steps and prefill chunks that start mid-page), padded rows untouched,
and the Triton kernels (interpreted on CPU) equal to the reference."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import allocate_quantized_kv, encode_kivi_pages, encode_rows, store_kv_quantized

FIELDS = ("k", "v", "k_scale", "v_scale", "k_min", "v_min", "k_tail", "v_tail")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bits_of(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _randomize(kv, seed=0):
    """Fill every tensor with junk so that 'untouched' is visible."""
    gen = _gen(seed)
    for name in FIELDS:
        t = getattr(kv, name)
        if t is None:
            continue
        if t.dtype in (torch.int32, torch.float8_e4m3fn):
            _bits_of(t).copy_(torch.randint(0, 100, t.shape, generator=gen).to(_bits_of(t).dtype))
        else:
            t.copy_(torch.randn(t.shape, generator=gen))
    return kv


def _clone(kv):
    return type(kv)(**{f: (v.clone() if isinstance(v, torch.Tensor) else v) for f, v in _fields(kv).items()})


def _fields(kv):
    return {f: getattr(kv, f) for f in kv.__dataclass_fields__}


def _assert_same(a, b, *, scale_rtol=0.0, code_mismatch=0.0):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            continue
        x, y = _bits_of(x).cpu(), _bits_of(y).cpu()
        if name in ("k", "v") and code_mismatch:
            assert (x != y).float().mean() <= code_mismatch, name
        else:
            torch.testing.assert_close(x, y, atol=0, rtol=scale_rtol, msg=name)


def _to(kv, device):
    return type(kv)(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v) for f, v in _fields(kv).items()})


PER_TOKEN = [
    ("fp8", 8, None),
    ("fp8", 8, (0.02, 0.05)),
    ("turboquant", 2, None),
    ("turboquant", 3, None),
    ("turboquant", 4, None),
]


@pytest.mark.parametrize("scheme,bits,static", PER_TOKEN)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128), (16, 80)])
def test_per_token_store_matches_encode_rows_and_triton(scheme, bits, static, block_size, head_dim, triton_device):
    heads = 3
    start = _randomize(
        allocate_quantized_kv(scheme, bits, 4, block_size, heads, head_dim, torch.bfloat16, "cpu", seed=1)
    )
    key = torch.randn(7, heads, head_dim, generator=_gen(1)).to(torch.bfloat16)
    value = torch.randn(7, heads, head_dim, generator=_gen(2)).to(torch.bfloat16)
    key[3, 0, 0] = 1e5  # an outlier sends the rest of its row to e4m3's subnormals
    value[6] *= 1e-4  # and so does a static scale far above a row's values
    key[[1, 5]] = float("nan")  # padded rows carry garbage
    slots = [3, -1, 4 * block_size - 1, block_size, 0, -1, 2 * block_size + 5]
    slot_mapping = torch.tensor(slots, dtype=torch.int32)
    ref = _clone(start)
    store_kv_quantized(key, value, ref, slot_mapping, static_scales=static, backend="reference")
    # Expected: each real row's encoding in its slot, every other slot as it was.
    expected = _clone(start)
    rotated = (key, value)
    if scheme == "turboquant":  # as the store does it: one matmul of every row
        rotated = (key.float() @ start.rotation, value.float() @ start.rotation)
    for i, (x, codes, scales) in enumerate(
        zip(rotated, (expected.k, expected.v), (expected.k_scale, expected.v_scale), strict=True)
    ):
        flat_codes, flat_scales = codes.view(-1, heads, codes.shape[-1]), scales.view(-1, heads)
        for row, slot in enumerate(slots):
            if slot >= 0:
                static_i = None if static is None else static[i]
                c, s = encode_rows(x[row], scheme, bits, codebook=start.codebook, static_scale=static_i)
                flat_codes[slot], flat_scales[slot] = c, s
    _assert_same(ref, expected)
    # Triton: fp8 bit-exact; TurboQuant's sum of squares may differ from torch's in the last ulp.
    out = _to(start, triton_device)
    rows = (key.to(triton_device), value.to(triton_device), out, slot_mapping.to(triton_device))
    store_kv_quantized(*rows, static_scales=static, backend="triton")
    tq = scheme == "turboquant"
    _assert_same(out, ref, scale_rtol=1e-5 if tq else 0.0, code_mismatch=1e-3 if tq else 0.0)


class KiviRequests:
    """Three requests over a shuffled pool with spare blocks and a spare tail row, and their true tokens."""

    def __init__(self, bits, block_size, head_dim, heads=3, seed=0):
        self.page, self.heads = block_size, heads
        self.kv = _randomize(
            allocate_quantized_kv("kivi", bits, 14, block_size, heads, head_dim, torch.bfloat16, "cpu", num_tails=4)
        )
        self.start = _clone(self.kv)
        perm = torch.randperm(14, generator=_gen(seed))
        self.blocks = [perm[4 * r : 4 * r + 4].tolist() for r in range(3)]
        self.spare_blocks = perm[12:].tolist()
        self.tail_rows = [2, 0, 3]  # row 1 stays spare
        gen = _gen(seed + 1)
        shape = (4 * block_size, heads, head_dim)
        self.k = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3)]
        self.v = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3)]
        self.lengths = [0, 0, 0]

    def step(self, chunks, *, pad_front=0, pad_back=0):
        """Rows for ``{request: num_tokens}`` (each request's rows adjacent), with NaN padding around."""
        keys, values, slots, tails = [], [], [], []
        pad = torch.full((1, self.heads, self.k[0].shape[-1]), float("nan"), dtype=torch.bfloat16)
        for _ in range(pad_front):
            keys.append(pad), values.append(pad), slots.append(-1), tails.append(-1)
        for r, n in chunks.items():
            pos = range(self.lengths[r], self.lengths[r] + n)
            keys.append(self.k[r][pos.start : pos.stop])
            values.append(self.v[r][pos.start : pos.stop])
            slots += [self.blocks[r][p // self.page] * self.page + p % self.page for p in pos]
            tails += [self.tail_rows[r]] * n
            self.lengths[r] += n
        for _ in range(pad_back):
            keys.append(pad), values.append(pad), slots.append(-1), tails.append(-1)
        as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        return torch.cat(keys), torch.cat(values), as_int(slots), as_int(tails)

    def check(self, kv):
        """Full pages equal their encoding, tails hold the incomplete pages, all else untouched."""
        kv = _to(kv, "cpu")
        names = ("k", "v", "k_scale", "k_min", "v_scale", "v_min")
        for r, n in enumerate(self.lengths):
            for p in range(n // self.page):
                page = slice(p * self.page, (p + 1) * self.page)
                encoded = encode_kivi_pages(self.k[r][page][None], self.v[r][page][None], kv.bits, self.page)
                for name, t in zip(names, encoded, strict=True):
                    assert torch.equal(getattr(kv, name)[self.blocks[r][p]], t[0]), (r, p, name)
            rest = n % self.page
            assert torch.equal(kv.k_tail[self.tail_rows[r], :rest], self.k[r][n - rest : n])
            assert torch.equal(kv.v_tail[self.tail_rows[r], :rest], self.v[r][n - rest : n])
        for name in names:
            assert torch.equal(getattr(kv, name)[self.spare_blocks], getattr(self.start, name)[self.spare_blocks])
        assert torch.equal(kv.k_tail[1], self.start.k_tail[1]) and torch.equal(kv.v_tail[1], self.start.v_tail[1])


def _store(reqs, kv, chunks, backend="reference", one_row=False, **pad):
    key, value, slots, tails = reqs.step(chunks, **pad)
    device = kv.device
    store_kv_quantized(
        key.to(device), value.to(device), kv, slots.to(device), tails.to(device),
        one_row_per_request=one_row, backend=backend,
    )  # fmt: skip


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_kivi_prefill_chunks_start_mid_page_and_span_pages(bits, block_size, head_dim):
    reqs = KiviRequests(bits, block_size, head_dim)
    s = block_size
    _store(reqs, reqs.kv, {0: 5, 1: 2 * s + 3}, pad_front=2)  # request 1 fills two pages at once
    reqs.check(reqs.kv)
    _store(reqs, reqs.kv, {2: s - 1, 0: 3 * s - 3, 1: 1}, pad_back=3)  # request 0: mid-page start, 3 pages
    reqs.check(reqs.kv)
    _store(reqs, reqs.kv, {2: 1, 1: s - 5})  # request 2's page filled by a chunk of one row
    reqs.check(reqs.kv)


@pytest.mark.parametrize("bits,block_size,head_dim", [(2, 16, 64), (4, 32, 128), (4, 16, 80)])
def test_kivi_decode_steps_flush_the_tail_and_triton_matches(bits, block_size, head_dim, triton_device):
    reqs = KiviRequests(bits, block_size, head_dim)
    s = block_size
    _store(reqs, reqs.kv, {0: s - 2, 1: 1, 2: 2 * s - 1})
    out = _to(reqs.kv, triton_device)
    for step in range(3):  # request 0 fills its page in step 1, request 2 in step 0
        chunks = {0: 1, 1: 1, 2: 1} if step != 2 else {2: 1, 0: 1}
        before = list(reqs.lengths)
        _store(reqs, reqs.kv, chunks, one_row=True, pad_front=1, pad_back=1)
        reqs.lengths = before
        _store(reqs, out, chunks, backend="triton", one_row=True, pad_front=1, pad_back=1)
        _assert_same(out, reqs.kv)
        reqs.check(out)
    assert reqs.lengths == [s + 1, 3, 2 * s + 2]


@pytest.mark.parametrize("scheme,bits", [("fp8", 8), ("kivi", 4), ("turboquant", 2)])
def test_strided_rows_and_all_padding(scheme, bits, triton_device):
    # K and V as head slices of a fused QKV row (strided), and a call with nothing but padding.
    kv = _randomize(allocate_quantized_kv(scheme, bits, 3, 16, 2, 64, torch.bfloat16, "cpu", num_tails=2))
    qkv = torch.randn(3, 6, 64, generator=_gen(5)).to(torch.bfloat16)
    slots = torch.tensor([47, -1, 20], dtype=torch.int32)  # 47 fills block 2's page from its tail
    tails = torch.tensor([1, -1, 0], dtype=torch.int32)
    ref, out = _clone(kv), _to(kv, triton_device)
    store_kv_quantized(qkv[:, 2:4].contiguous(), qkv[:, 4:6].contiguous(), ref, slots, tails, backend="reference")
    dev = qkv.to(triton_device)
    args = (out, slots.to(triton_device), tails.to(triton_device))
    store_kv_quantized(dev[:, 2:4], dev[:, 4:6], *args, one_row_per_request=True, backend="triton")
    tq = scheme == "turboquant"
    _assert_same(out, ref, scale_rtol=1e-5 if tq else 0.0, code_mismatch=1e-3 if tq else 0.0)
    for backend, store in (("reference", ref), ("triton", out)):
        before = _clone(_to(store, "cpu"))
        pad = torch.full((2,), -1, dtype=torch.int32, device=store.device)
        rows = torch.full((2, 2, 64), float("nan"), dtype=torch.bfloat16, device=store.device)
        store_kv_quantized(rows, rows, store, pad, pad, one_row_per_request=True, backend=backend)
        _assert_same(store, before)


def test_store_rejects_bad_inputs():
    kivi = allocate_quantized_kv("kivi", 4, 2, 16, 1, 64, torch.bfloat16, "cpu", num_tails=1)
    fp8 = allocate_quantized_kv("fp8", 8, 2, 16, 1, 64, torch.bfloat16, "cpu")
    rows = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="tail_index"):
        store_kv_quantized(rows, rows, kivi, slots)
    with pytest.raises(ValueError, match="static_scales"):
        store_kv_quantized(rows, rows, kivi, slots, slots, static_scales=(1.0, 1.0))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_quantized(rows, rows, fp8, slots.long())
    with pytest.raises(ValueError, match="heads/head_dim"):
        store_kv_quantized(rows[..., :32], rows[..., :32], fp8, slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme,bits", [("fp8", 8), ("kivi", 4), ("kivi", 2), ("turboquant", 3)])
def test_decode_store_replays_under_cuda_graph_without_host_sync(scheme, bits):
    s, heads, dim = 32, 8, 128
    kv = allocate_quantized_kv(scheme, bits, 8, s, heads, dim, torch.bfloat16, "cuda", num_tails=4)
    ref = _to(kv, "cpu")
    key = torch.zeros(6, heads, dim, dtype=torch.bfloat16, device="cuda")
    value = torch.zeros_like(key)
    slot_mapping = torch.full((6,), -1, dtype=torch.int32, device="cuda")
    tail_index = torch.full((6,), -1, dtype=torch.int32, device="cuda")

    def step():
        store_kv_quantized(key, value, kv, slot_mapping, tail_index, one_row_per_request=True)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # Four requests decode a whole page, one token per replay; rows 4 and 5 stay padding.
    blocks = [5, 0, 7, 2]
    for pos in range(s):
        gen = _gen(pos)
        new_k = torch.randn(6, heads, dim, generator=gen).to(torch.bfloat16)
        new_v = torch.randn(6, heads, dim, generator=gen).to(torch.bfloat16)
        slots = torch.tensor([b * s + pos for b in blocks] + [-1, -1], dtype=torch.int32)
        tails = torch.tensor([3, 2, 1, 0, -1, -1], dtype=torch.int32)
        for dst, src in ((key, new_k), (value, new_v), (slot_mapping, slots), (tail_index, tails)):
            dst.copy_(src)
        graph.replay()
        store_kv_quantized(new_k, new_v, ref, slots, tails, one_row_per_request=True, backend="reference")
    torch.cuda.synchronize()
    tq = scheme == "turboquant"
    _assert_same(kv, ref, scale_rtol=1e-5 if tq else 0.0, code_mismatch=1e-3 if tq else 0.0)
