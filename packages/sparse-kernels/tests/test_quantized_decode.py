"""Quantized split-K decode (fp8, KIVI, TurboQuant) against attention over the dequantized KV.

Runs natively on CUDA where present, else on CPU under Triton's interpreter (small sizes). The truth is
``causal_attention`` over each request's K/V decoded by ``kv_quant`` (KIVI: plus its raw tail), so the
kernel is held to the same quantized values, not to the unquantized K/V. Tolerances: on CPU the kernel's
dots run in IEEE fp32 and only the summation order differs (KIVI folds the keys' per-channel scale into
the query: ``(q * s) . c + q . z``), 2e-5 relative to values of order 1; on CUDA the dots take fp16
operands (codes and levels are exact or nearly so, the query and probabilities are rounded), 2e-2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, causal_attention
from sparse_kernels._triton.compile_check import compiling_for

NUM_KV_HEADS = 2
SCHEMES = [("fp8", 8), ("kivi", 2), ("kivi", 4), ("turboquant", 2), ("turboquant", 3), ("turboquant", 4)]
TOL = {"cpu": {"atol": 1e-4, "rtol": 1e-4}, "cuda": {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(params=["rows", "swapped", "pairs"])
def swap_ab(request, monkeypatch):
    """The dots as written (the query group as the MMA's rows), transposed (``SWAP_AB``: the tokens as rows), and
    transposed with KIVI's codes unpacked in pairs (``PAIRS``: inline PTX, so on the GPU and in the sm_90 compile
    checks only; the interpreter runs the transposed path)."""
    from sparse_kernels._triton import quantized_decode_launch

    for config in (quantized_decode_launch.QUANT_DECODE_CONFIG, quantized_decode_launch.KIVI_DECODE_CONFIG):
        monkeypatch.setitem(config, "SWAP_AB", request.param != "rows")
    monkeypatch.setitem(quantized_decode_launch.KIVI_DECODE_CONFIG, "PAIRS", request.param == "pairs")
    return request.param != "rows"


def _expected(batch, q: torch.Tensor) -> torch.Tensor:
    q = q.cpu().float()
    outs = [
        causal_attention(q[b : b + 1], k, v, causal=False)
        for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True))
    ]
    return torch.cat(outs)


def _plan(wrapper, batch, group: int, **kwargs) -> None:
    wrapper.plan(
        batch.kv_indptr,
        batch.kv_indices,
        batch.kv_last_len,
        num_qo_heads=group * NUM_KV_HEADS,
        **batch.layout(),
        tail_index=batch.tail_index,
        **kwargs,
    )


# (kv_lens, block_size, group, head_dim, forced splits); KIVI's lengths 1, 17, 97 end in a partial page.
CASES = {
    "bs16-g2-d64": ([1, 17, 97, 32], 16, 2, 64, None),
    "bs32-g4-d64-splits3": ([97, 64, 33], 32, 4, 64, 3),
}
COMPILE = {"bs16-g2-d64": ("cuda", 90, 32), "bs32-g4-d64-splits3": (None,)}


@pytest.mark.parametrize(("scheme", "bits"), SCHEMES, ids=[f"{s}{b}" for s, b in SCHEMES])
@pytest.mark.parametrize("case", CASES)
def test_quantized_decode_matches_dequantized_attention(quantized_batch, triton_device, swap_ab, scheme, bits, case):
    kv_lens, block_size, group, head_dim, splits = CASES[case]
    batch = quantized_batch(
        kv_lens, scheme=scheme, bits=bits, block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim
    )
    kv = batch.kv_on(triton_device)
    q = torch.randn(len(kv_lens), group * NUM_KV_HEADS, head_dim, generator=torch.Generator().manual_seed(1))
    expected = _expected(batch, q)
    q = q.to(triton_device)
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend, num_splits=splits)
        _plan(wrapper, batch, group)
        out = torch.full_like(q, float("nan"))
        with compiling_for(*COMPILE[case]):  # the sm_90 compile check runs once per scheme
            assert wrapper.run_quantized(q, kv, out=out) is out
        torch.testing.assert_close(out.cpu(), expected, **TOL[torch.device(triton_device).type], msg=backend)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_bf16_tail_d128_group4(quantized_batch, triton_device, swap_ab, bits):
    # bf16 queries and tails, head_dim 128 (4-bit words unpack 8 channels each, 16 words a row; 2-bit 16 and 8: on
    # the GPU both take the PTX pairs' path, whose keys need 16 half-words a row).
    batch = quantized_batch(
        [1, 45, 64], scheme="kivi", bits=bits, block_size=32, num_kv_heads=NUM_KV_HEADS, head_dim=128,
        tail_dtype=torch.bfloat16, seed=2,
    )  # fmt: skip
    q = torch.randn(3, 4 * NUM_KV_HEADS, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton")
    _plan(wrapper, batch, 4)
    out = wrapper.run_quantized(q.to(triton_device), batch.kv_on(triton_device))
    torch.testing.assert_close(out.cpu(), _expected(batch, q).to(torch.bfloat16), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_grouped_values_equal_the_ungrouped(quantized_batch, triton_device, monkeypatch, bits):
    """The values by channel group (``GROUPED``: scales folded into the probabilities, the minima's term apart) and
    dequantized tile by tile give the same attention: 32-token pages, groups of 32 channels (16 rows a half)."""
    from sparse_kernels._triton import quantized_decode_launch

    batch = quantized_batch(
        [97, 64, 33], scheme="kivi", bits=bits, block_size=32, num_kv_heads=NUM_KV_HEADS, head_dim=64, seed=7
    )
    q = torch.randn(3, 4 * NUM_KV_HEADS, 64, generator=torch.Generator().manual_seed(8)).to(triton_device)
    monkeypatch.setitem(quantized_decode_launch.KIVI_DECODE_CONFIG, "SWAP_AB", True)
    outs = []
    for grouped in (True, False):
        monkeypatch.setitem(quantized_decode_launch.KIVI_DECODE_CONFIG, "GROUPED", grouped)
        wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", num_splits=2)
        _plan(wrapper, batch, 4)
        outs.append(wrapper.run_quantized(q, batch.kv_on(triton_device)).cpu())
    torch.testing.assert_close(outs[0], outs[1], **TOL[torch.device(triton_device).type])
    torch.testing.assert_close(outs[0], _expected(batch, q), **TOL[torch.device(triton_device).type])


HEAD_SPARSE_CASES = [("fp8", 8, False), ("fp8", 8, True), ("turboquant", 3, False), ("turboquant", 3, True)]
HEAD_SPARSE_CASES += [("kivi", 2, False), ("kivi", 4, False)]  # KIVI: whole pages only


@pytest.mark.parametrize(
    ("scheme", "bits", "slots"),
    HEAD_SPARSE_CASES,
    ids=[f"{s}{b}-{'slot' if sl else 'block'}-lists" for s, b, sl in HEAD_SPARSE_CASES],
)
def test_head_sparse_lists(quantized_batch, head_lists, triton_device, swap_ab, scheme, bits, slots):
    """Per-(request, KV head) lists in shuffled order. KIVI: a list that takes its request's incomplete
    last page takes it last, and reads it from the request's tail row (``tail_index`` per request)."""
    batch = quantized_batch(
        [1, 97, 40, 17], scheme=scheme, bits=bits, block_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=64, seed=5
    )
    group = 3
    q = torch.randn(4, group * NUM_KV_HEADS, 64, generator=torch.Generator().manual_seed(6))
    view = SimpleNamespace(
        k_cache=torch.empty(0, 16, NUM_KV_HEADS, 64), q=q, k_seqs=batch.k_seqs, v_seqs=batch.v_seqs,
        kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices,
    )  # fmt: skip
    lists = head_lists(view, slots=slots, seed=7)
    expected, _ = lists.reference(view)
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend)
        wrapper.plan(
            lists.kv_indptr, lists.kv_indices, lists.kv_last_len, num_qo_heads=group * NUM_KV_HEADS,
            **batch.layout(), head_sparse=True, page_size=lists.page_size, tail_index=batch.tail_index,
        )  # fmt: skip
        with compiling_for(*(("cuda", 90, 32) if not slots else (None,))):  # page_size=1: one more constexpr
            out = wrapper.run_quantized(q.to(triton_device), batch.kv_on(triton_device))
        torch.testing.assert_close(out.cpu(), expected, **TOL[torch.device(triton_device).type], msg=backend)


def test_unsupported_layouts_raise(quantized_batch):
    kivi = quantized_batch([17, 32], scheme="kivi", bits=2, block_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=32)
    fp8 = quantized_batch([17, 32], scheme="fp8", bits=8, block_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=32)
    q = torch.zeros(2, 2 * NUM_KV_HEADS, 32)
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    wrapper.plan(kivi.kv_indptr, kivi.kv_indices, kivi.kv_last_len, num_qo_heads=4, **kivi.layout())
    with pytest.raises(ValueError, match="incomplete last page needs"):
        wrapper.run_quantized(q, kivi.kv)
    _plan(wrapper, kivi, 2)
    with pytest.raises(ValueError, match="tail_index is for KIVI"):
        wrapper.run_quantized(q, fp8.kv)
    slots = torch.arange(49, dtype=torch.int32)
    wrapper.plan(
        torch.tensor([0, 17, 49], dtype=torch.int32), slots, torch.ones(2, dtype=torch.int32), num_qo_heads=4,
        **kivi.layout(), page_size=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="KIVI reads whole pages"):
        wrapper.run_quantized(q, kivi.kv)
    with pytest.raises(ValueError, match="tail_index must have B = 2 entries"):
        wrapper.plan(
            kivi.kv_indptr, kivi.kv_indices, kivi.kv_last_len, num_qo_heads=4, **kivi.layout(),
            tail_index=torch.zeros(3, dtype=torch.int32),
        )  # fmt: skip


def test_replan_of_same_batch_size_keeps_buffers(quantized_batch, triton_device):
    # Graph safety: a second plan of the same batch size writes the same device buffers (tail rows too).
    make = dict(scheme="kivi", bits=4, block_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=32)
    first, second = quantized_batch([17, 40], **make, seed=8), quantized_batch([63, 5], **make, seed=9)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", max_batch_size=4, max_num_pages=16)
    q = torch.randn(2, 2 * NUM_KV_HEADS, 32, generator=torch.Generator().manual_seed(10))
    out = torch.empty_like(q).to(triton_device)
    buffers = wrapper._buffers
    pointers = None
    for batch in (first, second):
        _plan(wrapper, batch, 2)
        now = [t.data_ptr() for t in (buffers.indptr, buffers.indices, buffers.tail_index, buffers.o_part)]
        assert pointers is None or now == pointers
        pointers = now
        with compiling_for(None):  # KIVI's compile check runs in the tests above
            wrapper.run_quantized(q.to(triton_device), batch.kv_on(triton_device), out=out)
        torch.testing.assert_close(out.cpu(), _expected(batch, q), **TOL[torch.device(triton_device).type])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("scheme", "bits"), [("kivi", 2), ("turboquant", 4)], ids=["kivi2", "turboquant4"])
def test_quantized_decode_replays_under_cuda_graph(quantized_batch, scheme, bits):
    make = dict(scheme=scheme, bits=bits, block_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=64)
    first, second = quantized_batch([17, 300, 5], **make, seed=11), quantized_batch([64, 33, 240], **make, seed=12)
    kv = first.kv_on("cuda")  # same pool tensors: the second batch's codes are copied in after capture
    wrapper = BatchDecodeWithPagedKVCache("cuda", max_batch_size=4, max_num_pages=64)
    _plan(wrapper, first, 2)
    q = torch.randn(3, 2 * NUM_KV_HEADS, 64, device="cuda")
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.run_quantized(q, kv, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run_quantized(q, kv, out=out)
    second_kv = second.kv_on("cuda")
    for name in ("k", "v", "k_scale", "v_scale", "k_min", "v_min", "k_tail", "v_tail", "rotation"):
        if getattr(kv, name) is not None:
            getattr(kv, name).copy_(getattr(second_kv, name))
    _plan(wrapper, second, 2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), _expected(second, q), **TOL["cuda"])
