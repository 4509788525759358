"""compact_kv (Triton and reference) against an element-by-element oracle, in place over overlaps."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sparse_kernels import compact_kv


def _case(num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Three requests over a shuffled pool of 4-slot blocks, each head keeping its own sorted positions."""
    gen = torch.Generator().manual_seed(seed)
    lens, keeps = [13, 1, 40], [5, 1, 17]
    perm = torch.randperm(80, generator=gen)
    slot_lists = [perm[:13], perm[13:14], perm[20:60]]
    keep = []
    for n, m in zip(lens, keeps, strict=True):
        rows = [torch.sort(torch.randperm(n, generator=gen)[:m]).values for _ in range(num_kv_heads)]
        keep.append(torch.stack(rows))
    keep[2][0] = torch.arange(23, 40)  # one head keeps the tail: every source overlaps a destination
    k_cache = torch.randn(20, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(20, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, slot_lists, keep


def _expected(cache, slot_lists, keep):
    flat = cache.clone().view(-1, cache.shape[2], cache.shape[3])
    old = flat.clone()
    for slots, k in zip(slot_lists, keep, strict=True):
        for h in range(k.shape[0]):
            for i in range(k.shape[1]):
                flat[slots[i], h] = old[slots[k[h, i]], h]
    return flat.view_as(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_batched_compaction_matches_oracle(dtype, backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache, slot_lists, keep = _case(dtype=dtype)
    k_exp, v_exp = _expected(k_cache, slot_lists, keep), _expected(v_cache, slot_lists, keep)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)

    def indptr(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    compact_kv(
        k_cache,
        v_cache,
        torch.cat(slot_lists).to(torch.int32).to(device),
        torch.cat(keep, dim=1).to(device),
        slot_indptr=indptr([len(s) for s in slot_lists]),
        keep_indptr=indptr([k.shape[1] for k in keep]),
        backend=backend,
    )
    torch.testing.assert_close(k_cache.cpu(), k_exp, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), v_exp, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_single_request_int32_keep(backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache, slot_lists, keep = _case(num_kv_heads=4, head_dim=64, seed=3)
    slots, kept = slot_lists[2], keep[2]
    k_exp = _expected(k_cache, [slots], [kept])
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    compact_kv(k_cache, v_cache, slots.to(torch.int32).to(device), kept.to(torch.int32).to(device), backend=backend)
    torch.testing.assert_close(k_cache.cpu(), k_exp, atol=0, rtol=0)


def test_reference_handles_unsorted_keep():
    k_cache, v_cache, slot_lists, keep = _case()
    reversed_keep = keep[0].flip(1)
    k_exp = _expected(k_cache, [slot_lists[0]], [reversed_keep])
    compact_kv(k_cache, v_cache, slot_lists[0].to(torch.int32), reversed_keep, backend="reference")
    torch.testing.assert_close(k_cache, k_exp, atol=0, rtol=0)


def test_compact_rejects_bad_inputs():
    k_cache, v_cache, slot_lists, keep = _case()
    slots = slot_lists[0].to(torch.int32)
    with pytest.raises(ValueError, match="slot_ids must be"):
        compact_kv(k_cache, v_cache, slots.long(), keep[0])
    with pytest.raises(ValueError, match="keep must be"):
        compact_kv(k_cache, v_cache, slots, keep[0][:1])
    with pytest.raises(ValueError, match="both"):
        compact_kv(k_cache, v_cache, slots, keep[0], slot_indptr=torch.tensor([0, 13], dtype=torch.int32))
    with pytest.raises(ValueError, match="columns"):
        compact_kv(k_cache, v_cache, slots[:2], keep[0])


def _hazard_keep(kind: str, n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """``m`` ascending positions of ``n`` (``m <= n``) shaped to stress the in-place walk."""
    if kind == "dense":  # keep the first m: nothing moves
        return torch.arange(m)
    if kind == "drop_one_early":  # position 1 goes: every later row moves back by one
        return torch.cat([torch.arange(min(1, m)), torch.arange(2, m + 1)])[:m] if m < n else torch.arange(m)
    if kind == "tail":  # one big jump: the last m (every source beyond every destination but the last few)
        return torch.arange(n - m, n)
    if kind == "jumps":  # a dense head, a jump to the tail's middle, then every other slot
        head = m // 3
        rest = torch.arange(n - 2 * (m - head) + 1, n, 2)
        return torch.cat([torch.arange(head), rest]) if head < n - 2 * (m - head) + 1 else torch.arange(n - m, n)
    return torch.sort(torch.randperm(n, generator=gen)[:m]).values  # random


KINDS = ["dense", "drop_one_early", "tail", "jumps", "random"]


def _hazard_case(lengths, kept, num_kv_heads, head_dim, seed, shared=False):
    """Requests of ``lengths`` slots keeping ``kept`` over a shuffled pool of 4-slot blocks; head ``h`` of
    request ``r`` takes keep kind ``KINDS[(r + h) % 5]`` (``shared``: one row for every head)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(lengths) // 4 + 3
    perm = torch.randperm(num_blocks * 4, generator=gen)
    slot_lists, keep, start = [], [], 0
    for r, (n, m) in enumerate(zip(lengths, kept, strict=True)):
        slot_lists.append(perm[start : start + n])
        start += n
        rows = [_hazard_keep(KINDS[(r + h) % len(KINDS)], n, m, gen) for h in range(1 if shared else num_kv_heads)]
        assert all(len(row) == m and bool((row[1:] > row[:-1]).all()) and int(row[-1]) < n for row in rows)
        keep.append(torch.stack(rows).expand(num_kv_heads, -1))
    k_cache = torch.randn(num_blocks, 4, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, 4, num_kv_heads, head_dim, generator=gen)
    return k_cache, v_cache, slot_lists, keep


def _indptr(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _run_compact(k_cache, v_cache, slot_lists, keep, device, launch=None, shared=False):
    """Compact ``keep`` (each ``[H, m]``) on ``device`` (``launch``: the Triton launch itself, at its own
    block size); returns the caches on the CPU."""
    k_cache, v_cache = k_cache.to(device, copy=True), v_cache.to(device, copy=True)  # never the caller's own
    slot_ids = torch.cat(slot_lists).to(torch.int32).to(device)
    columns = torch.cat([k[:1] if shared else k for k in keep], dim=1).to(device)
    columns = columns.expand(k_cache.shape[2], -1) if shared else columns.contiguous()
    ptrs = _indptr([len(s) for s in slot_lists], device), _indptr([k.shape[1] for k in keep], device)
    if launch is None:
        compact_kv(k_cache, v_cache, slot_ids, columns, slot_indptr=ptrs[0], keep_indptr=ptrs[1])
    else:
        launch(k_cache, v_cache, ptrs[0], slot_ids, ptrs[1], columns)
    return k_cache.cpu(), v_cache.cpu()


@pytest.mark.parametrize("block_rows", [4, 8])
@pytest.mark.parametrize("shared", [False, True])
def test_in_place_hazards_at_small_chunks(block_rows, shared, triton_device):
    """Many short chunks (chunk-boundary keep counts B - 1, B, B + 1, 2 B, 2 B + 1, 1), every keep kind
    per head (dense, one early eviction, the tail, big jumps, random), requests of different lengths;
    ``shared``: one keep row for every head (head stride 0)."""
    from sparse_kernels._triton.compact import compact_kv_triton

    b = block_rows
    kept = [b - 1, b, b + 1, 2 * b, 2 * b + 1, 1, 5 * b + 3]
    lengths = [m + extra for m, extra in zip(kept, [3, 1, 0, 9, 2, 6, 20], strict=True)]
    k_cache, v_cache, slot_lists, keep = _hazard_case(lengths, kept, num_kv_heads=3, head_dim=8, seed=b, shared=shared)
    k_exp, v_exp = _expected(k_cache, slot_lists, keep), _expected(v_cache, slot_lists, keep)

    def launch(*args):
        compact_kv_triton(*args, block_rows=block_rows, num_warps=1)

    k_got, v_got = _run_compact(k_cache, v_cache, slot_lists, keep, triton_device, launch, shared)
    assert torch.equal(k_got, k_exp) and torch.equal(v_got, v_exp)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_in_place_hazards_at_the_default_chunk(shared, backend, triton_device):
    """The default launch, keep counts around its chunk (127, 128, 129, 257), every keep kind; on CPU the
    interpreted launch is also compiled for sm_90 (the prefetching loop's carried values included)."""
    from sparse_kernels._triton.compact import BLOCK_ROWS
    from sparse_kernels._triton.compile_check import compiling_for

    kept = [BLOCK_ROWS - 1, BLOCK_ROWS, BLOCK_ROWS + 1, 2 * BLOCK_ROWS + 1]
    lengths = [m + extra for m, extra in zip(kept, [5, 40, 1, 12], strict=True)]
    k_cache, v_cache, slot_lists, keep = _hazard_case(lengths, kept, num_kv_heads=2, head_dim=16, seed=1, shared=shared)
    k_exp, v_exp = _expected(k_cache, slot_lists, keep), _expected(v_cache, slot_lists, keep)
    device = triton_device if backend == "triton" else "cpu"
    bf16 = [t.to(torch.bfloat16) for t in (k_cache, v_cache, k_exp, v_exp)]
    with compiling_for() if backend == "triton" and not shared else contextlib.nullcontext():
        k_got, v_got = _run_compact(bf16[0], bf16[1], slot_lists, keep, device, shared=shared)
    assert torch.equal(k_got, bf16[2]) and torch.equal(v_got, bf16[3])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="races need the GPU: the interpreter runs a program's ops in order"
)
@pytest.mark.parametrize("shared", [False, True])
def test_round_shape_on_the_gpu_equals_the_reference(shared):
    """A slice of the b91 round on the device (16-slot blocks shuffled, 8 KV heads, head_dim 128, bf16):
    requests of 8448 slots keeping 8192 in every keep kind per head (or one shared row), and requests of
    other lengths; every launch of the sweep, against the reference."""
    from sparse_kernels._triton.compact import compact_kv_triton

    lengths, kept = [8448] * 10 + [8449, 300, 8192], [8192] * 10 + [8191, 129, 8192]
    k_cache, v_cache, slot_lists, keep = _hazard_case(
        lengths, kept, num_kv_heads=8, head_dim=128, seed=5, shared=shared
    )
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    k_ref, v_ref = _run_compact(k_cache, v_cache, slot_lists, keep, "cpu", shared=shared)  # the reference on CPU
    for rows, warps in [(64, 4), (128, 4), (128, 8), (256, 8)]:

        def launch(*args, rows=rows, warps=warps):
            compact_kv_triton(*args, block_rows=rows, num_warps=warps)

        k_got, v_got = _run_compact(k_cache, v_cache, slot_lists, keep, "cuda", launch, shared)
        assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref), (rows, warps)
