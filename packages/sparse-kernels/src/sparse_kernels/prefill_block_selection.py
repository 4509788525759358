"""Which key blocks each query tile of a prefill chunk reads: FlashPrefill's block selection.

FlashPrefill (qhfan/FlashPrefillv2, arXiv 2608.19758) cuts keys into blocks of ``k_block_n`` tokens
and queries into tiles of ``k_block_m`` *packed* rows: the rows of one KV head's query group, query
position major (packed row ``r`` is query ``r // group`` of head ``kv_head * group + r % group``), so a
tile is ``k_block_m / group`` positions of every head in the group and one selection serves them all.

Per (tile, KV head) of a request with ``q_len`` queries at the end of ``kv_len`` keys (``prefix =
kv_len - q_len``; a tile's first / last query positions ``q_first`` / ``q_last``):

- dense tiles: every causally visible block when ``q_len <= min_sparse_q_len`` or the tile is one of
  the request's last ``last_query_blocks`` tiles;
- otherwise each block ``j`` below ``active = (prefix + q_last + 1) // k_block_n`` (the blocks some row
  sees whole) is scored by its mean key: ``s[r, j] = scale * q_r . mean(k_j)`` in log2 units, for rows
  that see the block's first token; ``S[j] = sum_r 2^(s[r, j] - max_{r, j} s)`` (the tile's softmax
  mass on the block); it is kept when ``S[j] >= abs_threshold * max_j S[j]``. Also kept: the first
  ``attention_sink_blocks`` blocks and the local ones, ``first_k - window_blocks + 1 <= j <= last_k``
  (``first_k`` / ``last_k``: the blocks of ``prefix + q_first`` / ``prefix + q_last``); nothing past
  ``last_k``. ``window_blocks >= 1`` keeps every block holding a query of the tile, so threshold 0
  keeps every visible block (dense).
- mean correction: the dropped blocks every row sees whole (``j < (prefix + q_first) // k_block_n``)
  still enter the softmax as one pooled key/value each, weighted by the block's length (the kernel's
  epilogue, upstream's "zero-order correction").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_LOG2E = 1.4426950408889634
# Scores of a request are computed for a chunk of its tiles at a time, within this many float32 elements.
_SCORE_ELEMENTS = 2**26


@dataclass(frozen=True, slots=True)
class BlockSparseParams:
    """FlashPrefill's selection parameters (SE's ``flashprefill_v2_*`` names without the prefix).

    ``abs_threshold`` in [0, 1] (0 keeps everything; larger keeps fewer blocks); ``k_block_m`` packed query
    rows per tile, a multiple of 16; ``k_block_n`` keys per block, a power of two >= 16.
    """

    abs_threshold: float
    k_block_m: int = 128
    k_block_n: int = 128
    attention_sink_blocks: int = 2
    window_blocks: int = 4
    last_query_blocks: int = 8
    min_sparse_q_len: int = 4096
    use_mean_correction: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.abs_threshold <= 1.0:
            raise ValueError(f"abs_threshold must be in [0, 1], got {self.abs_threshold}")
        if self.k_block_m < 16 or self.k_block_m % 16:
            raise ValueError(f"k_block_m must be a positive multiple of 16, got {self.k_block_m}")
        if self.k_block_n < 16 or self.k_block_n & (self.k_block_n - 1):
            raise ValueError(f"k_block_n must be a power of two >= 16, got {self.k_block_n}")
        if self.window_blocks < 1:
            raise ValueError(f"window_blocks must be >= 1 (the diagonal block), got {self.window_blocks}")
        for name in ("attention_sink_blocks", "last_query_blocks", "min_sparse_q_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class TileLayout:
    """A prefill step cut into query tiles (host-built by ``tile_layout``; per-tile tensors on the device).

    Per tile (int32 ``[num_tiles]``): ``tile_req`` its request, ``tile_row`` its first packed row,
    ``first_k`` / ``last_k`` the blocks of its first / last query, ``active`` how many blocks are scored
    (0: a dense tile), ``mean_end`` blocks below it that are dropped enter the mean correction (0: none).
    Per request (host): ``qo_starts``, ``qo_lens``, ``kv_lens``, ``num_blocks``, ``tile_starts`` (``[B + 1]``)
    and ``sparse`` (whether its tiles are scored).
    """

    params: BlockSparseParams
    group: int
    num_kv_heads: int
    head_dim: int
    tile_req: torch.Tensor
    tile_row: torch.Tensor
    first_k: torch.Tensor
    last_k: torch.Tensor
    active: torch.Tensor
    mean_end: torch.Tensor
    qo_starts: tuple[int, ...]
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_blocks: tuple[int, ...]
    tile_starts: tuple[int, ...]
    sparse: tuple[bool, ...]

    @property
    def num_tiles(self) -> int:
        return self.tile_starts[-1]

    @property
    def max_blocks(self) -> int:
        return max(self.num_blocks)

    @property
    def any_sparse(self) -> bool:
        return any(self.sparse)


@dataclass(frozen=True, slots=True)
class BlockLists:
    """Per (KV head, tile), ascending block ids: ``keep`` read exactly, ``mean`` read as pooled means.

    ``keep_ids`` / ``mean_ids``: int32 ``[num_kv_heads, num_tiles, max_blocks]`` (entries past the count
    are padding); ``keep_counts`` / ``mean_counts``: int32 ``[num_kv_heads, num_tiles]``.
    """

    keep_ids: torch.Tensor
    keep_counts: torch.Tensor
    mean_ids: torch.Tensor
    mean_counts: torch.Tensor


def tile_layout(
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    params: BlockSparseParams,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> TileLayout:
    """Cut a step (host ``qo_indptr`` and KV lengths) into tiles; see the module doc. Host work is a few
    vector ops over the tiles and one copy to the device."""
    from sparse_kernels._backend import host_to_device

    p, group = params, num_qo_heads // num_kv_heads
    qo_starts = qo_indptr[:-1].tolist()
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    kv = kv_lens.tolist()
    num_blocks = [-(-n // p.k_block_n) for n in kv]
    sparse = [q > p.min_sparse_q_len for q in qo_lens]
    per_req = [-(-q * group // p.k_block_m) for q in qo_lens]
    tile_starts = [0, *torch.tensor(per_req).cumsum(0).tolist()]
    req = torch.repeat_interleave(torch.arange(len(qo_lens)), torch.tensor(per_req))
    m = torch.arange(req.numel()) - torch.tensor(tile_starts[:-1])[req]  # tile index within its request
    q_len, prefix = torch.tensor(qo_lens)[req], (torch.tensor(kv) - torch.tensor(qo_lens))[req]
    q_first = m * p.k_block_m // group
    q_last = (torch.minimum((m + 1) * p.k_block_m, q_len * group) - 1) // group
    scored = torch.tensor(sparse)[req] & (m < torch.tensor(per_req)[req] - p.last_query_blocks)
    active = torch.where(scored, (prefix + q_last + 1) // p.k_block_n, 0)
    mean_end = (
        torch.where(scored, (prefix + q_first) // p.k_block_n, 0) if p.use_mean_correction else torch.zeros_like(m)
    )
    per_tile = [x.to(torch.int32) for x in (req, m * p.k_block_m, (prefix + q_first) // p.k_block_n)]
    per_tile += [((prefix + q_last) // p.k_block_n).to(torch.int32), active.to(torch.int32), mean_end.to(torch.int32)]
    return TileLayout(
        params,
        group,
        num_kv_heads,
        head_dim,
        *host_to_device(torch.stack(per_tile), device).unbind(0),
        qo_starts=tuple(qo_starts),
        qo_lens=tuple(qo_lens),
        kv_lens=tuple(kv),
        num_blocks=tuple(num_blocks),
        tile_starts=tuple(tile_starts),
        sparse=tuple(sparse),
    )


def block_means_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, layout: TileLayout, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[B, max_blocks, num_kv_heads, head_dim]`` mean key and value of every block of every
    sparse request (zeros elsewhere): each block's mean over its tokens (the last block's may be fewer).
    ``kv_indptr`` / ``kv_indices``: the step's host CSR."""
    _, block_size, hkv, dim = k_cache.shape
    k_block_n, batch = layout.params.k_block_n, len(layout.kv_lens)
    k_mean = torch.zeros(batch, layout.max_blocks, hkv, dim, device=k_cache.device)
    v_mean = torch.zeros_like(k_mean)
    for b, n in enumerate(layout.kv_lens):
        if layout.sparse[b]:
            pos = torch.arange(n)
            blocks = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            slots = (blocks[pos // block_size] * block_size + pos % block_size).to(k_cache.device)
            block = (pos // k_block_n).to(k_cache.device)
            count = torch.bincount(block, minlength=layout.max_blocks).clamp(min=1)[:, None, None].float()
            for mean, cache in ((k_mean, k_cache), (v_mean, v_cache)):
                mean[b].index_add_(0, block, cache.view(-1, hkv, dim)[slots].float()).div_(count)
    return k_mean, v_mean


def select_blocks(q: torch.Tensor, k_mean: torch.Tensor, layout: TileLayout, sm_scale: float) -> BlockLists:
    """The kept and mean-corrected blocks of every (KV head, tile), on the device without host sync.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, num_qo_heads, head_dim]``, the step's queries in ``qo_indptr`` order.
    k_mean : torch.Tensor
        float32 ``[B, max_blocks, num_kv_heads, head_dim]`` block means (``block_means_reference``).
    layout : TileLayout
    sm_scale : float
        The attention's softmax scale (scores are in its units).
    """
    p, dev = layout.params, q.device
    j = torch.arange(layout.max_blocks, device=dev)
    num_blocks = torch.tensor(layout.num_blocks, device=dev)[layout.tile_req.long()]
    visible = (j[None, :] <= layout.last_k[:, None]) & (j[None, :] < num_blocks[:, None])  # [tiles, nb]
    dense = (layout.active == 0)[:, None]
    local = (j[None, :] < p.attention_sink_blocks) | (j[None, :] >= layout.first_k[:, None] - p.window_blocks + 1)
    keep = (visible & (dense | local))[None].repeat(layout.num_kv_heads, 1, 1)  # [Hkv, tiles, nb]
    for b in range(len(layout.qo_lens)):
        if layout.sparse[b]:
            _score_request(q, k_mean, layout, b, sm_scale, keep)
    keep &= visible[None]
    mean = ~keep & (j[None, None, :] < layout.mean_end[None, :, None])
    keep_ids, keep_counts = _compact(keep)
    mean_ids, mean_counts = _compact(mean)
    return BlockLists(keep_ids, keep_counts, mean_ids, mean_counts)


def _score_request(q, k_mean, layout: TileLayout, b: int, sm_scale: float, keep: torch.Tensor) -> None:
    """OR request ``b``'s scored blocks into ``keep`` ``[Hkv, tiles, nb]``, a chunk of its tiles at a time."""
    p, g, hkv, bm = layout.params, layout.group, layout.num_kv_heads, layout.params.k_block_m
    q_len, start, nb = layout.qo_lens[b], layout.qo_starts[b], layout.num_blocks[b]
    prefix = layout.kv_lens[b] - q_len
    t0, t1 = layout.tile_starts[b], layout.tile_starts[b + 1]
    rows = torch.zeros(hkv, (t1 - t0) * bm, q.shape[-1], dtype=torch.float32, device=q.device)
    rows[:, : q_len * g] = q[start : start + q_len].float().view(q_len, hkv, g, -1).permute(1, 0, 2, 3).flatten(1, 2)
    rows = rows.view(hkv, t1 - t0, bm, -1)  # packed rows of each tile
    km = k_mean[b, :nb].float().transpose(0, 1)  # [Hkv, nb, D]
    j = torch.arange(nb, device=q.device)
    chunk = max(1, _SCORE_ELEMENTS // (hkv * bm * nb))
    for c0 in range(0, t1 - t0, chunk):
        c1 = min(c0 + chunk, t1 - t0)
        r = torch.arange(c0 * bm, c1 * bm, device=q.device).view(c1 - c0, bm)
        row_sees = (r < q_len * g)[..., None] & (prefix + (r // g)[..., None] >= j * p.k_block_n)  # [c, bm, nb]
        active = layout.active[t0 + c0 : t0 + c1].long()
        mask = row_sees & (j < active[:, None, None])
        s = torch.einsum("hcmd,hjd->hcmj", rows[:, c0:c1], km) * (sm_scale * _LOG2E)
        s = s.masked_fill(~mask, float("-inf"))
        top = s.amax(dim=(2, 3), keepdim=True).clamp(min=-1e30)  # finite: an all-masked tile has mass 0
        mass = torch.exp2(s - top).sum(2)  # [Hkv, c, nb]
        scored = (mass >= p.abs_threshold * mass.amax(-1, keepdim=True)) & (j < active[:, None])
        keep[:, t0 + c0 : t0 + c1, :nb] |= scored


def _compact(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ascending ids of the set entries of ``mask [..., n]`` first (padding after), and their counts."""
    n = mask.shape[-1]
    key = torch.where(mask, torch.arange(n, device=mask.device), n)
    ids = key.sort(dim=-1).values
    return ids.clamp(max=max(n - 1, 0)).to(torch.int32), mask.sum(-1, dtype=torch.int32)


def mean_bias(kv_len: int, k_block_n: int, num_blocks: int, device) -> torch.Tensor:
    """Natural-log weight of each block's pooled key in the softmax: ``log(tokens in the block)``."""
    j = torch.arange(num_blocks, device=device)
    return torch.log(torch.clamp(kv_len - j * k_block_n, max=k_block_n).float())
