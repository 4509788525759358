"""DecodeBuffers: the three CSR views of one packed buffer hold each plan's arrays, keep their
addresses under fixed capacities, grow (moving) without them, and reject plans past a fixed capacity."""

import pytest
import torch

from sparse_kernels._decode_buffers import DecodeBuffers


def _csr(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.randint(0, 1000, (int(indptr[-1]),), generator=g, dtype=torch.int32)
    last_len = torch.randint(1, 17, (len(lengths),), generator=g, dtype=torch.int32)
    return indptr, indices, last_len


def _check(bufs: DecodeBuffers, indptr, indices, last_len):
    assert torch.equal(bufs.indptr[: indptr.numel()].cpu(), indptr)
    assert torch.equal(bufs.indices[: indices.numel()].cpu(), indices)
    assert torch.equal(bufs.last_len[: last_len.numel()].cpu(), last_len)
    for view in (bufs.indptr, bufs.indices, bufs.last_len):
        assert view.data_ptr() % 64 == 0  # aligned like separately allocated buffers


@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_growing_buffers_hold_every_plan(num_kv_heads):
    bufs = DecodeBuffers(torch.device("cpu"), None, None, None)
    for seed, lengths in enumerate([[3], [5, 1, 7], [40] * 9, [2, 2], [1] * 30, [100]]):
        csr = _csr(lengths, seed)
        bufs.load(*csr, num_kv_heads)
        _check(bufs, *csr)


def test_fixed_capacity_keeps_addresses_and_rejects_overflow():
    bufs = DecodeBuffers(torch.device("cpu"), max_batch_size=4, max_num_pages=50, num_splits=None)
    bufs.load(*_csr([3, 4], 0), 2)
    pointers = [t.data_ptr() for t in (bufs.indptr, bufs.indices, bufs.last_len)]
    for seed, lengths in enumerate([[50], [1, 1, 1, 1, 1, 1, 1, 1], [10, 20]], start=1):
        csr = _csr(lengths, seed)
        bufs.load(*csr, 2)  # 8 lists fit: capacity is max_batch_size * num_kv_heads
        _check(bufs, *csr)
        assert [t.data_ptr() for t in (bufs.indptr, bufs.indices, bufs.last_len)] == pointers
    with pytest.raises(ValueError, match="kv_indices entries"):
        bufs.load(*_csr([51], 9), 2)
    with pytest.raises(ValueError, match="kv_indptr entries"):
        bufs.load(*_csr([1] * 9, 9), 2)


def test_scratch_is_sized_once_for_every_batch_up_to_the_capacity():
    bufs = DecodeBuffers(torch.device("cpu"), max_batch_size=8, max_num_pages=10, num_splits=None)
    bufs.reserve_scratch(1, 8, 2, 16)
    sizes = (bufs.o_part.numel(), bufs.lse_part.numel(), bufs.lse.numel())
    rows = max(b * 8 * max(bufs.num_splits(b, 2), bufs.num_splits(b, 2, quantized=True)) for b in range(1, 9))
    assert sizes[0] >= rows * 16 and sizes[1] >= rows and sizes[2] >= 8 * 8
    bufs.reserve_scratch(8, 8, 2, 16)
    assert (bufs.o_part.numel(), bufs.lse_part.numel(), bufs.lse.numel()) == sizes
    with pytest.raises(ValueError, match="max_batch_size"):
        bufs.reserve_scratch(9, 8, 2, 16)


def test_split_target_rises_once_the_lists_alone_cover_every_sm(monkeypatch):
    import sparse_kernels._decode_buffers as buffers

    monkeypatch.setattr(buffers, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    splits = {lists: buffers.choose_num_splits(lists, 1, cpu) for lists in (1, 40, 131, 132, 728)}
    # fewer lists than SMs: 4 programs per SM for bf16 KV (capped at 64 splits); from 132 lists on: 32 per SM.
    assert splits == {1: 64, 40: 14, 131: 5, 132: 32, 728: 6}
    assert buffers.choose_num_splits(91, 8, cpu) == 6  # 728 lists of (request, KV head)
    # quantized stores aim at 32 warps per SM below the SM count (8 four-warp programs, 32 one-warp ones,
    # capped at 64 splits); the same 32 programs above it
    quantized = {lists: buffers.choose_num_splits(lists, 1, cpu, quantized=True) for lists in (1, 40, 131, 132)}
    assert quantized == {1: 64, 40: 27, 131: 9, 132: 32}
    one_warp = {lists: buffers.choose_num_splits(lists, 1, cpu, True, 1) for lists in (1, 40, 131, 132)}
    assert one_warp == {1: 64, 40: 64, 131: 33, 132: 32}
    # a scheme's own target (fp8: 24 warps a SM): 88 lists of 11 requests x 8 KV heads take 36 splits, not 48
    assert buffers.choose_num_splits(11, 8, cpu, True, 1) == 48
    assert buffers.choose_num_splits(11, 8, cpu, True, 1, warps_per_sm=24) == 36
    assert buffers.choose_num_splits(132, 1, cpu, True, 1, warps_per_sm=24) == 32  # enough lists: unchanged
