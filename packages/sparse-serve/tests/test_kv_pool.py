"""The KV pool: tensors allocated from the store kind match what the quantized kernels allocate, and
the pool is sized by the store's real bytes."""

import pytest
import torch

from sparse_cache import paged, quantized_paged
from sparse_kernels.kv_quant import allocate_quantized_kv
from sparse_serve.kv_pool import allocate_kv_pool, bytes_per_block, num_blocks_for_budget


@pytest.mark.parametrize(
    ("scheme", "bits"), [("fp8", 8), ("kivi", 4), ("kivi", 2), ("turboquant", 3), ("turboquant", 4)]
)
def test_store_kind_tensors_match_the_kernels_layout(scheme, bits):
    kind = quantized_paged(scheme, bits, 16, 3, 64, seed=5)
    pool = allocate_kv_pool(kind, 2, 7, torch.bfloat16, "cpu", num_tail_rows=4 if kind.has_tail else 0)
    ref = allocate_quantized_kv(scheme, bits, 7, 16, 3, 64, torch.bfloat16, "cpu", num_tails=4, seed=5)
    for layer in pool.quantized:
        for name in ("k", "v", "k_scale", "v_scale", "k_min", "v_min", "k_tail", "v_tail", "rotation", "codebook"):
            ours, theirs = getattr(layer, name), getattr(ref, name)
            assert (ours is None) == (theirs is None), name
            if ours is not None:
                assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, name
        if scheme == "turboquant":
            assert torch.equal(layer.rotation, ref.rotation) and torch.equal(layer.codebook, ref.codebook)
    assert pool.nbytes() == 7 * bytes_per_block(kind, 2, torch.bfloat16) + pool.num_tail_rows * kind.tail_bytes(2) * 2


def test_plain_pool_keeps_k_v_and_summaries():
    kind = paged(8, 2, 16, summaries=True)
    pool = allocate_kv_pool(kind, 3, 5, torch.float32, "cpu")
    assert len(pool.k) == 3 and pool.k[0].shape == (5, 8, 2, 16)
    assert pool.kmin is not None and pool.kmin[0].shape == (5, 2, 16)
    assert pool.quantized is None and pool.num_tail_rows == 0
    assert len(pool.block_tensors()) == 12


def test_budget_counts_tails_before_blocks():
    kind = quantized_paged("kivi", 4, 32, 8, 128)
    per_block = bytes_per_block(kind, 36, torch.bfloat16)
    tails = 10 * kind.tail_bytes(2) * 36
    assert num_blocks_for_budget(kind, 36, torch.bfloat16, tails + 5 * per_block + 1, num_tail_rows=10) == 5
    with pytest.raises(ValueError, match="after 10 tails"):
        num_blocks_for_budget(kind, 36, torch.bfloat16, tails, num_tail_rows=10)


@pytest.mark.parametrize("store", [paged(4, 2, 8, summaries=True), quantized_paged("fp8", 8, 4, 2, 8)])
def test_one_tensor_pool_holds_the_same_bytes_for_every_layer(store):
    """The per-layer layout: one tensor per kind of layers x blocks, which every layer indexes."""
    split = allocate_kv_pool(store, 3, 5, torch.float32, "cpu", num_tail_rows=2)
    one = allocate_kv_pool(store, 3, 5, torch.float32, "cpu", num_tail_rows=2, one_tensor=True)
    assert one.one_tensor and not split.one_tensor
    assert one.nbytes() == split.nbytes() and one.num_blocks == 15
    assert len(one.block_tensors()) == len(split.block_tensors()) // 3
    assert all(one.layers[layer] is one.layers[0] for layer in range(3))
    if one.quantized is not None:
        assert all(q.k.data_ptr() == one.quantized[0].k.data_ptr() for q in one.quantized)


def test_a_gpu_pool_that_fits_no_block_says_where_the_memory_went(monkeypatch):
    """The KV budget on a GPU is what is free after the weights, less what utilization keeps free and the
    activation reserve of the largest step: when nothing is left the error names all three and what to change."""
    from types import SimpleNamespace

    from sparse_serve.model_runner import ModelRunner

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 140 * gib))
    runner = SimpleNamespace(
        model_config=SimpleNamespace(num_hidden_layers=36, hidden_size=4096),
        config=SimpleNamespace(
            block_size=16, num_kv_blocks=None, gpu_memory_utilization=0.9, max_num_batched_tokens=131072
        ),
        device=SimpleNamespace(type="cuda"),
        store=paged(16, 8, 128),
        lanes=1,
        dtype=torch.bfloat16,
        num_tail_rows=0,
    )
    with pytest.raises(ValueError, match=r"no KV block fits.*60.0 GiB free.*14.0 GiB kept free.*128.0 GiB reserved"):
        ModelRunner._num_blocks(runner, 131072)
    runner.config.max_num_batched_tokens = 2048  # 2 GiB of activations: the rest holds blocks
    assert ModelRunner._num_blocks(runner, 131072) == (60 - 14 - 2) * gib // bytes_per_block(
        paged(16, 8, 128), 36, torch.bfloat16
    )
