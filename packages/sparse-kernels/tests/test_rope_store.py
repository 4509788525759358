"""rope_store: rotate q/k and store the rotated keys and the values into the paged pool (and the first
queries into a ring) in one launch, equal to the unfused chain ``Rotation.apply`` then ``store_kv``.

The reference is that chain; the Triton kernel equals the chain run with Triton bit for bit, and the
reference within test_rope's tolerance (bf16: the head norm's sum order, the interpreter's truncating
casts). Padded tokens (slot -1) carry NaN keys and values, which must never reach the pool. The Triton
backend runs natively on CUDA where present, else on CPU under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_kernels import Rotation, rope_qk, rope_store, store_kv
from sparse_kernels._triton.compile_check import compiling_for

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}
EXACT = dict(atol=0, rtol=0)
MAX_POSITION = 64


def _table(head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(MAX_POSITION).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]


def _case(slots, num_q_heads=4, num_kv_heads=2, head_dim=16, *, dtype=torch.float32, norm=True, seed=0):
    """q/k/v as strided views of one merged projection output, a rotation, a random pool and ring."""
    tokens = len(slots)
    gen = torch.Generator().manual_seed(seed)
    merged = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    padded = torch.tensor(slots) < 0
    merged[padded, q_size:] = float("nan")  # padded tokens' keys and values must not reach the pool
    q = merged[:, :q_size].view(tokens, num_q_heads, head_dim)
    k = merged[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    v = merged[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)] if norm else [None] * 2
    rotation = Rotation(positions, _table(head_dim), *weights, eps=1e-6)
    num_blocks = max(6, max(slots, default=0) // 4 + 1)  # at least 24 slots, enough for long steps
    shape = (num_blocks, 4, num_kv_heads, head_dim)  # [num_blocks, block_size, Hkv, D]
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    rows = max(7, tokens)
    ring = torch.randn(rows, num_q_heads, head_dim, generator=gen).to(dtype)
    index = torch.randperm(rows, generator=gen)  # distinct ring rows, more than any step copies
    return q, k, v, rotation, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32), ring, index


def _to(x, device):
    if isinstance(x, Rotation):
        return Rotation(*(_to(f, device) for f in x))
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _fused(case, num_copy, backend, device):
    """rope_store on copies of the case's pool and ring: ``(q_out, k_cache, v_cache, ring)`` on the CPU."""
    q, k, v, rotation, k_cache, v_cache, slots, ring, index = (_to(x, device) for x in case)
    k_cache, v_cache, ring = k_cache.clone(), v_cache.clone(), ring.clone()
    copy = dict(copy_into=ring, copy_index=index) if num_copy else {}
    q_out = rope_store(q, k, v, rotation, k_cache, v_cache, slots, **copy, num_copy=num_copy, backend=backend)
    assert q_out.is_contiguous() and q_out.dtype == q.dtype and q_out.shape == q.shape
    return tuple(t.cpu() for t in (q_out, k_cache, v_cache, ring))


def _unfused(case, num_copy, backend, device):
    """The chain rope_store stands for: ``rope_qk`` then ``store_kv`` with its query copy."""
    q, k, v, rotation, k_cache, v_cache, slots, ring, index = (_to(x, device) for x in case)
    k_cache, v_cache, ring = k_cache.clone(), v_cache.clone(), ring.clone()
    q_out, k_out = rotation.apply(q, k, backend=backend)
    copy = dict(copy_rows=q_out[:num_copy], copy_into=ring, copy_index=index) if num_copy else {}
    store_kv(k_out, v, k_cache, v_cache, slots, **copy, backend=backend)
    return tuple(t.cpu() for t in (q_out, k_cache, v_cache, ring))


def _check_against_truth(got, case, num_copy, tol):
    """Independently of store_kv: written slots hold the reference's rotated keys (within ``tol``) and the
    values (exactly); every other slot and ring row keeps its contents bit for bit."""
    q, k, v, rotation, k_cache, v_cache, slots, ring, index = case
    q_out, k_pool, v_pool, ring_out = got
    weights = dict(q_weight=rotation.q_weight, k_weight=rotation.k_weight, eps=rotation.eps)
    exp_q, exp_k = rope_qk(q, k, rotation.positions, rotation.cos_sin, **weights, backend="reference")
    torch.testing.assert_close(q_out, exp_q, **tol)
    heads, dim = k.shape[1:]
    written = slots[slots >= 0].long()
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    untouched[written] = False
    for pool, before in ((k_pool, k_cache), (v_pool, v_cache)):
        torch.testing.assert_close(
            pool.view(-1, heads, dim)[untouched], before.view(-1, heads, dim)[untouched], **EXACT
        )
    torch.testing.assert_close(k_pool.view(-1, heads, dim)[written], exp_k[slots >= 0], **tol)
    torch.testing.assert_close(v_pool.view(-1, heads, dim)[written], v[slots >= 0], **EXACT)
    assert not k_pool.isnan().any() and not v_pool.isnan().any()
    kept = torch.ones(ring.shape[0], dtype=torch.bool)
    kept[index[:num_copy]] = False
    torch.testing.assert_close(ring_out[kept], ring[kept], **EXACT)
    torch.testing.assert_close(ring_out[index[:num_copy]], exp_q[:num_copy], **tol)


def _check_all(case, num_copy, device):
    dtype = case[0].dtype
    triton = _fused(case, num_copy, "triton", device)
    reference = _fused(case, num_copy, "reference", "cpu")
    for got, exp in zip(reference, _unfused(case, num_copy, "reference", "cpu"), strict=True):
        torch.testing.assert_close(got, exp, **EXACT, equal_nan=True)  # the reference is the chain
    for got, exp in zip(triton, _unfused(case, num_copy, "triton", device), strict=True):
        torch.testing.assert_close(got, exp, **EXACT, equal_nan=True)  # one launch, the chain's values
    for got, exp in zip(triton, reference, strict=True):
        torch.testing.assert_close(got, exp, **TOL[dtype], equal_nan=True)
    _check_against_truth(reference, case, num_copy, EXACT)
    _check_against_truth(triton, case, num_copy, TOL[dtype])


# A prefill-sized step (tiles of tokens, see ``_token_tile``): 70 tokens, so the last tile is partial;
# distinct slots of a 24 x 4 pool, padded tokens scattered and one run of them across a tile boundary.
LONG_SLOTS = [-1 if t % 9 == 4 or 44 <= t < 50 else (37 * t) % 96 for t in range(70)]


@pytest.mark.parametrize(
    ("slots", "num_copy"),
    [
        ([0, 5, 23, 7, 12], 0),  # plain scatter, the pool's last slot included, no copy
        ([4, -1, 9, -1], 2),  # padded tokens among real ones; the first two queries copied
        ([13, 2, -1, -1], 4),  # CUDA-graph bucket: padded tokens' queries are copied too
        ([-1, -1, -1], 1),  # all padding: the pool stays as it was
        (LONG_SLOTS, 21),  # tiles of tokens; the copy ends inside a tile
    ],
)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused_chain(slots, num_copy, norm, dtype, triton_device):
    _check_all(_case(slots, dtype=dtype, norm=norm), num_copy, triton_device)


@pytest.mark.parametrize(
    ("slots", "num_copy"),
    [
        ([4, -1, 9, 2, -1], 3),  # one-token launch, then 5 live rows of one tile
        (LONG_SLOTS, 21),  # tiles, then 70 one-token programs
    ],
)
@pytest.mark.parametrize(("dtype", "norm"), [(torch.float32, False), (torch.bfloat16, True)])
def test_token_tiles_match_one_token_launch(slots, num_copy, dtype, norm, triton_device, monkeypatch):
    """The launch chosen by the step's length and the other one write the same bits everywhere."""
    from sparse_kernels._triton import rope as rope_triton

    case = _case(slots, 2, 1, dtype=dtype, norm=norm, seed=5)
    chosen = _fused(case, num_copy, "triton", triton_device)
    tiled = len(slots) >= rope_triton.TILE_MIN_TOKENS
    monkeypatch.setattr(rope_triton, "TILE_MIN_TOKENS", 10**9 if tiled else 1)
    assert rope_triton._token_tile(len(slots), 8)[0] == (1 if tiled else rope_triton.TILE_TOKENS)
    with compiling_for(None):  # both launches compile for sm_90 in test_tiled_launch_compiles_for_sm90
        other = _fused(case, num_copy, "triton", triton_device)
    for got, exp in zip(chosen, other, strict=True):
        torch.testing.assert_close(got, exp, **EXACT, equal_nan=True)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (3, 1)])
def test_head_layouts_and_head_dim_32(heads, triton_device):
    num_q_heads, num_kv_heads = heads
    case = _case([3, 0, -1, 17, 8], num_q_heads, num_kv_heads, head_dim=32, dtype=torch.bfloat16, seed=3)
    _check_all(case, 3, triton_device)


def test_tiled_launch_compiles_for_sm90():
    """Both launches at Qwen3's head_dim in bf16 with the norm compile for sm_90 (on CPU tensors, so also on a
    GPU machine): rope_store with a copy, and rope_qk, at a tiled and a one-token length."""
    from sparse_kernels._triton.rope import TILE_TOKENS, _token_tile

    for slots, num_copy in ((LONG_SLOTS, 21), ([3, -1, 8], 2)):
        assert _token_tile(len(slots), 64)[0] == (TILE_TOKENS if len(slots) == 70 else 1)
        case = _case(slots, 4, 2, head_dim=128, dtype=torch.bfloat16, seed=1)
        with compiling_for("cuda", 90, 32):
            got = _fused(case, num_copy, "triton", "cpu")
            q, k, _, rotation, *_ = case
            q_out, _ = rotation.apply(q, k, backend="triton")
        torch.testing.assert_close(got[0], q_out, **EXACT)


def test_empty_step_changes_nothing(triton_device):
    case = _case([], dtype=torch.float32)
    for backend, device in (("triton", triton_device), ("reference", "cpu")):
        q_out, k_pool, v_pool, ring = _fused(case, 0, backend, device)
        assert q_out.shape == (0, 4, 16)
        assert torch.equal(k_pool, case[4]) and torch.equal(v_pool, case[5]) and torch.equal(ring, case[7])


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 6),
    heads=st.sampled_from([(1, 1), (4, 2), (4, 1)]),
    head_dim=st.sampled_from([16, 32]),
    norm=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_property_random_steps(tokens, heads, head_dim, norm, dtype, data):
    """Random small steps: distinct slots of a 6 x 4 pool with some tokens padded, any number of copies."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    slots = data.draw(st.permutations(range(24)))[:tokens]
    padded = data.draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens))
    slots = [-1 if pad else slot for slot, pad in zip(slots, padded, strict=True)]
    num_copy = data.draw(st.integers(0, tokens))
    seed = data.draw(st.integers(0, 2**16))
    case = _case(slots, *heads, head_dim, dtype=dtype, norm=norm, seed=seed)
    _check_all(case, num_copy, device)


def test_rotation_apply_is_rope_qk():
    q, k, _, rotation, *_ = _case([0, 1, 2])
    got = rotation.apply(q, k, backend="reference")
    weights = dict(q_weight=rotation.q_weight, k_weight=rotation.k_weight, eps=rotation.eps)
    exp = rope_qk(q, k, rotation.positions, rotation.cos_sin, **weights, backend="reference")
    for a, b in zip(got, exp, strict=True):
        torch.testing.assert_close(a, b, **EXACT)
    assert Rotation(rotation.positions, rotation.cos_sin).eps == 1e-6


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rejects_bad_inputs(backend):
    q, k, v, rotation, k_cache, v_cache, slots, ring, index = _case([0, 1, -1])

    def call(**changes):
        args = dict(q=q, k=k, v=v, rotation=rotation, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
        copy = {name: changes.pop(name) for name in ("copy_into", "copy_index", "num_copy") if name in changes}
        args.update(changes)
        return rope_store(**args, **copy, backend=backend)

    with pytest.raises(ValueError, match="key and value"):
        call(v=v[:2])
    with pytest.raises(ValueError, match="q, k must be"):
        call(k=k[:2], v=v[:2])
    with pytest.raises(ValueError, match="cache heads/head_dim"):
        call(k_cache=k_cache[:, :, :1], v_cache=v_cache[:, :, :1])
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        call(slot_mapping=slots.long())
    with pytest.raises(ValueError, match="positions"):
        call(rotation=rotation._replace(positions=rotation.positions[:2]))
    with pytest.raises(ValueError, match="both"):
        call(rotation=rotation._replace(k_weight=None))
    with pytest.raises(TypeError, match="Rotation"):
        call(rotation=tuple(rotation))
    with pytest.raises(ValueError, match="q's dtype"):
        call(v=v.to(torch.bfloat16))
    with pytest.raises(ValueError, match="q's dtype"):
        call(k_cache=k_cache.to(torch.bfloat16), v_cache=v_cache.to(torch.bfloat16))
    with pytest.raises(ValueError, match="pass num_copy > 0"):
        call(copy_into=ring, copy_index=index)
    with pytest.raises(ValueError, match="go together"):
        call(copy_into=ring, num_copy=2)
    with pytest.raises(ValueError, match="num_copy must be"):
        call(copy_into=ring, copy_index=index, num_copy=4)
    with pytest.raises(ValueError, match="shaped like"):
        call(copy_into=ring[:, :2], copy_index=index, num_copy=2)
    with pytest.raises(ValueError, match="shaped like"):
        call(copy_into=ring.to(torch.bfloat16), copy_index=index, num_copy=2)
    with pytest.raises(ValueError, match="int64"):
        call(copy_into=ring, copy_index=index.int(), num_copy=2)
