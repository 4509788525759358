"""Batched prefill attention over a paged KV cache with a cached prefix (plan/run; Triton + reference)."""

from __future__ import annotations

import torch

from sparse_kernels import prefix_attention
from sparse_kernels._backend import host_to_device
from sparse_kernels._paged_plan import build_plan
from sparse_kernels._paged_run import check_run_inputs, run_paged_attention
from sparse_kernels._paged_validate import (
    check_heads,
    check_indptr,
    check_paged_kv,
    check_qo_fits,
    check_sm_scale,
    check_window_left,
)
from sparse_kernels._paged_wrapper import PagedAttentionWrapper, output_buffer
from sparse_kernels._quantized_run import check_quantized_kv, check_tail_index, rotate, run_dequantized
from sparse_kernels.merge_states import merge_states_
from sparse_kernels.prefix_attention import attention_with_lse, prefix_pages, squares, use_split
from sparse_kernels.quantized_kv import QuantizedKV


class BatchPrefillWithPagedKVCache(PagedAttentionWrapper):
    """Prefill (or any multi-query step) attention for a batch of requests over paged K/V.

    Request ``b``'s queries are the last ``qo_len_b`` tokens of its ``kv_len_b``-token sequence (their
    K/V are already stored). Query ``i`` of request ``b`` sits at position ``kv_len_b - qo_len_b + i``
    and, when causal, attends to KV positions ``j <= kv_len_b - qo_len_b + i``.

    ``plan`` runs once per step on the host (not graph-captured); ``run`` runs once per layer on the
    device with no host sync, reading only tensors ``plan`` built. Construction arguments are those of
    ``PagedAttentionWrapper`` (``device``, ``backend``, ``max_tile_elements``).

    Quantized KV (fp8, KIVI, TurboQuant): ``run_quantized(q, kv)`` over the same plan reads the history
    as codes and scales, dequantized tile by tile in registers (no dense copy of the history); the
    reference dequantizes the listed blocks (KIVI: plus tails) and runs the plain reference.

    ``cascade=False``: every request in the paged kernel's launch, none split (``prefix_attention``). The
    split runs a fused call or two per request, each with its own host cost (~0.28 ms on the H200): worth it
    for a few long requests, not for a plan of many narrow rows, such as a head-major store's (request, KV
    head) lanes (a 32K prefill over such a store with replay passes made 11,520 of those calls).
    """

    def __init__(self, device: torch.device | str = "cpu", *, cascade: bool = True, **kwargs):
        super().__init__(device, **kwargs)
        self.cascade = cascade

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
        tail_index: torch.Tensor | None = None,
        window_left: int = -1,
    ) -> None:
        """Validate the step's layout and build the device index tensors ``run`` will use.

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 CPU ``[B + 1]``; request ``b``'s queries are rows ``qo_indptr[b]:qo_indptr[b+1]``
            of ``q`` (at least one each).
        kv_indptr : torch.Tensor
            int32 CPU ``[B + 1]``; request ``b``'s blocks are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
            (at least one each).
        kv_indices : torch.Tensor
            int32 CPU ``[nnz]``, pool block ids in sequence order.
        kv_last_len : torch.Tensor
            int32 CPU ``[B]``, tokens used in each request's last block, in ``[1, block_size]``.
        num_qo_heads, num_kv_heads, head_dim, block_size : int
            Head layout (``num_qo_heads`` a multiple of ``num_kv_heads``) and pool block size.
        causal : bool
            Causal mask aligned to the end of each sequence; if False, every query sees all its KV.
        sm_scale : float, optional
            Softmax scale; ``head_dim ** -0.5`` by default.
        tail_index : torch.Tensor, optional
            int32 CPU ``[B]``, for ``run_quantized`` over KIVI: request ``b``'s tokens at or past
            ``(kv_len_b // block_size) * block_size`` (its incomplete last page) are read from tail row
            ``tail_index[b]`` of ``kv.k_tail`` / ``kv.v_tail``.
        window_left : int
            Sliding window (FlashInfer's convention): a query at position ``p`` sees keys
            ``max(0, p - window_left) .. p`` only; -1 (default) means no window. HF's
            ``sliding_window=W`` is ``window_left = W - 1``. Not with ``run_quantized`` yet.

        Raises
        ------
        ValueError
            On a malformed layout: wrong dtype/device/shape, non-monotone or non-zero-based indptr,
            a request without queries or blocks, indivisible heads, ``kv_last_len`` out of range, or
            ``qo_len > kv_len``.
        """
        check_heads(num_qo_heads, num_kv_heads, head_dim, block_size)
        qo_lens = check_indptr("qo_indptr", qo_indptr, "query token")
        num_blocks, kv_lens = check_paged_kv(kv_indptr, kv_indices, kv_last_len, block_size)
        check_qo_fits(qo_lens, kv_lens)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        self._window_left = check_window_left(window_left)
        tail_index = check_tail_index(tail_index, qo_lens.numel())
        self._csr = (qo_indptr.clone(), kv_indptr.clone(), kv_indices.clone(), kv_last_len.clone())
        self._tail_index = None if tail_index is None else tail_index.clone()
        self._tail_device = None if tail_index is None else host_to_device(tail_index, self.device)
        self._partial_pages = bool((kv_last_len < block_size).any())
        self._quantized_reference = None
        self._causal = causal
        self._split = None
        if self.backend == "triton":
            layout = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
            layout.update(block_size=block_size, causal=causal, sm_scale=sm_scale, window_left=window_left)
            self._plan = self._triton_plan(qo_lens, qo_indptr, kv_indptr, kv_indices, kv_last_len, layout)
            splittable = self.device.type == "cuda" or prefix_attention.SPLIT_WITHOUT_FUSED
            if self.cascade and causal and window_left < 0 and tail_index is None and splittable:
                self._split = self._plan_split(qo_lens, kv_lens, qo_indptr, kv_indptr, kv_indices, kv_last_len, layout)
            return
        self._plan = build_plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            num_blocks,
            kv_lens,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            causal=causal,
            sm_scale=sm_scale,
            max_tile_elements=self.max_tile_elements,
            device=self.device,
            window_left=window_left,
        )

    def _triton_plan(self, qo_lens, qo_indptr, kv_indptr, kv_indices, kv_last_len, layout: dict):
        from sparse_kernels._triton.prefill import TritonPrefillPlan, query_tiles, tile_queries

        queries = tile_queries(layout["num_qo_heads"], layout["num_kv_heads"])
        tile_req, tile_row = query_tiles(qo_lens, queries)
        tensors = (tile_req, tile_row, qo_indptr, kv_indptr, kv_indices, kv_last_len)
        dev = [host_to_device(t, self.device) for t in tensors]
        return TritonPrefillPlan(*dev, num_qo_tokens=int(qo_indptr[-1]), tile_queries=queries, **layout)

    def _plan_split(self, qo_lens, kv_lens, qo_indptr, kv_indptr, kv_indices, kv_last_len, layout: dict):
        """The cascade split (``prefix_attention``): requests with a long cached prefix read its whole
        pages by the fused dense attention, requests whose remaining keys are their chunk's own square
        (``squares``) run that square fused too, and only the rest goes through the paged kernel."""
        pages = prefix_pages(qo_lens, kv_lens, layout["block_size"])
        square = squares(qo_lens, kv_lens, pages, layout["block_size"])
        if not bool(pages.any() or square.any()):
            return None
        starts = kv_indptr[:-1].long()
        counts = kv_indptr.diff().long() - pages
        firsts, ends = (starts + pages).tolist(), kv_indptr[1:].tolist()
        keep = torch.cat([torch.arange(lo, hi) for lo, hi in zip(firsts, ends, strict=True)])
        rest_indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)]).to(torch.int32)
        # A square's request keeps no query tile in the paged kernel's plan (none at all: no launch).
        rest_qo = torch.where(square, torch.zeros_like(qo_lens), qo_lens)
        rest = None
        if bool(rest_qo.any()):
            rest = self._triton_plan(rest_qo, qo_indptr, rest_indptr, kv_indices[keep], kv_last_len, layout)
        requests = []
        for b in torch.nonzero(pages.bool() | square).flatten().tolist():
            start, n = int(starts[b]), int(pages[b])
            prefix = _page_run(kv_indices, start, n) if n else None
            own = _page_run(kv_indices, start + n, int(counts[b])) if bool(square[b]) else None
            requests.append((int(qo_indptr[b]), int(qo_indptr[b + 1]), prefix, own))
        return rest, requests

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one layer, device-only (no host sync; graph-capturable for a fixed plan).

        Parameters
        ----------
        q : torch.Tensor
            ``[T, num_qo_heads, head_dim]``, the planned query rows in ``qo_indptr`` order.
        k_cache, v_cache : torch.Tensor
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), contiguous.
        out : torch.Tensor, optional
            Caller-owned buffer shaped like ``q``, in ``q``'s dtype (a row slice of a larger buffer is fine).

        Returns
        -------
        torch.Tensor
            ``out``: shaped like ``q``, in ``q``'s dtype (softmax in float32).
        """
        plan = self._planned()
        if self.backend != "triton":
            return run_paged_attention(plan, q, k_cache, v_cache, out)
        from sparse_kernels._triton.prefill import run_prefill_triton

        check_run_inputs(plan, q, k_cache, v_cache)
        out = output_buffer(q, out)
        if self._split is None or not use_split(q):
            return run_prefill_triton(plan, q, k_cache, v_cache, out)
        rest, requests = self._split
        lse = None
        if rest is not None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            run_prefill_triton(rest, q, k_cache, v_cache, out, lse=lse)
        for lo, hi, prefix, own in requests:
            if own is not None:
                k, v = _pages_of(plan, k_cache, v_cache, own)
                own_out, own_lse = attention_with_lse(q[lo:hi], k, v, plan.sm_scale, causal=True)
                if prefix is None:
                    out[lo:hi].copy_(own_out)
                    continue
            k, v = _pages_of(plan, k_cache, v_cache, prefix)
            prefix_out, prefix_lse = attention_with_lse(q[lo:hi], k, v, plan.sm_scale)
            if own is not None:
                merge_states_(own_out, own_lse, prefix_out, prefix_lse, out=out[lo:hi])
            else:
                merge_states_(out[lo:hi], lse[lo:hi], prefix_out, prefix_lse)
        return out

    def run_quantized(self, q: torch.Tensor, kv: QuantizedKV, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for one layer over quantized paged KV (device-only; graph-capturable for a fixed plan).

        Parameters
        ----------
        q : torch.Tensor
            ``[T, num_qo_heads, head_dim]``, the planned query rows, in the original (unrotated) space.
        kv : QuantizedKV
            The layer's codes and scales, with the chunk's own tokens already stored (KIVI: the
            request's incomplete page in its tail row, ``tail_index`` planned). TurboQuant's queries are
            rotated by ``kv.rotation`` and the output rotated back.
        out : torch.Tensor, optional
            Caller-owned buffer shaped like ``q``, in ``q``'s dtype.

        Returns
        -------
        torch.Tensor
            ``out``: shaped like ``q``, in ``q``'s dtype (softmax in float32).
        """
        plan = self._planned()
        if self._window_left >= 0:
            raise NotImplementedError("run_quantized does not apply a sliding window (window_left) yet")
        check_quantized_kv(
            kv,
            block_size=plan.block_size,
            num_kv_heads=plan.num_kv_heads,
            head_dim=plan.head_dim,
            whole_pages=True,
            partial_pages=self._partial_pages,
            tail_index=self._tail_index,
            device=self.device,
        )
        expected = (plan.num_qo_tokens, plan.num_qo_heads, plan.head_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q must be {list(expected)} as planned, got {list(q.shape)}")
        out = output_buffer(q, out)
        if self.backend != "triton":
            return self._run_quantized_reference(q, kv, out)
        from sparse_kernels._triton.quantized_prefill import run_quantized_prefill_triton

        tails = self._tail_device if kv.has_tail else None
        if kv.rotation is None:
            return run_quantized_prefill_triton(plan, tails, q, kv, out)
        rotated = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        run_quantized_prefill_triton(plan, tails, rotate(q, kv), kv, rotated)
        return rotate(rotated, kv, back=True, out=out)

    def _run_quantized_reference(self, q: torch.Tensor, kv: QuantizedKV, out: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        qo_indptr, kv_indptr, kv_indices, kv_last_len = self._csr

        def plan_inner(pool_indices: torch.Tensor) -> BatchPrefillWithPagedKVCache:
            inner = BatchPrefillWithPagedKVCache(
                self.device, backend="reference", max_tile_elements=self.max_tile_elements
            )
            inner.plan(
                qo_indptr,
                kv_indptr,
                pool_indices,
                kv_last_len,
                num_qo_heads=plan.num_qo_heads,
                num_kv_heads=plan.num_kv_heads,
                head_dim=plan.head_dim,
                block_size=plan.block_size,
                causal=self._causal,
                sm_scale=plan.sm_scale,
            )
            return inner

        tails = self._tail_index if kv.has_tail else None
        self._quantized_reference = run_dequantized(
            self._quantized_reference, kv, q, out, (kv_indptr, kv_indices, kv_last_len), tails,
            block_size=plan.block_size, page_size=plan.block_size, device=self.device, plan_inner=plan_inner,
        )  # fmt: skip
        return out


def _page_run(kv_indices: torch.Tensor, start: int, n: int) -> tuple[int, int, int]:
    """``(start, n, run)`` of ``n`` pages listed from ``kv_indices[start]``: ``run`` is the first pool block when they
    are one ascending run of blocks (a fresh pool hands them out so; read in place, not gathered), else -1."""
    ids = kv_indices[start : start + n]
    return start, n, int(ids[0]) if n == 1 or bool((ids.diff() == 1).all()) else -1


def _pages_of(plan, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: tuple[int, int, int]):
    """Keys and values ``[n * block_size, Hkv, D]`` of a ``_page_run``: a view of the pool, or a gather."""
    start, n, run = pages
    if run >= 0:
        k, v = k_cache[run : run + n], v_cache[run : run + n]
    else:
        blocks = plan.kv_indices[start : start + n].long()
        k, v = k_cache[blocks], v_cache[blocks]
    _, _, num_kv_heads, head_dim = k_cache.shape
    return k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
