"""Paged attention over a latent cache (multi-head latent attention, DeepSeek-V2: arXiv 2405.04434).

In the absorbed form MLA is multi-query attention with one KV head: the cache holds per token one
row ``[c_kv | k_rope]`` (``latent_dim + rope_dim`` channels, 512 + 64 for DeepSeek-V2 and
GLM-4.7-Flash), each query head brings ``[q_nope W_UK | q_rope]`` of the same width, and the value
of a token is its ``c_kv``, the first ``latent_dim`` channels of the same row (never stored twice).
The output ``[T, H, latent_dim]`` is still in latent space; the model applies ``W_UV`` and ``o_proj``.

``plan_latent`` (host, once per step) turns FlashInfer-style CSR metadata into the kernel's tiles
and splits; ``latent_attention`` (device only) runs the Triton kernel or the plain reference over the
plan. Decode (one new token per request) and prefill over a cached prefix are the same call: decode
plans one tile of all heads per request (up to 64 heads; more take several) and splits the keys
(flash-decoding); prefill plans tiles of ``block_m`` (token, head) rows. A decode plan's launch
depends on the batch size alone (split count included: a request shorter than the splits uses
fewer of them, decided on the device), and with ``buffers`` its CSR lives in fixed device buffers,
so a ``latent_attention`` captured in a CUDA graph replays any later decode plan of the same batch
size (see ``BatchLatentDecode``). ``store_latent`` writes the step's rows into their slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_kernels._backend import host_to_device, resolve_backend
from sparse_kernels._decode_buffers import DecodeBuffers
from sparse_kernels.attention_reference import causal_attention
from sparse_kernels.kv_store import store_kv

# Keys per inner step and launch shape of the Triton kernel, per kind of step (decode: one token per
# request, all heads in one tile of up to 64 rows, split-K; an optional "block_m" sets the rows per
# tile, a power of 2 from 16), and decode's split sizing: about ``programs_per_sm``
# programs per multiprocessor (a function of the batch size, so graphs replay), each request using
# no split shorter than ``min_split_keys`` keys. Until benchmarks/mla_probe.py --sweep picks better
# ones on the H200 these are the first kernel's (num_stages 3: Triton's default).
LATENT_TILES = {
    "decode": {"block_n": 32, "num_warps": 8, "num_stages": 3, "programs_per_sm": 2, "min_split_keys": 256},
    "prefill": {"block_n": 32, "num_warps": 8, "num_stages": 3},
}
MAX_DECODE_SPLITS = 256


@dataclass(frozen=True, slots=True)
class LatentPlan:
    """One step's work for ``latent_attention``: CSR metadata on the device (int32) and its host
    copies (``*_cpu``, for the reference), the kernel's tiles (``tile_req``: the request of each
    tile, ``tile_row``: its first (token, head) row within the request; empty for ``decode`` plans,
    whose tiles follow from the program index) and splits (at most ``num_splits`` per tile, none
    shorter than ``min_split_keys`` keys)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_len: torch.Tensor
    tile_req: torch.Tensor
    tile_row: torch.Tensor
    qo_indptr_cpu: torch.Tensor
    kv_indptr_cpu: torch.Tensor
    kv_indices_cpu: torch.Tensor
    kv_last_len_cpu: torch.Tensor
    num_heads: int
    latent_dim: int
    rope_dim: int
    block_size: int
    sm_scale: float
    causal: bool
    num_splits: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    decode: bool = False
    min_split_keys: int = 1

    @property
    def tiles_per_request(self) -> int:
        return -(-self.num_heads // self.block_m) if self.decode else 1

    @property
    def num_tiles(self) -> int:
        if self.decode:
            return (self.qo_indptr_cpu.numel() - 1) * self.tiles_per_request
        return self.tile_req.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr_cpu[-1])


def plan_latent(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_len: torch.Tensor,
    *,
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    block_size: int,
    sm_scale: float,
    device: torch.device | str,
    causal: bool = True,
    num_splits: int | None = None,
    tiles: dict[str, int] | None = None,
    buffers: DecodeBuffers | None = None,
) -> LatentPlan:
    """Plan one batch of requests (host tensors, int32).

    Parameters
    ----------
    qo_indptr : [B + 1], request ``b``'s query tokens are rows ``qo_indptr[b] : qo_indptr[b + 1]`` of q.
    kv_indptr, kv_indices, kv_last_len : the pages of each request's keys (its new tokens included,
        already stored), as in FlashInfer: ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`` are block
        ids and the last one holds ``kv_last_len[b]`` tokens.
    num_splits : key splits per tile; None picks them for decode batches (every request one token)
        from the batch size, so that the GPU has work for all its cores, and 1 otherwise. Given, a
        request uses all of them (``min_split_keys`` 1) unless ``tiles`` says otherwise.
    tiles : ``LATENT_TILES`` keys overriding its values (for sweeps).
    buffers : decode batches only: fixed device buffers (``DecodeBuffers``) the CSR is copied into
        (pinned, non-blocking), instead of new device tensors.
    """
    device = torch.device(device)
    qo_indptr, kv_indptr = qo_indptr.to(torch.int32).cpu(), kv_indptr.to(torch.int32).cpu()
    kv_indices, kv_last_len = kv_indices.to(torch.int32).cpu(), kv_last_len.to(torch.int32).cpu()
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    decode = all(n == 1 for n in qo_lens)
    overrides = tiles or {}
    tiles = {**LATENT_TILES["decode" if decode else "prefill"], **overrides}
    block_m = tiles.get("block_m") or (min(64, max(16, _next_pow2(num_heads))) if decode else 32)
    tile_req, tile_row = [], []
    for b, n in enumerate(qo_lens if not decode else ()):
        for row in range(0, n * num_heads, block_m):
            tile_req.append(b)
            tile_row.append(row)
    if num_splits is not None and "min_split_keys" not in overrides:
        tiles["min_split_keys"] = 1  # the caller's splits, all of them
    min_split_keys = tiles.get("min_split_keys", 1)
    if num_splits is None:
        per_request = -(-num_heads // block_m)
        num_splits = _decode_splits(len(qo_lens) * per_request, tiles["programs_per_sm"], device) if decode else 1
    if buffers is not None:
        if not decode:
            raise ValueError("buffers hold decode plans only (one query token per request)")
        buffers.load(kv_indptr, kv_indices, kv_last_len, 1)
        csr = (buffers.indptr, buffers.indices, buffers.last_len)
    else:
        csr = tuple(host_to_device(t, device) for t in (kv_indptr, kv_indices, kv_last_len))
    as_dev = lambda xs: host_to_device(torch.tensor(xs, dtype=torch.int32), device)  # noqa: E731
    return LatentPlan(
        qo_indptr=host_to_device(qo_indptr, device) if not decode else csr[0],  # decode: unused
        kv_indptr=csr[0],
        kv_indices=csr[1],
        kv_last_len=csr[2],
        tile_req=as_dev(tile_req) if not decode else csr[0],  # decode: unused (tiles from the program index)
        tile_row=as_dev(tile_row) if not decode else csr[0],
        qo_indptr_cpu=qo_indptr,
        kv_indptr_cpu=kv_indptr,
        kv_indices_cpu=kv_indices,
        kv_last_len_cpu=kv_last_len,
        num_heads=num_heads,
        latent_dim=latent_dim,
        rope_dim=rope_dim,
        block_size=block_size,
        sm_scale=sm_scale,
        causal=causal,
        num_splits=max(1, int(num_splits)),
        block_m=block_m,
        block_n=tiles["block_n"],
        num_warps=tiles["num_warps"] if device.type == "cuda" else 4,
        num_stages=tiles["num_stages"],
        decode=decode,
        min_split_keys=max(1, int(min_split_keys)),
    )


def latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    plan: LatentPlan,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attend ``q [T, H, latent_dim + rope_dim]`` over the planned pages of ``cache [num_blocks,
    block_size, 1, latent_dim + rope_dim]``; returns ``[T, H, latent_dim]`` in q's dtype (into ``out``
    when given). Device-only: no host sync on the Triton path."""
    _check(q, cache, plan)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], plan.latent_dim)
    if q.shape[0] == 0:
        return out
    if resolve_backend(backend, q.device) == "reference":
        out.copy_(latent_attention_reference(q, cache, plan))
        return out
    from sparse_kernels._triton.latent_attention import run_latent_attention

    if q.stride(2) != 1:
        q = q.contiguous()
    if plan.num_splits == 1:
        run_latent_attention(q, cache, plan, out, None, None)
        return out
    rows = q.shape[0] * q.shape[1]
    o_part = torch.empty(rows, plan.num_splits, plan.latent_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(rows, plan.num_splits, dtype=torch.float32, device=q.device)
    run_latent_attention(q, cache, plan, out, o_part, lse_part)  # merges into out
    return out


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor) -> torch.Tensor:
    """Combine split-K partials (plain torch; the Triton path merges in one launch of its own):
    ``o_part [R, S, D]`` (each normalized over its split) with base-2 log-sum-exps ``lse_part [R, S]``
    (``-inf``: the split saw no key) -> ``[R, D]`` fp32."""
    top = lse_part.amax(dim=1, keepdim=True)
    weight = torch.exp2(lse_part - top.clamp(min=-1e30))  # dead splits weigh 0
    return (o_part * weight[..., None]).sum(dim=1) / weight.sum(dim=1, keepdim=True)


def latent_attention_reference(q: torch.Tensor, cache: torch.Tensor, plan: LatentPlan) -> torch.Tensor:
    """Plain torch: per request, gather its rows and run single-sequence attention with the first
    ``latent_dim`` channels as the values (fp32 softmax); ``[T, H, latent_dim]`` in q's dtype."""
    out = q.new_empty(q.shape[0], q.shape[1], plan.latent_dim)
    qo, kv, indices, last = plan.qo_indptr_cpu, plan.kv_indptr_cpu, plan.kv_indices_cpu, plan.kv_last_len_cpu
    for b in range(qo.numel() - 1):
        q_lo, q_hi = int(qo[b]), int(qo[b + 1])
        if q_lo == q_hi:
            continue
        pages = indices[int(kv[b]) : int(kv[b + 1])].to(device=cache.device, dtype=torch.int64)
        kv_len = (pages.numel() - 1) * plan.block_size + int(last[b])
        rows = cache[pages].flatten(0, 1)[:kv_len]  # [L, 1, D]
        out[q_lo:q_hi] = causal_attention(q[q_lo:q_hi], rows, rows[..., : plan.latent_dim], plan.sm_scale, plan.causal)
    return out


def store_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, backend: str = "auto") -> None:
    """Write the step's latent rows ``[N, 1, latent_dim + rope_dim]`` into their slots of ``cache``
    (``slot_mapping [N]`` int32, ``-1`` = a padded row left out). Graph-safe.

    ``store_kv``'s kernel with the same tensor as K and V: the row is written twice (idempotent);
    a single-tensor store would halve this small write."""
    store_kv(rows, rows, cache, cache, slot_mapping, backend=backend)


def _check(q: torch.Tensor, cache: torch.Tensor, plan: LatentPlan) -> None:
    d = plan.latent_dim + plan.rope_dim
    if q.dim() != 3 or q.shape[1] != plan.num_heads or q.shape[2] != d:
        raise ValueError(f"q must be [T, {plan.num_heads}, {d}], got {tuple(q.shape)}")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, the plan {plan.num_tokens}")
    if cache.dim() != 4 or cache.shape[1] != plan.block_size or cache.shape[2] != 1 or cache.shape[3] != d:
        raise ValueError(f"cache must be [num_blocks, {plan.block_size}, 1, {d}], got {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError("the latent cache must be contiguous")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _decode_splits(num_tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """About ``programs_per_sm`` programs per streaming multiprocessor over ``num_tiles`` tiles (4
    "multiprocessors" on CPU, which keeps interpreter grids small yet split)."""
    if num_tiles == 0:
        return 1
    cores = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(MAX_DECODE_SPLITS, -(-programs_per_sm * cores // num_tiles)))
