"""Block-sparse prefill over a paged KV cache (FlashPrefill): plan/run wrapper, Triton + reference.

Same step layout and contract as ``BatchPrefillWithPagedKVCache`` (request ``b``'s queries are the last
``qo_len_b`` of its ``kv_len_b`` tokens, so a cached prefix is allowed; causal; GQA), but each query
tile reads only the key blocks ``prefill_block_selection`` keeps for it, plus (mean correction) one
pooled key/value per dropped block the whole tile sees. ``run`` computes the block means, selects and
attends, all on the device. A step whose requests all have ``qo_len <= min_sparse_q_len`` runs the dense
prefill kernel; with ``abs_threshold=0`` every visible block is kept and the output equals dense
prefill (up to float summation order).
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import host_to_device
from sparse_kernels._paged_run import check_run_inputs
from sparse_kernels._paged_validate import check_heads, check_indptr, check_paged_kv, check_qo_fits, check_sm_scale
from sparse_kernels._paged_wrapper import DEFAULT_MAX_TILE_ELEMENTS, PagedAttentionWrapper, output_buffer
from sparse_kernels.paged_prefill import BatchPrefillWithPagedKVCache
from sparse_kernels.prefill_block_selection import (
    BlockLists,
    BlockSparseParams,
    TileLayout,
    block_means_reference,
    mean_bias,
    select_blocks,
    tile_layout,
)


class BatchBlockSparsePrefillWithPagedKVCache(PagedAttentionWrapper):
    """FlashPrefill attention for a batch of prefill chunks over paged K/V.

    Parameters
    ----------
    device, backend, max_tile_elements
        As ``PagedAttentionWrapper`` (the reference backend caps its working set by
        ``max_tile_elements``).
    params : BlockSparseParams
        The selection (threshold, block sizes, sink / window / last query blocks, mean correction).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        params: BlockSparseParams,
        backend: str = "auto",
        max_tile_elements: int = DEFAULT_MAX_TILE_ELEMENTS,
    ):
        super().__init__(device, backend=backend, max_tile_elements=max_tile_elements)
        self.params = params
        self._dense = BatchPrefillWithPagedKVCache(
            self.device, backend=self.backend, max_tile_elements=max_tile_elements
        )
        self.layout: TileLayout | None = None  # None: the planned step runs dense

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        causal: bool = True,
        sm_scale: float | None = None,
        window_left: int = -1,
    ) -> None:
        """Validate the step's layout (as ``BatchPrefillWithPagedKVCache.plan``) and cut it into tiles.

        A sliding-window layer (``window_left >= 0``) is local already: it runs the dense kernel's window.

        Raises
        ------
        ValueError
            On a malformed layout, or ``causal=False`` (the selection is causal).
        """
        if not causal:
            raise ValueError("block-sparse prefill is causal only")
        check_heads(num_qo_heads, num_kv_heads, head_dim, block_size)
        qo_lens = check_indptr("qo_indptr", qo_indptr, "query token")
        _, kv_lens = check_paged_kv(kv_indptr, kv_indices, kv_last_len, block_size)
        check_qo_fits(qo_lens, kv_lens)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        self._plan = _Plan(
            *(host_to_device(t, self.device) for t in (qo_indptr, kv_indptr, kv_indices, kv_last_len)),
            num_qo_tokens=int(qo_indptr[-1]),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            sm_scale=sm_scale,
            host=(kv_indptr.clone(), kv_indices.clone()),
        )
        self.layout = None
        if int(qo_lens.max()) <= self.params.min_sparse_q_len or window_left >= 0:
            self._dense.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                kv_last_len,
                num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                sm_scale=sm_scale,
                window_left=window_left,
            )
            return
        self.layout = tile_layout(
            qo_indptr,
            kv_lens,
            params=self.params,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            device=self.device,
        )

    def select(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """The planned step's block means and selection: ``(k_mean, v_mean, BlockLists)`` (device-only)."""
        layout, plan = self._sparse_layout(), self._plan
        if self.backend == "triton":
            from sparse_kernels._triton.prefill_block_selection import block_means_triton, select_blocks_triton

            k_mean, v_mean = block_means_triton(k_cache, v_cache, plan, layout)
            return k_mean, v_mean, select_blocks_triton(q, k_mean, plan, layout)
        k_mean, v_mean = block_means_reference(k_cache, v_cache, layout, plan.host_kv_indptr, plan.host_kv_indices)
        return k_mean, v_mean, select_blocks(q, k_mean, layout, plan.sm_scale)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one layer, device-only (no host sync); arguments as ``BatchPrefillWithPagedKVCache.run``."""
        plan = self._planned()
        if self.layout is None:
            return self._dense.run(q, k_cache, v_cache, out)
        check_run_inputs(plan, q, k_cache, v_cache)
        out = output_buffer(q, out)
        k_mean, v_mean, lists = self.select(q, k_cache, v_cache)
        if self.backend == "triton":
            from sparse_kernels._triton.block_sparse_prefill import run_block_sparse_prefill_triton

            return run_block_sparse_prefill_triton(plan, self.layout, lists, q, k_cache, v_cache, k_mean, v_mean, out)
        return block_sparse_attention_reference(
            q, k_cache, v_cache, self.layout, lists, k_mean, v_mean, plan, out, self.max_tile_elements
        )

    def run_quantized(self, q, kv, out=None):
        raise NotImplementedError("block-sparse prefill reads a plain (unquantized) paged KV store only")

    def _sparse_layout(self) -> TileLayout:
        self._planned()
        if self.layout is None:
            raise RuntimeError("the planned step runs dense (no request has qo_len > min_sparse_q_len)")
        return self.layout


class _Plan:
    """Device CSR of the step and the layout ``check_run_inputs`` reads."""

    def __init__(self, qo_indptr, kv_indptr, kv_indices, kv_last_len, *, host, **layout):
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_len = (
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_len,
        )
        self.host_kv_indptr, self.host_kv_indices = host
        for name, value in layout.items():
            setattr(self, name, value)


def block_sparse_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: TileLayout,
    lists: BlockLists,
    k_mean: torch.Tensor,
    v_mean: torch.Tensor,
    plan,
    out: torch.Tensor,
    max_tile_elements: int = DEFAULT_MAX_TILE_ELEMENTS,
) -> torch.Tensor:
    """Plain torch: each packed row attends to its tile's kept keys (causal) and mean-corrected blocks."""
    bn, bm, g, hkv = layout.params.k_block_n, layout.params.k_block_m, layout.group, layout.num_kv_heads
    bs = plan.block_size
    for b, (start, q_len, kv_len) in enumerate(zip(layout.qo_starts, layout.qo_lens, layout.kv_lens, strict=True)):
        blocks = plan.host_kv_indices[int(plan.host_kv_indptr[b]) : int(plan.host_kv_indptr[b + 1])].long()
        pos = torch.arange(kv_len)
        slots = (blocks[pos // bs] * bs + pos % bs).to(q.device)
        k = k_cache.view(-1, hkv, k_cache.shape[-1])[slots].float().transpose(0, 1)  # [Hkv, kv_len, D]
        v = v_cache.view(-1, hkv, v_cache.shape[-1])[slots].float().transpose(0, 1)
        nb, t0, t1 = layout.num_blocks[b], layout.tile_starts[b], layout.tile_starts[b + 1]
        keep = _list_mask(lists.keep_ids, lists.keep_counts, t0, t1, nb)  # [Hkv, n_t, nb]
        mean = _list_mask(lists.mean_ids, lists.mean_counts, t0, t1, nb)
        rows = torch.zeros(hkv, (t1 - t0) * bm, q.shape[-1], device=q.device)
        rows[:, : q_len * g] = (
            q[start : start + q_len].float().view(q_len, hkv, g, -1).permute(1, 0, 2, 3).flatten(1, 2)
        )
        km, vm = k_mean[b, :nb].float().transpose(0, 1), v_mean[b, :nb].float().transpose(0, 1)  # [Hkv, nb, D]
        bias = mean_bias(kv_len, bn, nb, q.device)
        result = torch.empty(hkv, (t1 - t0) * bm, q.shape[-1], device=q.device)
        chunk = max(1, max_tile_elements // (hkv * bm * (kv_len + nb)))
        for c0 in range(0, t1 - t0, chunk):
            c1 = min(c0 + chunk, t1 - t0)
            r = torch.arange(c0 * bm, c1 * bm, device=q.device)
            tile = r // bm
            token_keep = keep[:, tile][..., pos.to(q.device) // bn] & (
                pos.to(q.device) <= kv_len - q_len + r[:, None] // g
            )
            exact = torch.einsum("hrd,hkd->hrk", rows[:, r], k) * plan.sm_scale
            pooled = torch.einsum("hrd,hjd->hrj", rows[:, r], km) * plan.sm_scale + bias
            logits = torch.cat(
                [exact.masked_fill(~token_keep, float("-inf")), pooled.masked_fill(~mean[:, tile], float("-inf"))], -1
            )
            probs = torch.softmax(logits, dim=-1)
            result[:, r] = probs[..., :kv_len] @ v + probs[..., kv_len:] @ vm
        packed = result[:, : q_len * g].view(hkv, q_len, g, -1).permute(1, 0, 2, 3).flatten(1, 2)  # [q_len, Hq, D]
        out[start : start + q_len] = packed.to(out.dtype)
    return out


def _list_mask(ids: torch.Tensor, counts: torch.Tensor, t0: int, t1: int, nb: int) -> torch.Tensor:
    """bool ``[Hkv, t1 - t0, nb]``: the blocks listed for tiles ``t0:t1``."""
    ids, counts = ids[:, t0:t1].long(), counts[:, t0:t1].long()
    listed = torch.arange(ids.shape[-1], device=ids.device) < counts[..., None]
    mask = torch.zeros(*ids.shape[:2], nb + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(2, torch.where(listed, ids.clamp(max=nb), nb), True)
    return mask[..., :nb]
