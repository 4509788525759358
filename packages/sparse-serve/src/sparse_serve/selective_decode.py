"""Decode that reads only what a query-aware method selects, per (request, KV head), picked on the device.

Layers that select (``LayerPlan.decode``: ``SELECTED`` / ``OBSERVED``) go through one batched path for
every decode step, on any device and kernel backend: the list structure is planned once per step
(lengths are known from ``selection_size``) and, per layer, what the method picks on the device
(``select_decode`` over a ``DecodeBatch`` that reads the step's block tables in place: pages, or single
slots) is written straight into the Triton kernel's index buffer: no host sync inside the forward (the
reference kernels, which copy their indices at ``plan``, are planned again with the picked entries). The
answers become one head-sparse CSR (one list per request and KV head, the newest entry last), so the bytes
a step reads scale with the budget rather than the context. When every row selects the same number of
entries (``uniform``) everything the forward reads lives in fixed buffers, so the step can be captured
and replayed as a CUDA graph (``graph_key``); rows past the step's requests (a graph's padding) select
too, on their one-token table, and their outputs are dropped. Rows that read different numbers of
entries (or everything) in one step are planned row by row and run eagerly.

A method may answer a ``DecodeSelection`` whose ``extra`` is an attention state over keys its entries leave
out (e.g. a cluster index's estimated clusters): the two states merge into one softmax, on the device. Partial
states (a split kernel's, ``AttentionState.partial``) over every row go to the decode's own reduce
(``run(merge_with=...)``); otherwise the decode also writes each query head's log-sum-exp (into a fixed buffer)
and ``merge_states`` merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, merge_states, merge_states_, paged_logits, rotate_quantized
from sparse_kernels.logits_attention import logits_attention, logits_lse
from sparse_kernels.selection_entries import selection_entries
from sparse_methods import AttentionState, DecodeBatch, DecodeRead, DecodeSelection, SparseMethod
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata

WIDTH_QUANTUM = 256  # static table width (pages) rounds up to this, so a graph serves many steps


@dataclass(frozen=True, slots=True)
class _BatchedStep:
    """One step's batched plan (device tensors are views of fixed buffers when ``rows`` is None)."""

    rows: torch.Tensor | None  # int64 [n] decode rows that select, None: all of them (uniform)
    positions: torch.Tensor | None  # int64 index-buffer slots to fill, None: the first n * Hkv * size
    take: torch.Tensor | None  # int64: which picked entries fill ``positions`` (rows narrower than size), None: all
    starts: torch.Tensor  # int64 [n]: each selecting row's first entry in the table buffer
    kv_lens: torch.Tensor  # int64 [n]
    num_pages: torch.Tensor  # int64 [n]: ceil(kv_lens / block_size)
    size: int  # entries each (row, KV head) list reads
    unit: int  # slots per entry (block size, or 1)
    max_pages: int  # static table width


class SelectiveDecode:
    def __init__(
        self,
        device: torch.device,
        shape: dict,
        sm_scale: float,
        backend: str = "auto",
        *,
        max_batch_size: int | None = None,
        max_num_pages: int | None = None,
        list_decode=None,
    ):
        """``list_decode(max_num_pages)``: the batched path's decode wrapper (default the paged
        ``BatchDecodeWithPagedKVCache`` with head-sparse lists; a latent store hands its own, whose
        ``plan`` / ``run`` / ``planned_kv_indices`` / ``backend`` follow the same interface)."""
        self.backend = backend
        self._list_decode = list_decode or self._paged_lists
        self.device = device
        self.shape = shape
        self.sm_scale = sm_scale
        self.max_batch_size = max_batch_size
        self.max_num_pages = max_num_pages  # of the step's dense tables (the table buffer's capacity)
        self.max_list_pages = 0  # longest (request, KV head) list so far, in its page size
        self.num_selections = 0  # decode queries whose method chose a subset (not None)

        self._fast: dict[int, tuple[BatchDecodeWithPagedKVCache, int]] = {}  # unit -> (wrapper, entry capacity)
        self._table = torch.zeros(max_num_pages or 0, dtype=torch.int32, device=device)
        self._rows = torch.zeros(3 * (max_batch_size or 0), dtype=torch.int64, device=device)
        self._lse = torch.zeros(0, dtype=torch.float32, device=device)  # the decode's lse (merges, observed layers)
        self._batched: _BatchedStep | None = None  # this step's batched plan, or None (no row selects)
        self._planned: tuple | None = None  # the last uniform plan: (wrapper, kv_indptr, kv_last_len)
        self._host_plan: tuple | None = None  # this step's (kv_indptr, kv_indices, kv_last_len) on the host
        self.reads_all = False  # this step's decode rows all read everything: selecting layers run dense

    def plan_step(
        self,
        method: SparseMethod,
        meta: StepMetadata,
        group: LayerGroupMetadata,
        table: torch.Tensor | None = None,
        tail_index: torch.Tensor | None = None,
    ) -> None:
        """Plan the batched path for this step's decode rows (when the group's layers select on the device).

        ``table``: the group's ``decode_kv_indices`` already on the device (the dense decode plan's
        buffer, at a fixed address), read in place instead of copied again. ``tail_index``: int32 host
        ``[decode rows]``, each row's tail row (a KIVI store: a list ending in its request's incomplete
        page reads that page from the tail)."""
        self.reset()
        nd = meta.num_decode_tokens
        unit = self.device_unit(method, group.layers)
        if not nd or unit is None:
            return
        bs, num_kv_heads = self.shape["block_size"], self.shape["num_kv_heads"]
        size, uniform = self.uniform_size(method, meta, group)
        if size is None:
            self.reads_all = True  # every row reads everything: the dense plan serves them
            return
        real = min(nd, len(meta.steps))  # rows past the requests are a CUDA graph's padding
        kv_lens = [group.kv_lens[i] + 1 for i in range(nd)]
        sizes = [method.selection_size(n, unit) if i < real else size for i, n in enumerate(kv_lens)]
        indptr_h = group.decode_kv_indptr.to(torch.int64)
        indices_h = group.decode_kv_indices
        starts_h = indptr_h[:-1]
        last_entry = indices_h[indptr_h[1:] - 1].to(torch.int64)  # each row's newest block
        tails = torch.tensor(kv_lens, dtype=torch.int64) - (indptr_h[1:] - starts_h - 1) * bs
        rows = [i for i in range(nd) if sizes[i] is not None]
        row_of = {i: r for r, i in enumerate(rows)}
        if uniform:
            kv_indices = None  # placeholders (written per layer on the device), built if the plan changes
            kv_indptr = torch.arange(nd * num_kv_heads + 1, dtype=torch.int32) * size
            last = tails if unit == bs else torch.ones(nd, dtype=torch.int64)
            kv_last_len = last.repeat_interleave(num_kv_heads).to(torch.int32)
            positions = take = None
        else:  # some rows read everything (all their blocks, or slots), the others their selected entries
            indptr, indices, last_len, pos, take = [0], [], [], [], []
            for i in range(nd):
                blocks = indices_h[int(starts_h[i]) : int(indptr_h[i + 1])].tolist()
                every = blocks if unit == bs else [b * bs + o for b in blocks for o in range(bs)][: kv_lens[i]]
                for h in range(num_kv_heads):
                    if sizes[i] is None:
                        indices.extend(every)
                    else:  # the row's own width: the method's entries past it are not read
                        pos.extend(range(len(indices), len(indices) + sizes[i]))
                        first = (row_of[i] * num_kv_heads + h) * size
                        take.extend(range(first, first + sizes[i]))
                        indices.extend([every[-1]] * sizes[i])  # placeholders, written per layer on the device
                    indptr.append(len(indices))
                    last_len.append(int(tails[i]) if unit == bs else 1)
            kv_indptr = torch.tensor(indptr, dtype=torch.int32)
            kv_indices = torch.tensor(indices, dtype=torch.int32)
            kv_last_len = torch.tensor(last_len, dtype=torch.int32)
            positions = torch.tensor(pos, dtype=torch.int64, device=self.device)
            take = (
                torch.tensor(take, dtype=torch.int64, device=self.device)
                if len(take) < len(rows) * num_kv_heads * size
                else None
            )
        lists = (self.max_batch_size or nd) * num_kv_heads
        entries = int(kv_indptr[-1])
        wrapper = self._fast_wrapper(unit, entries, lists * size if uniform else entries)
        planned = self._planned
        same = (
            uniform
            and planned is not None
            and planned[0] is wrapper
            and torch.equal(planned[1], kv_indptr)
            and torch.equal(planned[2], kv_last_len)
            and (planned[3] is None) == (tail_index is None)
            and (tail_index is None or torch.equal(planned[3], tail_index))
        )
        if kv_indices is None and (not same or wrapper.backend != "triton"):
            placeholder = last_entry if unit == bs else last_entry * bs + tails - 1
            kv_indices = placeholder.repeat_interleave(num_kv_heads * size).to(torch.int32)
        tails = {} if tail_index is None else {"tail_index": tail_index}
        self._host_plan = (kv_indptr, kv_indices, kv_last_len, tails)  # the reference kernels plan again per layer
        if not same:  # a uniform plan whose lists, last lengths and tail rows did not change is still in place
            wrapper.plan(
                kv_indptr,
                kv_indices,
                kv_last_len,
                head_sparse=True,
                page_size=unit,
                sm_scale=self.sm_scale,
                **self.shape,
                **tails,
            )
            self._planned = (wrapper, kv_indptr, kv_last_len, tail_index) if uniform else None
        n = len(rows)
        idx = torch.tensor(rows, dtype=torch.int64)
        row_lens = torch.tensor(kv_lens, dtype=torch.int64)[idx]
        per_row = torch.cat([starts_h[idx], row_lens, (row_lens + bs - 1) // bs])
        if table is not None and table.device == self.device and table.numel() >= indices_h.numel():
            self._table = table
        else:
            self._load_table(indices_h)
        self._rows = _fit(self._rows, 3 * n, self.max_batch_size and 3 * self.max_batch_size)
        _copy_in(self._rows, per_row)
        max_pages = int((indptr_h[1:] - starts_h)[idx].max())
        self._batched = _BatchedStep(
            rows=None if uniform else idx.to(self.device),
            positions=positions,
            take=take,
            starts=self._rows[:n],
            kv_lens=self._rows[n : 2 * n],
            num_pages=self._rows[2 * n : 3 * n],
            size=size,
            unit=unit,
            max_pages=-(-max_pages // WIDTH_QUANTUM) * WIDTH_QUANTUM,
        )
        self.max_list_pages = max(self.max_list_pages, size)

    def uniform_size(
        self, method: SparseMethod, meta: StepMetadata, group: LayerGroupMetadata
    ) -> tuple[int | None, bool]:
        """``(size, uniform)`` of a step's decode requests: the entries the selecting rows read (None
        when no row selects) and whether every request selects alike (all ``size``, or all None)."""
        nd = min(meta.num_decode_tokens, len(meta.steps))
        unit = self.device_unit(method, group.layers)
        sizes = {method.selection_size(group.kv_lens[i] + 1, unit) for i in range(nd)}
        chosen = {s for s in sizes if s is not None}
        return (max(chosen) if chosen else None), len(sizes) == 1

    def device_unit(self, method: SparseMethod, layers) -> int | None:
        """Slots per entry of what ``layers`` select on the device this step, None when none of them does."""
        plans = [method.layer_plan(layer) for layer in layers]
        units = {plan.unit_slots(self.shape["block_size"]) for plan in plans if plan.selects_decode}
        if not units:
            return None
        if len(units) > 1:
            raise ValueError(f"{method.name}: the layers selecting on the device must share one unit")
        return units.pop()

    def reset(self) -> None:
        """No batched plan this step."""
        self._batched, self.reads_all = None, False

    @property
    def batched(self) -> bool:
        return self._batched is not None

    def graph_key(self) -> tuple | None:
        """What a CUDA graph of this step's selecting layers depends on beyond its batch size (None:
        the step is not a uniform batched one). Buffers that moved give another key."""
        st = self._batched
        if st is None or st.rows is not None:
            return None
        wrapper = self._fast[st.unit][0]
        fixed = (self._table, self._rows, self._lse_buffer(len(st.kv_lens)))
        buffers = (id(wrapper), *(t.data_ptr() for t in fixed))
        return (st.size, st.unit, st.max_pages, *buffers)

    def run_batched(
        self,
        method,
        layer,
        q,
        k_cache,
        v_cache,
        kmin,
        kmax,
        out,
        dense=None,
        select_q=None,
        kv=None,
        kscale=None,
        levels=0,
    ) -> torch.Tensor:
        """The batched path for one layer: pick on the device, write into the plan, attend.

        An ``OBSERVED`` layer reads everything through ``dense`` (the step's dense decode plan), whose decode
        also writes every row's logits and log-sum-exp for the method (one read of K); without ``dense`` (a
        latent store) the logits are read through the tables and the output from them. ``select_q``: the
        queries the method sees, when not ``q`` (tensor parallelism: its KV groups' query heads).
        ``kv``: a quantized store's layer (``k_cache`` / ``v_cache`` None): the selected entries are read
        from its codes. Selections from page summaries run over it, and ``OBSERVED`` layers over fp8 and
        TurboQuant (their logits and attention read the codes); nothing that reads keys otherwise or merges
        extra state (the
        engine refuses those at start-up, ``model_runner._check_method_over_store``). ``kscale``:
        the summaries' scales when ``kmin`` / ``kmax`` are int8 codes; ``levels`` > 0: ``kmin`` / ``kmax`` are
        a KIVI store's per-channel key minimum and step (``DecodeBatch.page_levels``)."""
        select_q = q if select_q is None else select_q
        st = self._batched
        bs, num_kv_heads = self.shape["block_size"], self.shape["num_kv_heads"]
        plan = method.layer_plan(layer)
        observed = plan.decode is DecodeRead.OBSERVED
        logits = logit_lse = None
        if observed and dense is not None:  # attention and every row's logits from one read of K (and V)
            logits, logit_lse = self._attend_observing(q, k_cache, v_cache, out, dense, kv, st)
        elif observed:  # the selecting rows' logits (a latent store: attention from them below)
            rows_q = q if st.rows is None else q[st.rows]
            logits, logit_lse = self._logits(rows_q, k_cache, st, kv)
        batch = DecodeBatch(
            query=select_q if st.rows is None else select_q[st.rows],
            kv_lens=st.kv_lens,
            table_indices=self._table,
            table_start=st.starts,
            max_pages=st.max_pages,
            block_size=bs,
            page_min=kmin,
            page_max=kmax,
            page_scale=kscale,
            page_levels=levels,
            key_cache=k_cache if plan.decode_keys else None,
            sm_scale=self.sm_scale,
            page_counts=st.num_pages,
            logits=logits,
            logit_lse=logit_lse,
        )
        chosen = method.select_decode(layer, batch)  # [n, Hkv, size] entries in table order; None if observed
        extra = None
        if isinstance(chosen, DecodeSelection):
            chosen, extra = chosen.entries, chosen.extra
        if observed:
            if chosen is not None:
                raise RuntimeError(f"{method.name} selected at an observed layer {layer}")
            if dense is not None:  # written with the logits
                return out
            if st.rows is not None:
                raise RuntimeError("an observed layer without a dense plan needs every decode row selecting")
            # K was read once, for the logits; the output reads V only (TurboQuant: in the rotated space).
            if kv is None:
                args = (v_cache, *self._rows_of(st), out)
                return logits_attention(logits, logit_lse, *args, backend=self.backend)
            into = out if kv.rotation is None else torch.empty_like(out)
            args = (kv.v, *self._rows_of(st), into)
            codes = dict(v_scale=kv.v_scale, codebook=kv.codebook)
            logits_attention(logits, logit_lse, *args, **codes, backend=self.backend)
            return out if kv.rotation is None else rotate_quantized(into, kv, back=True, out=out)
        n = chosen.shape[0]
        wrapper = self._fast[st.unit][0]
        # Block ids (unit = block) or slot ids (unit = 1), through the tables, in one launch; entries
        # past a row (padding rows) read its last block / slot.
        in_place = wrapper.backend == "triton"
        if st.positions is None and in_place:  # straight into the plan's index list
            ids = wrapper.planned_kv_indices()[: n * num_kv_heads * st.size].view(n, num_kv_heads, st.size)
        else:
            ids = torch.empty(n, num_kv_heads, st.size, dtype=torch.int32, device=q.device)
        selection_entries(
            chosen, self._table, st.starts, st.kv_lens, ids, block_size=bs, page_size=st.unit, backend=self.backend
        )
        if not in_place:
            self._replan(wrapper, ids, st)
        elif st.positions is not None:
            wrapper.planned_kv_indices()[st.positions] = ids.view(-1) if st.take is None else ids.view(-1)[st.take]
        self.num_selections += n
        if kv is not None:
            if extra is not None:
                raise ValueError(f"{method.name} merges an extra attention state; not over a {kv.scheme} store")
            return wrapper.run_quantized(q, kv, out=out)
        if extra is None:
            return wrapper.run(q, k_cache, v_cache, out=out)
        if extra.partial and st.rows is None and extra.out.shape[:2] == q.shape[:2]:
            # Every row selects, with this rank's query heads: the decode's reduce merges the states in its
            # own launch (no log-sum-exp written out, no merge launch).
            return wrapper.run(q, k_cache, v_cache, out=out, merge_with=(extra.out, extra.lse))
        extra = extra.merged()
        lse = self._lse_buffer(q.shape[0])[: q.shape[0] * q.shape[1]].view(q.shape[0], q.shape[1])
        wrapper.run(q, k_cache, v_cache, out=out, lse_out=lse)
        return self._merge(out, lse, extra, st.rows)

    def _lse_buffer(self, rows: int) -> torch.Tensor:
        """The decode's log-sum-exp buffer for ``rows`` decode rows (fixed once sized for the largest batch:
        graphs keep its address)."""
        need = max(self.max_batch_size or 0, rows) * self.shape["num_qo_heads"]
        if self._lse.numel() < need:
            self._lse = torch.zeros(need, dtype=torch.float32, device=self.device)
        return self._lse

    def _merge(self, out: torch.Tensor, lse: torch.Tensor, extra: AttentionState, rows) -> torch.Tensor:
        """``out`` (the decode over the selected entries) merged with the method's ``extra`` state, in place,
        on the selecting ``rows`` (None: all). Under tensor parallelism with replicated KV heads ``extra``
        covers the KV groups' gathered query heads: this rank's are its slice (``local_group_heads``)."""
        est_out, est_lse = extra.out, extra.lse
        if est_out.shape[1] != out.shape[1]:
            from sparse_models.distributed import local_group_heads

            heads = out.shape[1]
            est_out, est_lse = local_group_heads(est_out, heads, dim=1), local_group_heads(est_lse, heads, dim=1)
        if rows is None:  # every row selected: one in-place merge (a single launch on CUDA)
            return merge_states_(out, lse, est_out, est_lse, backend=self.backend)
        out[rows] = merge_states(out[rows].float(), lse[rows], est_out, est_lse).to(out.dtype)
        return out

    def _replan(self, wrapper: BatchDecodeWithPagedKVCache, ids: torch.Tensor, st: _BatchedStep) -> None:
        """Reference kernels (no index buffer to write on the device): plan the step's lists again
        with the picked entries in place of the placeholders."""
        kv_indptr, kv_indices, kv_last_len, tails = self._host_plan
        picked = (ids.view(-1) if st.take is None else ids.view(-1)[st.take]).to("cpu", torch.int32)
        if st.positions is None:
            kv_indices = picked
        else:
            kv_indices = kv_indices.clone()
            kv_indices[st.positions.cpu()] = picked
        shape = dict(head_sparse=True, page_size=st.unit, sm_scale=self.sm_scale, **self.shape)
        wrapper.plan(kv_indptr, kv_indices, kv_last_len, **shape, **tails)

    def _attend_observing(self, q, k_cache, v_cache, out, dense, kv, st: _BatchedStep):
        """An observed layer on the step's dense plan: the decode writes ``out``, every row's raw logits
        (``[rows, Hq, max_pages * block_size]``) and log-sum-exps in one pass over K and V; returns the
        selecting rows' ``(logits, logit_lse)``."""
        rows, heads = q.shape[0], q.shape[1]
        logits = torch.empty(rows, heads, st.max_pages * self.shape["block_size"], dtype=torch.float32, device=q.device)
        lse = self._lse_buffer(rows)[: rows * heads].view(rows, heads)
        if kv is None:
            dense.run(q, k_cache, v_cache, out=out, lse_out=lse, logits_out=logits)
        else:
            dense.run_quantized(q, kv, out=out, lse_out=lse, logits_out=logits)
        if st.rows is not None:
            logits, lse = logits[st.rows], lse[st.rows]
        return logits, lse

    def _logits(self, q: torch.Tensor, k_cache: torch.Tensor | None, st: _BatchedStep, kv=None):
        """Raw logits of every selecting row over its tokens (through the tables) and their softmax
        log-sum-exp; ``kv``: a per-token quantized store's layer (fp8, TurboQuant), whose codes and scales are
        read instead of ``k_cache`` (TurboQuant: with the query rotated in, q R . k R = q . k)."""
        shape = (q.shape[0], q.shape[1])
        logits = torch.empty(*shape, st.max_pages * self.shape["block_size"], dtype=torch.float32, device=q.device)
        args = (*self._rows_of(st), logits)
        if kv is None:
            paged_logits(q, k_cache, *args, scale=self.sm_scale, backend=self.backend)
        else:
            q = q if kv.rotation is None else rotate_quantized(q, kv)
            codes = dict(k_scale=kv.k_scale, codebook=kv.codebook)
            paged_logits(q, kv.k, *args, scale=self.sm_scale, **codes, backend=self.backend)
        return logits, logits_lse(logits, backend=self.backend)

    def _rows_of(self, st: _BatchedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selecting rows' tokens through the tables: ``(table, starts, kv_lens)``."""
        return self._table, st.starts, st.kv_lens

    def _fast_wrapper(self, unit: int, entries: int, hint: int) -> BatchDecodeWithPagedKVCache:
        """The batched path's wrapper for ``unit``: fixed capacities (graph replays need its buffers to
        stay put), replaced by a larger one when a plan outgrows it."""
        wrapper, capacity = self._fast.get(unit, (None, 0))
        if wrapper is None or entries > capacity:
            capacity = max(entries, hint, 2 * capacity)
            wrapper = self._list_decode(capacity)
            self._fast[unit] = (wrapper, capacity)
        return wrapper

    def _paged_lists(self, max_num_pages: int) -> BatchDecodeWithPagedKVCache:
        return BatchDecodeWithPagedKVCache(
            self.device, backend=self.backend, max_batch_size=self.max_batch_size, max_num_pages=max_num_pages
        )

    def _load_table(self, indices: torch.Tensor) -> None:
        self._table = _fit(self._table, indices.numel(), self.max_num_pages)
        _copy_in(self._table, indices.to(torch.int32))


def _fit(buf: torch.Tensor, needed: int, capacity: int | None) -> torch.Tensor:
    """``buf`` if it holds ``needed`` entries, else a larger buffer (which moves: graphs re-capture)."""
    if buf.numel() >= needed:
        return buf
    if capacity is not None and needed <= capacity:
        return torch.zeros(capacity, dtype=buf.dtype, device=buf.device)
    return torch.zeros(max(needed, 2 * buf.numel()), dtype=buf.dtype, device=buf.device)


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type == "cuda":
        dst[: src.numel()].copy_(src.pin_memory(), non_blocking=True)
    else:
        dst[: src.numel()].copy_(src)
