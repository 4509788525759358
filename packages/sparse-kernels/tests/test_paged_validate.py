"""Every plan validation error of BatchPrefillWithPagedKVCache is raised with a clear message."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchPrefillWithPagedKVCache


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# A valid two-request layout with block_size 4: kv_lens 6 and 3, qo_lens 2 and 3.
VALID = {
    "qo_indptr": _i32(0, 2, 5),
    "kv_indptr": _i32(0, 2, 3),
    "kv_indices": _i32(4, 1, 7),
    "kv_last_len": _i32(2, 3),
    "num_qo_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "block_size": 4,
}

BAD = [
    ({"qo_indptr": _i32(0, 2, 5).to(torch.int64)}, "qo_indptr must be int32"),
    ({"kv_indices": _i32(4, 1, 7).to(torch.int64)}, "kv_indices must be int32"),
    ({"kv_last_len": torch.tensor([[2, 3]], dtype=torch.int32)}, "kv_last_len must be a 1-D tensor"),
    ({"qo_indptr": _i32(0)}, "at least one request"),
    ({"qo_indptr": _i32(1, 2, 5)}, r"qo_indptr\[0\] must be 0"),
    ({"kv_indptr": _i32(0, 3, 2), "kv_indices": _i32(4, 1)}, "kv_indptr must be non-decreasing"),
    ({"qo_indptr": _i32(0, 4, 3)}, "qo_indptr must be non-decreasing"),
    ({"qo_indptr": _i32(0, 0, 3)}, "request 0 has no query token"),
    ({"kv_indptr": _i32(0, 3, 3)}, "request 1 has no KV block"),
    ({"kv_indices": _i32(4, 1)}, r"kv_indptr\[-1\] \(3\) must equal len\(kv_indices\) \(2\)"),
    ({"kv_indices": _i32(4, -1, 7)}, "non-negative block ids"),
    ({"kv_last_len": _i32(2)}, "kv_last_len must have B = 2"),
    ({"kv_last_len": _i32(0, 3)}, r"kv_last_len entries must be in \[1, block_size=4\]"),
    ({"kv_last_len": _i32(2, 5)}, r"kv_last_len entries must be in \[1, block_size=4\]"),
    ({"qo_indptr": _i32(0, 2, 6)}, r"request 1: qo_len \(4\) exceeds kv_len \(3\)"),
    ({"qo_indptr": _i32(0, 2, 5, 6)}, "qo_indptr has 3 requests but kv_indptr has 2"),
    ({"num_qo_heads": 3}, r"num_qo_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    ({"num_kv_heads": 0}, "num_kv_heads must be a positive int"),
    ({"head_dim": 0}, "head_dim must be a positive int"),
    ({"block_size": -4}, "block_size must be a positive int"),
    ({"sm_scale": 0.0}, "sm_scale must be positive"),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[m for _, m in BAD])
def test_plan_rejects(override, message):
    kwargs = {**VALID, **override}
    args = [kwargs.pop(name) for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len")]
    with pytest.raises(ValueError, match=message):
        BatchPrefillWithPagedKVCache("cpu").plan(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to put metadata off the host")
def test_plan_rejects_device_metadata():
    kwargs = dict(VALID)
    args = [kwargs.pop(name) for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len")]
    args[0] = args[0].cuda()
    with pytest.raises(ValueError, match="qo_indptr must be a CPU tensor"):
        BatchPrefillWithPagedKVCache("cuda").plan(*args, **kwargs)


def test_valid_layout_plans():
    kwargs = dict(VALID)
    args = [kwargs.pop(name) for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len")]
    BatchPrefillWithPagedKVCache("cpu").plan(*args, **kwargs)


def test_constructor_rejects_bad_cap():
    with pytest.raises(ValueError, match="max_tile_elements"):
        BatchPrefillWithPagedKVCache("cpu", max_tile_elements=0)
