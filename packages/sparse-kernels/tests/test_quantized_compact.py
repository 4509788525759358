"""compact_quantized equals a gather of the dequantized kept tokens, per KV head: fp8 and TurboQuant rows
move exactly (both backends), KIVI's kept tokens are re-encoded into full pages plus the tail."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import (
    allocate_quantized_kv,
    compact_quantized,
    dequantize_blocks,
    encode_kivi_pages,
    encode_rows,
    store_kv_quantized,
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _layout(lengths, block_size, num_blocks, seed=0):
    """Shuffled blocks per request; ``slot_ids`` (each request's sequence in table order) and its indptr."""
    perm = torch.randperm(num_blocks, generator=_gen(seed)).tolist()
    blocks, slots, start = [], [], 0
    for n in lengths:
        nb = -(-n // block_size)
        blocks.append(perm[start : start + nb])
        start += nb
        slots += [blocks[-1][p // block_size] * block_size + p % block_size for p in range(n)]
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return blocks, torch.tensor(slots, dtype=torch.int32), indptr


def _keep(lengths, counts, heads, seed=0):
    """Per request, per head: a sorted random subset of ``counts[r]`` list positions."""
    gen = _gen(seed)
    cols = []
    for n, c in zip(lengths, counts, strict=True):
        cols.append(torch.stack([torch.randperm(n, generator=gen)[:c].sort().values for _ in range(heads)]))
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(cols, dim=1).to(torch.int32), indptr


def _dense(kv, slots):
    """Dequantized ``(k, v)`` ``[n, H, D]`` at ``slots`` (per-token schemes: from the codes)."""
    k, v = dequantize_blocks(kv, torch.arange(kv.num_blocks), unrotate=False)
    flat = slots.long()
    return k.flatten(0, 1)[flat], v.flatten(0, 1)[flat]


@pytest.mark.parametrize("scheme,bits", [("fp8", 8), ("turboquant", 3)])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_per_token_compaction_moves_codes_and_scales(scheme, bits, backend, triton_device):
    block_size, heads, dim = 16, 3, 64
    lengths, counts = [37, 50], [20, 33]
    kv = allocate_quantized_kv(scheme, bits, 9, block_size, heads, dim, torch.bfloat16, "cpu", seed=2)
    x = torch.randn(2, 9 * block_size, heads, dim, generator=_gen(1))
    for codes, scale, rows in ((kv.k, kv.k_scale, x[0]), (kv.v, kv.v_scale, x[1])):
        c, s = encode_rows(rows if scheme == "fp8" else rows @ kv.rotation, scheme, bits, codebook=kv.codebook)
        codes.view(-1, heads, codes.shape[-1]).copy_(c)
        scale.view(-1, heads).copy_(s)
    _, slot_ids, slot_indptr = _layout(lengths, block_size, 9)
    keep, keep_indptr = _keep(lengths, counts, heads)
    k_old, v_old = _dense(kv, slot_ids)
    device = triton_device if backend == "triton" else "cpu"
    kv_dev = type(kv)(**{f: _move(getattr(kv, f), device) for f in kv.__dataclass_fields__})
    args = (slot_ids, keep, slot_indptr, keep_indptr)
    slot_ids, keep, slot_indptr, keep_indptr = (t.to(device) for t in args)
    compact_quantized(kv_dev, slot_ids, keep, slot_indptr=slot_indptr, keep_indptr=keep_indptr, backend=backend)
    k_new, v_new = _dense(type(kv)(**{f: _move(getattr(kv_dev, f), "cpu") for f in kv.__dataclass_fields__}), args[0])
    for r in range(2):
        lo, k_lo = int(args[2][r]), int(args[3][r])
        for h in range(heads):
            kept = lo + args[1][h, k_lo : k_lo + counts[r]].long()
            dst = slice(lo, lo + counts[r])
            assert torch.equal(k_new[dst, h], k_old[kept, h]) and torch.equal(v_new[dst, h], v_old[kept, h])


def _move(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_kivi_compaction_reencodes_kept_tokens_into_pages_and_tail(bits, block_size, head_dim):
    s, heads = block_size, 3
    lengths = [2 * s + 5, 3 * s, s - 3]  # tails with tokens, an exact page count, a tail only
    counts = [s + 4, 2 * s, s - 7]
    tail_rows = [2, 0, 1]
    num_blocks = 8
    kv = allocate_quantized_kv("kivi", bits, num_blocks, s, heads, head_dim, torch.bfloat16, "cpu", num_tails=3)
    blocks, slot_ids, slot_indptr = _layout(lengths, s, num_blocks)
    tail_index = torch.tensor(tail_rows, dtype=torch.int32)
    tokens = torch.randn(2, len(slot_ids), heads, head_dim, generator=_gen(3)).to(torch.bfloat16)
    store_kv_quantized(tokens[0], tokens[1], kv, slot_ids, tail_index.repeat_interleave(torch.tensor(lengths)))
    # The truth: each request's tokens as stored (dequantized full pages, the tail as is).
    k_all, v_all = dequantize_blocks(kv, torch.arange(num_blocks), dtype=torch.bfloat16)
    k_old, v_old = k_all.flatten(0, 1)[slot_ids.long()], v_all.flatten(0, 1)[slot_ids.long()]
    for r, n in enumerate(lengths):
        lo, rest = int(slot_indptr[r]), n % s
        k_old[lo + n - rest : lo + n] = kv.k_tail[tail_rows[r], :rest]
        v_old[lo + n - rest : lo + n] = kv.v_tail[tail_rows[r], :rest]
    keep, keep_indptr = _keep(lengths, counts, heads, seed=4)
    spare = sorted(set(range(num_blocks)) - {b for bl in blocks for b in bl})  # a block no request owns
    spare_codes = kv.k[spare].clone()
    compact_quantized(kv, slot_ids, keep, slot_indptr=slot_indptr, keep_indptr=keep_indptr, tail_index=tail_index)
    for r, c in enumerate(counts):
        lo, k_lo = int(slot_indptr[r]), int(keep_indptr[r])
        heads_idx = torch.arange(heads)[:, None]
        kept = (lo + keep[:, k_lo : k_lo + c].long()).T  # [c, H]
        k_kept, v_kept = k_old[kept, heads_idx.T], v_old[kept, heads_idx.T]  # [c, H, D]
        for p in range(c // s):
            page = slice(p * s, (p + 1) * s)
            encoded = encode_kivi_pages(k_kept[page][None], v_kept[page][None], bits, s)
            for name, t in zip(("k", "v", "k_scale", "k_min", "v_scale", "v_min"), encoded, strict=True):
                assert torch.equal(getattr(kv, name)[blocks[r][p]], t[0]), (r, p, name)
        rest = c % s
        assert torch.equal(kv.k_tail[tail_rows[r], :rest], k_kept[c - rest :])
        assert torch.equal(kv.v_tail[tail_rows[r], :rest], v_kept[c - rest :])
    assert torch.equal(kv.k[spare], spare_codes)


def test_kivi_compaction_needs_tail_index():
    kv = allocate_quantized_kv("kivi", 4, 2, 16, 1, 64, torch.bfloat16, "cpu", num_tails=1)
    with pytest.raises(ValueError, match="tail_index"):
        compact_quantized(kv, torch.arange(20, dtype=torch.int32), torch.arange(10, dtype=torch.int32)[None])
