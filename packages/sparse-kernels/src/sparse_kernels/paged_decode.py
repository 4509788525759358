"""Batched decode attention over a paged KV cache: one query per request (plan/run; split-K Triton + reference)."""

from __future__ import annotations

import math

import torch

from sparse_kernels._decode_buffers import DecodeBuffers
from sparse_kernels._decode_layout import (
    DecodeLayout,
    check_decode_plan,
    check_decode_run,
    check_logits_out,
    check_lse_out,
)
from sparse_kernels._decode_reference import build_list_plan, run_list_decode
from sparse_kernels._paged_plan import PagedPlan, build_plan
from sparse_kernels._paged_run import run_paged_attention
from sparse_kernels._paged_wrapper import DEFAULT_MAX_TILE_ELEMENTS, PagedAttentionWrapper, output_buffer
from sparse_kernels._quantized_run import check_quantized_kv, check_tail_index, rotate, run_dequantized
from sparse_kernels.quantized_kv import QuantizedKV


class BatchDecodeWithPagedKVCache(PagedAttentionWrapper):
    """Decode attention: request ``b``'s single query sits at its last position and sees all its listed keys.

    Triton backend: split-K (flash-decoding). ``plan`` copies the step's CSR into persistent device
    buffers (pinned, non-blocking) and fixes the split count from the batch size alone; ``run`` launches
    a fixed grid ``(B, num_kv_heads, num_splits)`` plus a reduce, with no host sync. A ``run`` captured
    in a CUDA graph therefore replays correctly after a later ``plan`` of another step with the same
    batch size and mode (dense / head-sparse, ``page_size``), provided the buffers did not move: pass
    ``max_batch_size`` and ``max_num_pages`` so they are allocated once, at the first plan.

    Reference backend: dense plans without scores use the shared prefill planner; head-sparse plans and
    ``scores_out`` use a per-list reference (built at ``plan`` or, for dense plans, at the first run
    that asks for scores).

    Quantized KV (fp8, KIVI, TurboQuant; ``sparse_kernels.quantized_kv``): the same plan serves
    ``run_quantized(q, kv)``, whose Triton kernel reads only codes and scales and dequantizes in
    registers. The reference dequantizes the listed blocks and runs the plain reference over them.

    Parameters
    ----------
    device, backend, max_tile_elements
        As ``PagedAttentionWrapper``.
    max_batch_size : int, optional
        Largest batch any plan will have (fixes buffer capacities; larger plans raise).
    max_num_pages : int, optional
        Largest ``len(kv_indices)`` any plan will have (block ids, or slot ids for ``page_size=1``).
    num_splits : int, optional
        Force the split count (tuning, tests); by default it depends on the batch size and GPU.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        backend: str = "auto",
        max_batch_size: int | None = None,
        max_num_pages: int | None = None,
        num_splits: int | None = None,
        max_tile_elements: int = DEFAULT_MAX_TILE_ELEMENTS,
    ):
        super().__init__(device, backend=backend, max_tile_elements=max_tile_elements)
        self._buffers = DecodeBuffers(self.device, max_batch_size, max_num_pages, num_splits)
        self._layout: DecodeLayout | None = None
        self._num_splits = 1
        self._csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # host copy, reference only
        self._list_tiles = None  # reference: per-list tiles of a dense plan, built when scores are asked
        self._tail_index: torch.Tensor | None = None  # host copy of the plan's KIVI tail rows
        self._partial_pages = False  # a dense list ends in an incomplete page (KIVI reads it from a tail)
        self._quantized_reference = None  # reference: (with tails, compact pool, wrapper over it), at first use

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        sm_scale: float | None = None,
        head_sparse: bool = False,
        page_size: int | None = None,
        tail_index: torch.Tensor | None = None,
        window_left: int = -1,
    ) -> None:
        """Validate the step's paged layout and stage what ``run`` reads (host; not graph-captured).

        Parameters
        ----------
        kv_indptr : torch.Tensor
            int32 CPU. Dense: ``[B + 1]``, request ``b``'s pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
            Head-sparse: ``[B * num_kv_heads + 1]``, one list per (request, KV head) in request-major
            order: list ``l = b * num_kv_heads + h`` holds what KV head ``h`` of request ``b`` reads.
            Every list is non-empty.
        kv_indices : torch.Tensor
            int32 CPU ``[nnz]``. Each entry is a page of ``page_size`` tokens: token ``j`` of a list is
            pool slot ``kv_indices[start + j // page_size] * page_size + j % page_size`` (slots index the
            pool flattened to ``[num_blocks * block_size, Hkv, D]``). With ``page_size = block_size``
            entries are block ids; with ``page_size = 1`` they are slot ids
            (``block * block_size + offset``), so a list can pick individual tokens in any order.
        kv_last_len : torch.Tensor
            int32 CPU ``[num_lists]``, tokens used in each list's last page, in ``[1, page_size]``
            (all ones when ``page_size = 1``). A list holds ``(pages - 1) * page_size + last_len`` tokens.
        num_qo_heads, num_kv_heads, head_dim, block_size : int
            Head layout (``num_qo_heads`` a multiple of ``num_kv_heads``; query head ``hq`` reads KV
            head ``hq // (num_qo_heads // num_kv_heads)``) and the pool's block size.
        sm_scale : float, optional
            Softmax scale; ``head_dim ** -0.5`` by default.
        head_sparse : bool
            One list per (request, KV head) instead of one per request.
        page_size : int, optional
            Tokens per ``kv_indices`` entry; a divisor of ``block_size`` (default ``block_size``).
        tail_index : torch.Tensor, optional
            int32 CPU ``[B]``, for ``run_quantized`` over KIVI (lists of whole blocks, dense or head-sparse):
            a list of request ``b`` whose last page is short of a block (``kv_last_len < block_size``) reads
            that page from ``kv.k_tail[tail_index[b]]`` / ``kv.v_tail[...]`` instead of its block (a
            head-sparse list must then end with the request's incomplete page). Staged into a fixed device
            buffer like the CSR, so a captured ``run_quantized`` replays it.
        window_left : int
            Sliding window (FlashInfer's convention): the query sits at its list's last token ``n - 1``
            and sees tokens ``n - 1 - window_left .. n - 1`` only; -1 (default) means no window. Token
            ``j`` of a list counts as position ``j``, so the window means positions for dense lists.
            The Triton kernel skips the pages wholly before the window. HF's ``sliding_window=W``
            is ``window_left = W - 1``. Not with ``run_quantized`` yet.

        Raises
        ------
        ValueError
            On a malformed layout, or one beyond the fixed capacities.
        """
        layout = check_decode_plan(
            kv_indptr,
            kv_indices,
            kv_last_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            sm_scale=sm_scale,
            head_sparse=head_sparse,
            page_size=page_size,
            window_left=window_left,
        )
        tail_index = check_tail_index(tail_index, layout.batch)
        if tail_index is not None and layout.page_size != block_size:
            raise ValueError("tail_index (KIVI) needs lists of whole blocks (page_size = block_size)")
        self._layout, self._plan, self._list_tiles, self._quantized_reference = layout, None, None, None
        self._tail_index = None if tail_index is None else tail_index.clone()
        self._partial_pages = layout.page_size == block_size and bool((kv_last_len < layout.page_size).any())
        # The reference paths read the host CSR at run; the Triton backend's buffers hold their own copy.
        self._csr = None if self.backend == "triton" else (kv_indptr.clone(), kv_indices.clone(), kv_last_len.clone())
        if self.backend == "triton":
            block_d = max(16, 1 << (head_dim - 1).bit_length())
            self._buffers.reserve_scratch(layout.batch, num_qo_heads, num_kv_heads, block_d)
            self._buffers.load(kv_indptr, kv_indices, kv_last_len, num_kv_heads, tail_index)
            self._num_splits = self._buffers.num_splits(layout.batch, num_kv_heads)
            self._plan = layout
        elif head_sparse or page_size not in (None, block_size):
            self._plan = build_list_plan(
                layout, kv_indptr, kv_indices, kv_last_len, self.max_tile_elements, self.device
            )
        else:
            self._plan = self._dense_reference_plan(layout)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        scores_out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        logits_out: torch.Tensor | None = None,
        merge_with: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decode attention for one layer, device-only (no host sync on the Triton backend).

        Parameters
        ----------
        q : torch.Tensor
            ``[B, num_qo_heads, head_dim]``, one query per request (rows may be strided).
        k_cache, v_cache : torch.Tensor
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), contiguous.
        out : torch.Tensor, optional
            Caller-owned buffer shaped like ``q``, in ``q``'s dtype.
        scores_out : torch.Tensor, optional
            float32, written in full. Dense plans: ``[num_kv_heads, kv_indptr[-1] * page_size]``; entry
            ``(h, kv_indptr[b] * page_size + j)`` is the sum over the query heads of KV group ``h`` of
            request ``b``'s softmax probability of its ``j``-th listed token (``j < kv_len_b``); the unused
            tail of each last page is 0. Head-sparse plans: ``[kv_indptr[-1] * page_size]``, entry
            ``kv_indptr[l] * page_size + j`` the same sum for token ``j`` of list ``l``. Under a CUDA graph,
            pass a column slice of a fixed ``[Hkv, capacity]`` buffer so address and row stride stay put.
        lse_out : torch.Tensor, optional
            float32 ``[B, num_qo_heads]``, written in full: each query head's natural-log softmax
            denominator ``log(sum_j exp(sm_scale * q . k_j))`` over its listed tokens, so that the output
            can be merged with attention over other tokens (``sparse_kernels.merge_states``).
        logits_out : torch.Tensor, optional
            float32 ``[B, num_qo_heads, W]`` (last dimension contiguous, ``W`` at least the longest list), for
            dense plans without a window: entry ``(b, h, j)`` becomes query head ``h``'s raw logit
            ``sm_scale * q . k_j`` of token ``j`` of request ``b``'s list; columns at or past the list's length
            are left as they were. With ``lse_out``, ``exp(logits_out - lse_out[..., None])`` are the
            attention probabilities: one read of K serves the output and a ranking of the tokens.
        merge_with : tuple of torch.Tensor, optional
            ``(out_x, lse_x)``: attention states of the same queries over other keys (disjoint from the listed
            ones), merged into the same softmax: float32 ``out_x`` ``[B, num_qo_heads, S, head_dim]`` (unit
            stride on the last dim), each of ``S`` states normalised over its own keys, and float32 ``lse_x``
            ``[B, num_qo_heads, S]`` (contiguous), their natural-log denominators (``-inf`` with a finite
            ``out_x`` for an empty state), as ``sparse_kernels.merge_states`` takes them (``S`` split states
            of one set, as a split kernel leaves them, merge as well as one). ``out`` (and ``lse_out``) are then
            over the union. The Triton backend merges them in its reduce launch. Not with ``scores_out``.

        Returns
        -------
        torch.Tensor
            ``out``: ``[B, num_qo_heads, head_dim]`` in ``q``'s dtype (softmax in float32).
        """
        plan = self._planned()
        layout = self._layout
        check_decode_run(layout, q, k_cache, v_cache, scores_out, lse_out)
        check_logits_out(layout, logits_out)
        _check_merge_with(layout, merge_with, scores_out)
        out = output_buffer(q, out)
        if self.backend == "triton":
            from sparse_kernels._triton.decode_launch import run_decode_triton

            bufs = self._buffers
            args = (q, k_cache, v_cache, out, scores_out, logits_out, merge_with)
            run_decode_triton(layout, bufs, self._num_splits, *args)
            self._natural_lse(lse_out)
            return out
        if merge_with is not None:  # the reference: the listed keys' state, then the plain merge
            from sparse_kernels.merge_states import merge_states, reduce_states

            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse_out is None else lse_out
            self.run(q, k_cache, v_cache, out=out, lse_out=lse, logits_out=logits_out)
            x_out, x_lse = reduce_states(*merge_with)
            out.copy_(merge_states(out.float(), lse, x_out, x_lse))
            if lse_out is not None:
                lse_out.copy_(torch.logaddexp(lse, x_lse))
            return out
        extra = (scores_out, lse_out, logits_out)
        if not isinstance(plan, PagedPlan):
            return run_list_decode(layout, plan, q, k_cache, v_cache, out, *extra)
        if extra == (None, None, None):
            return run_paged_attention(plan, q, k_cache, v_cache, out)
        if self._list_tiles is None:
            self._list_tiles = build_list_plan(layout, *self._csr, self.max_tile_elements, self.device)
        return run_list_decode(layout, self._list_tiles, q, k_cache, v_cache, out, *extra)

    def _natural_lse(self, lse_out: torch.Tensor | None) -> None:
        """Triton backend: ``lse_out`` from the reduce's log-sum-exps, which are base 2 (of
        ``sm_scale * log2(e) * q . k``)."""
        if lse_out is not None:
            rows = self._layout.batch * self._layout.num_qo_heads
            torch.mul(self._buffers.lse[:rows].view(lse_out.shape), math.log(2.0), out=lse_out)

    def run_quantized(
        self,
        q: torch.Tensor,
        kv: QuantizedKV,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention for one layer over quantized paged KV (device-only on the Triton backend).

        Parameters
        ----------
        q : torch.Tensor
            ``[B, num_qo_heads, head_dim]`` (rows may be strided), in the original (unrotated) space.
        kv : QuantizedKV
            The layer's codes and scales (``block_size``, ``num_kv_heads``, ``head_dim`` as planned). fp8
            and TurboQuant take every kind of plan; KIVI lists of whole blocks only, with ``tail_index`` planned
            when a request's last page is incomplete. TurboQuant's query is rotated by ``kv.rotation`` and
            the output rotated back (two small matmuls in ``q``'s dtype, graph-safe).
        out : torch.Tensor, optional
            Caller-owned buffer shaped like ``q``, in ``q``'s dtype.
        lse_out, logits_out : torch.Tensor, optional
            As in ``run`` (logits over the dequantized keys; per-token schemes, fp8 and TurboQuant, only).

        Returns
        -------
        torch.Tensor
            ``out``: ``[B, num_qo_heads, head_dim]`` in ``q``'s dtype (softmax in float32).
        """
        self._planned()
        layout = self._layout
        if layout.window_left >= 0:
            raise NotImplementedError("run_quantized does not apply a sliding window (window_left) yet")
        check_quantized_kv(
            kv,
            block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            whole_pages=layout.page_size == layout.block_size,
            partial_pages=self._partial_pages,
            tail_index=self._tail_index,
            device=self.device,
        )
        expected = (layout.batch, layout.num_qo_heads, layout.head_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q must be {list(expected)} as planned, got {list(q.shape)}")
        check_lse_out(layout, lse_out)
        check_logits_out(layout, logits_out)
        if logits_out is not None and kv.scheme == "kivi":
            raise ValueError("logits_out over a KIVI store is not built (fp8 and TurboQuant write it)")
        out = output_buffer(q, out)
        if self.backend != "triton":
            return self._run_quantized_reference(q, kv, out, lse_out=lse_out, logits_out=logits_out)
        from sparse_kernels._triton.quantized_decode_launch import run_quantized_decode_triton

        if kv.rotation is None:
            run_quantized_decode_triton(layout, self._buffers, q, kv, out, logits_out)
        else:
            rotated = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            run_quantized_decode_triton(layout, self._buffers, rotate(q, kv), kv, rotated, logits_out)
            rotate(rotated, kv, back=True, out=out)
        self._natural_lse(lse_out)
        return out

    def _run_quantized_reference(self, q: torch.Tensor, kv: QuantizedKV, out: torch.Tensor, **outs) -> torch.Tensor:
        layout = self._layout
        kv_indptr, _, kv_last_len = self._csr

        def plan_inner(kv_indices: torch.Tensor) -> BatchDecodeWithPagedKVCache:
            inner = BatchDecodeWithPagedKVCache(
                self.device, backend="reference", max_tile_elements=self.max_tile_elements
            )
            inner.plan(
                kv_indptr,
                kv_indices,
                kv_last_len,
                num_qo_heads=layout.num_qo_heads,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                block_size=layout.block_size,
                sm_scale=layout.sm_scale,
                head_sparse=layout.head_sparse,
                page_size=layout.page_size,
            )
            return inner

        tails = self._tail_index if kv.has_tail else None
        self._quantized_reference = run_dequantized(
            self._quantized_reference, kv, q, out, self._csr, tails,
            block_size=layout.block_size, page_size=layout.page_size, device=self.device, plan_inner=plan_inner,
            lists_per_request=layout.num_kv_heads if layout.head_sparse else 1, **outs,
        )  # fmt: skip
        return out

    def planned_kv_indices(self) -> torch.Tensor:
        """Triton backend: the device buffer of this plan's ``kv_indices`` (its first ``nnz`` entries).

        ``run`` reads it at launch, so a caller may rewrite entries in place between ``plan`` and
        ``run`` (for example pages chosen on the device per layer) as long as the lists keep their
        lengths and ``kv_last_len`` stays right. The reference backend copies indices at ``plan``, so
        it has no such buffer.
        """
        if self.backend != "triton" or self._layout is None:
            raise RuntimeError("planned_kv_indices needs a plan on the Triton backend")
        return self._buffers.indices

    def _dense_reference_plan(self, layout: DecodeLayout) -> PagedPlan:
        kv_indptr, kv_indices, kv_last_len = self._csr
        num_blocks = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
        kv_lens = (num_blocks - 1) * layout.block_size + kv_last_len.to(torch.int64)
        return build_plan(
            torch.arange(layout.batch + 1, dtype=torch.int32),
            kv_indptr,
            kv_indices,
            num_blocks,
            kv_lens,
            num_qo_heads=layout.num_qo_heads,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            causal=True,  # the one query is at the last position, so causal == full
            sm_scale=layout.sm_scale,
            max_tile_elements=self.max_tile_elements,
            device=self.device,
            window_left=layout.window_left,
        )


def _check_merge_with(layout, merge_with, scores_out) -> None:
    if merge_with is None:
        return
    x_out, x_lse = merge_with
    b, h, d = layout.batch, layout.num_qo_heads, layout.head_dim
    if x_out.dim() != 4 or tuple(x_out.shape[:2]) != (b, h) or x_out.shape[3] != d:
        raise ValueError(f"merge_with's out must be [{b}, {h}, S, {d}], got {list(x_out.shape)}")
    if tuple(x_lse.shape) != tuple(x_out.shape[:3]) or x_out.shape[2] < 1:
        raise ValueError(f"merge_with's lse must be [{b}, {h}, S >= 1] like its out, got {list(x_lse.shape)}")
    if x_out.dtype != torch.float32 or x_lse.dtype != torch.float32 or x_out.device != x_lse.device:
        raise ValueError("merge_with's states must be float32, on one device")
    if x_out.stride(3) != 1 or not x_lse.is_contiguous():
        raise ValueError("merge_with's out needs unit stride on head_dim and its lse must be contiguous")
    if scores_out is not None:
        raise ValueError("scores_out and merge_with do not go together (the scores are over the listed keys)")
