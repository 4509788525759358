"""The engine's attention over a latent store (multi-head latent attention, ``latent paged``).

An MLA model hands the backend absorbed queries ``[T, H, latent + rope]`` and the rows to cache
``[T, 1, latent + rope]`` (see ``sparse_models.models.deepseek``); this writes the rows into the
layer's pool tensor and runs ``sparse_kernels.latent_attention`` over each request's pages. Decode
items and prefill chunks go in one launch: the plan lists the decode items first, one query token
each, then the prefill chunks, as the step's flat token layout does.

Page selection (Quest over the latent): with a ``latent paged + block summaries`` store each block
keeps the elementwise min / max of its rows (latent and rope channels), refreshed for every block a
step writes (on the device from the slot mapping in decode-only steps). In a layer where the method
selects decode pages, the absorbed decode queries of the rows whose context outgrows the method's
budget are handed to ``select_decode`` as one KV head whose group is every query head (``q . row``
is the attention logit, so the bound of ``q`` against a page's min / max bounds it), and those rows'
lists hold only the chosen pages (the newest always among them, so the single decode query still
sees its own row last). Decode-only steps select through ``SelectiveDecode``'s batched path, the
paged backend's, with ``_LatentLists`` as its list decode: the picks are written on the device
into the latent plan's index buffer. Steps that mix prefill chunks and decodes plan the chosen
pages on the host (``_selected_plan``).

CUDA graphs: the first layer group's slot mapping and decode-only plan live in fixed buffers
(``BatchLatentDecode``), so a decode step captured once replays for any later step of its batch
size; selecting steps whose rows all read the same number of pages replay a graph per
``SelectiveDecode.graph_key`` as on the paged path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparse_kernels import block_summary, resolve_backend, update_block_summaries
from sparse_kernels.latent_attention import LatentPlan, latent_attention, plan_latent, store_latent
from sparse_kernels.latent_decode import BatchLatentDecode
from sparse_methods.base import DecodeBatch, DecodeRead, LayerPlan, SparseMethod
from sparse_serve.selective_decode import SelectiveDecode
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata, to_device, to_device_buffer

_SELECT_PAGES = LayerPlan(DecodeRead.SELECTED)  # the only selection a latent store reads: pages, on the device


class LatentPagedAttention:
    """Per layer group: the slot mapping and the latent kernel's plan of the current step."""

    def __init__(
        self,
        latent: tuple[torch.Tensor, ...],
        *,
        num_heads: int,
        latent_dim: int,
        block_size: int,
        summary: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None,
        method: SparseMethod | None = None,
        group_queries: Callable[[torch.Tensor], torch.Tensor] | None = None,
        capacities: tuple[int | None, int | None, int | None] = (None, None, None),
        sm_scale: float = 1.0,
    ):
        """``summary``: a store with summaries' ``KVPool.summary`` (layer -> the blocks' min and max rows
        ``[num_blocks, 1, latent + rope]`` and, for int8 codes, their scales ``[num_blocks, 1]``, else None);
        ``method``: asked which pages a selecting layer's decode rows read;
        ``group_queries``: under tensor parallelism, this rank's query heads -> every head of the latent
        head's group (the method selects from all of them, so every rank reads the same pages);
        ``capacities``: ``(max_num_tokens, max_batch_size, max_num_pages)`` of the fixed buffers the
        first group's slot mapping and decode plans are copied into (None: new tensors each step);
        ``sm_scale``: the softmax scale of the batched selection path's plans."""
        self.latent = latent  # per layer [num_blocks, block_size, 1, latent_dim + rope_dim]
        self.device = latent[0].device
        self.num_heads = num_heads
        self.latent_dim = latent_dim
        self.rope_dim = latent[0].shape[-1] - latent_dim
        self.block_size = block_size
        self.summary = summary
        self.method = method
        self.group_queries = group_queries
        plans = [] if method is None else [method.layer_plan(layer) for layer in range(len(latent))]
        if any(plan.selects_decode for plan in plans):
            if summary is None or any(plan.selects_decode and plan != _SELECT_PAGES for plan in plans):
                raise ValueError(f"{method.name} selects latent pages on the device: it needs block summaries")
        max_tokens, max_batch_size, max_num_pages = capacities
        self._slot_buffer = torch.empty(max_tokens, dtype=torch.int32, device=self.device) if max_tokens else None
        self._decode = BatchLatentDecode(
            self.device,
            num_heads=num_heads,
            latent_dim=latent_dim,
            rope_dim=self.rope_dim,
            block_size=block_size,
            max_batch_size=max_batch_size,
            max_num_pages=max_num_pages,
        )
        shape = dict(num_qo_heads=num_heads, num_kv_heads=1, head_dim=latent[0].shape[-1], block_size=block_size)
        self.selective = SelectiveDecode(
            self.device,
            shape,
            sm_scale,
            max_batch_size=max_batch_size,
            max_num_pages=max_num_pages,
            list_decode=lambda pages: _LatentLists(self.device, latent_dim, shape, max_batch_size, pages),
        )
        self._meta: StepMetadata | None = None
        self._sm_scale = 1.0
        self._slots: list[torch.Tensor] = []
        self._plans: list[LatentPlan] = []
        self._written: list[tuple[torch.Tensor, torch.Tensor]] = []

    def plan(self, meta: StepMetadata, sm_scale: float, method: SparseMethod | None) -> None:
        """``method``: the step's method (None: attend densely, e.g. while CUDA graphs are captured)."""
        self._meta, self._sm_scale, self.method = meta, sm_scale, method
        self._slots = [  # the first group's in a fixed buffer
            to_device_buffer(g.slot_mapping, self._slot_buffer if i == 0 else None, self.device)
            for i, g in enumerate(meta.groups)
        ]
        self._plans = [self._plan_group(group, meta, first=i == 0) for i, group in enumerate(meta.groups)]
        decode_only = meta.num_prefill_requests == 0
        if self.summary is not None and not decode_only:
            self._written = [self._written_blocks(slots) for slots in self._slots]
        if method is not None and decode_only and len(meta.groups) == 1:  # the batched selection path
            self.selective.plan_step(method, meta, meta.groups[0], table=self._plans[0].kv_indices)
        else:
            self.selective.reset()

    def _plan_group(self, group: LayerGroupMetadata, meta: StepMetadata, decode=None, first=False) -> LatentPlan:
        """``decode``: the decode items' CSR ``(indptr, indices, last_len)`` instead of the group's;
        ``first``: the first group, whose decode-only plans go to the fixed buffers."""
        nd = meta.num_decode_tokens
        own = (group.decode_kv_indptr, group.decode_kv_indices, group.decode_kv_last_len)
        d_indptr, d_indices, d_last = decode or own
        if first and nd and not meta.num_prefill_requests:
            csr = (d_indptr[: nd + 1], d_indices[: d_indptr[nd]], d_last[:nd])
            return self._decode.plan(*csr, sm_scale=self._sm_scale)
        p_indptr = group.prefill_kv_indptr
        qo_indptr = torch.cat([torch.arange(nd + 1, dtype=torch.int32), group.prefill_qo_indptr[1:] + nd])
        kv_indptr = torch.cat([d_indptr[: nd + 1], p_indptr[1:] + d_indptr[nd]])
        return plan_latent(
            qo_indptr,
            kv_indptr,
            torch.cat([d_indices[: d_indptr[nd]], group.prefill_kv_indices]),
            torch.cat([d_last[:nd], group.prefill_kv_last_len]),
            num_heads=self.num_heads,
            latent_dim=self.latent_dim,
            rope_dim=self.rope_dim,
            block_size=self.block_size,
            sm_scale=self._sm_scale,
            device=self.device,
        )

    def _written_blocks(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks the step writes and how many rows each then holds (rows fill a block in order, so
        its last written offset + 1)."""
        slots = slots[slots >= 0].long()
        blocks = slots // self.block_size
        ids = torch.unique(blocks)
        valid = torch.zeros(self.latent[0].shape[0], dtype=torch.long, device=slots.device)
        valid.scatter_reduce_(0, blocks, slots % self.block_size + 1, reduce="amax")
        return ids, valid[ids]

    def forward(self, layer_idx: int, group_idx: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store ``rows [T, 1, D]`` and attend ``q [T, H, D]``; returns ``[T, H, latent_dim]``."""
        cache, slots = self.latent[layer_idx], self._slots[group_idx]
        store_latent(rows, cache, slots)
        kmin, kmax, kscale = self._summary(layer_idx)
        if kmin is not None:
            if self._meta.num_prefill_requests == 0:  # one new row per request, each in its own block
                update_block_summaries(cache, slots, kmin, kmax, scale=kscale)
            else:
                block_summary(cache, *self._written[group_idx], kmin, kmax, scale=kscale)
        sel = self.selective
        if sel.batched and self.method.layer_plan(layer_idx).selects_decode:  # picked on the device, no host sync
            select_q = q if self.group_queries is None else self.group_queries(q)
            out = q.new_empty(q.shape[0], q.shape[1], self.latent_dim)
            args = (self.method, layer_idx, q, cache, cache, kmin, kmax, out)
            return sel.run_batched(*args, select_q=select_q, kscale=kscale)
        planned = sel.batched or sel.reads_all  # a decode-only step of the batched path: nothing left to pick
        plan = None if planned else self._selected_plan(layer_idx, group_idx, q)
        return latent_attention(q, cache, plan or self._plans[group_idx])

    def _summary(self, layer_idx: int) -> tuple:
        """``(kmin, kmax, scale)`` of the layer (scale None in the model dtype; all None without summaries)."""
        return (None, None, None) if self.summary is None else self.summary(layer_idx)

    def _selected_plan(self, layer_idx: int, group_idx: int, q: torch.Tensor) -> LatentPlan | None:
        """The group's plan with the selecting decode rows reading only their chosen pages; None when
        no decode row of this layer selects."""
        meta, method = self._meta, self.method
        nd = meta.num_decode_tokens
        if method is None or nd == 0 or not method.layer_plan(layer_idx).selects_decode:
            return None
        group, bs = meta.groups[group_idx], self.block_size
        indptr, indices, last = group.decode_kv_indptr, group.decode_kv_indices, group.decode_kv_last_len
        pages = (indptr[1 : nd + 1] - indptr[:nd]).tolist()
        kv_lens = [(n - 1) * bs + int(last[i]) for i, n in enumerate(pages)]
        rows = [i for i in range(nd) if method.selection_size(kv_lens[i], bs) is not None]
        if not rows:
            return None
        dev = self.device
        select_q = q[:nd] if self.group_queries is None else self.group_queries(q[:nd])
        kmin, kmax, kscale = self._summary(layer_idx)
        batch = DecodeBatch(
            query=select_q[rows],
            kv_lens=torch.tensor([kv_lens[i] for i in rows], dtype=torch.long, device=dev),
            table_indices=to_device(indices.long(), dev),
            table_start=torch.tensor([int(indptr[i]) for i in rows], dtype=torch.long, device=dev),
            max_pages=max(pages[i] for i in rows),
            block_size=bs,
            page_min=kmin,
            page_max=kmax,
            page_scale=kscale,
            sm_scale=self._sm_scale,
        )
        chosen = dict(zip(rows, method.select_decode(layer_idx, batch)[:, 0].cpu(), strict=True))  # one KV head
        lists = [
            indices[indptr[i] + chosen[i]] if i in chosen else indices[indptr[i] : indptr[i + 1]] for i in range(nd)
        ]
        new_indptr = torch.zeros(nd + 1, dtype=torch.int32)
        new_indptr[1:] = torch.tensor([len(x) for x in lists]).cumsum(0)
        return self._plan_group(group, meta, (new_indptr, torch.cat(lists), last))


class _LatentLists:
    """``BatchLatentDecode`` behind the paged decode wrapper's interface, for ``SelectiveDecode``'s
    batched path: one list per request (the latent's one KV head) of whole blocks."""

    def __init__(self, device, latent_dim: int, shape: dict, max_batch_size: int | None, max_num_pages: int):
        self.block_size = shape["block_size"]
        self.backend = resolve_backend("auto", device)
        self._decode = BatchLatentDecode(
            device,
            num_heads=shape["num_qo_heads"],
            latent_dim=latent_dim,
            rope_dim=shape["head_dim"] - latent_dim,
            block_size=self.block_size,
            max_batch_size=max_batch_size,
            max_num_pages=max_num_pages,
        )

    def plan(self, kv_indptr, kv_indices, kv_last_len, *, head_sparse, page_size, sm_scale, **shape) -> None:
        if page_size != self.block_size or shape.get("num_kv_heads", 1) != 1:
            raise ValueError(f"latent lists read whole blocks of one KV head, not page_size={page_size}")
        self._decode.plan(kv_indptr, kv_indices, kv_last_len, sm_scale=sm_scale)

    def planned_kv_indices(self) -> torch.Tensor:
        return self._decode.planned.kv_indices

    def run(self, q: torch.Tensor, cache: torch.Tensor, _values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return latent_attention(q, cache, self._decode.planned, out=out)
