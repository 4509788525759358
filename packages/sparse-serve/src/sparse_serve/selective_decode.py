"""Decode that reads only what a query-aware method selects, per (request, KV head).

For each decode query of a layer, the method sees a ``DecodeView`` (the query, the request's page
summaries when the store keeps them, its keys when it asked for them) and answers a ``Selection``:
pages (``page_size`` = block size: block lists) or single slots (``page_size`` = 1: slot lists),
per KV head, or None (read everything). The answers become one head-sparse CSR (one list per
request and KV head, the newest page last) that the decode kernel reads, so the bytes a step reads
scale with the budget rather than the context.

Two paths choose the same lists. The host path asks ``decode_selection`` per query and builds the
lists on the host (one sync per layer; any method, any kernel backend). The batched path, for
methods with ``batched_selection`` on the Triton kernels, plans the list structure once per step
(lengths are known from ``selection_size``) and, per layer, writes the pages the method picks on the
device straight into the kernel's index buffer: no host sync inside the forward.
"""

from __future__ import annotations

import torch

from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_methods import DecodeView, Selection, SparseMethod
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata, table_slots


class SelectiveDecode:
    def __init__(self, device: torch.device, shape: dict, sm_scale: float, backend: str = "auto"):
        self.backend = backend
        self.decode = {}  # page size -> wrapper (a plan's page size is fixed per wrapper)
        self.device = device
        self.shape = shape
        self.sm_scale = sm_scale
        self.pages_read = 0  # list entries read by selective decodes so far, for reports
        self.tokens_read = 0  # KV tokens (per KV head) read by selective decodes so far
        self.max_list_pages = 0  # longest (request, KV head) list so far, in its page size
        self.num_selections = 0  # decode queries whose method chose a subset (not None)

        self._batched = None  # this step's batched plan, or None (host path)

    def plan_step(self, method: SparseMethod, meta: StepMetadata, group: LayerGroupMetadata) -> None:
        """Plan the batched path for this step's decode rows, or fall back to the host path (None)."""
        self._batched = None
        nd = meta.num_decode_tokens
        wrapper = self._wrapper(self.shape["block_size"])
        if not nd or not method.batched_selection or wrapper.backend != "triton":
            return
        bs, num_kv_heads = self.shape["block_size"], self.shape["num_kv_heads"]
        kv_lens = [group.kv_lens[i] + 1 for i in range(nd)]
        sizes = [method.selection_size(n, bs) for n in kv_lens]
        chosen_sizes = {s for s in sizes if s is not None}
        if len(chosen_sizes) > 1:
            return  # rows would pick different numbers of pages: host path
        size = chosen_sizes.pop() if chosen_sizes else 0
        indptr, indices, last_len, positions, rows, tables = [0], [], [], [], [], []
        for i, (kv_len, sel) in enumerate(zip(kv_lens, sizes, strict=True)):
            blocks = meta.tables[i].block_ids[: -(-kv_len // bs)]
            tail = kv_len - (len(blocks) - 1) * bs
            if sel is not None:
                rows.append(i)
                tables.append(blocks)
            for _ in range(num_kv_heads):
                if sel is None:
                    indices.extend(blocks)
                else:
                    positions.extend(range(len(indices), len(indices) + sel))
                    indices.extend([blocks[-1]] * sel)  # placeholders, written per layer on the device
                indptr.append(len(indices))
                last_len.append(tail)
        wrapper.plan(
            torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last_len, dtype=torch.int32),
            head_sparse=True,
            sm_scale=self.sm_scale,
            **self.shape,
        )
        width = max((len(t) for t in tables), default=0)
        padded = [t + [t[-1]] * (width - len(t)) for t in tables]
        dev = self.device
        self._batched = (
            torch.tensor(rows, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            torch.tensor(padded, dtype=torch.int64, device=dev).view(len(rows), width),
            torch.tensor([len(t) for t in tables], dtype=torch.int64, device=dev),
            size,
        )
        self.max_list_pages = max(self.max_list_pages, size)

    @property
    def batched(self) -> bool:
        return self._batched is not None

    def run_batched(self, method, layer, q, k_cache, v_cache, kmin, kmax, out) -> torch.Tensor:
        """The batched path for one layer: pick pages on the device, write them into the plan, attend."""
        rows, positions, table, num_pages, size = self._batched
        wrapper = self._wrapper(self.shape["block_size"])
        if rows.numel():
            chosen = method.select_batched(
                layer, q[rows], kmin[table], kmax[table], num_pages, self.shape["block_size"]
            )  # [n, Hkv, size]
            blocks = torch.gather(table.unsqueeze(1).expand(-1, chosen.shape[1], -1), 2, chosen)
            wrapper.planned_kv_indices()[positions] = blocks.reshape(-1).to(torch.int32)
            self.num_selections += rows.numel()
        return wrapper.run(q, k_cache, v_cache, out=out)

    def _wrapper(self, page_size: int) -> BatchDecodeWithPagedKVCache:
        if page_size not in self.decode:
            self.decode[page_size] = BatchDecodeWithPagedKVCache(self.device, backend=self.backend)
        return self.decode[page_size]

    def _view(self, method, layer, q_row, kv_len, blocks, kmin, kmax, k_cache) -> DecodeView:
        bs = self.shape["block_size"]
        ids = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        keys = None
        if method.needs_decode_keys(layer):
            flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
            keys = flat[table_slots(blocks, kv_len, bs).to(self.device)]
        summaries = (kmin[ids], kmax[ids]) if kmin is not None else (None, None)
        return DecodeView(q_row, kv_len, bs, *summaries, keys)

    def run(
        self,
        method: SparseMethod,
        layer: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kmin: torch.Tensor | None,
        kmax: torch.Tensor | None,
        meta: StepMetadata,
        group: LayerGroupMetadata,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of the ``q.shape[0]`` leading (decode) items of the step, into ``out``."""
        bs = self.shape["block_size"]
        num_kv_heads = self.shape["num_kv_heads"]
        lists: list[tuple[list[int], int, int]] = []  # (pool entries, tokens in the last entry, page size)
        for i in range(q.shape[0]):
            kv_len = group.kv_lens[i] + 1
            blocks = meta.tables[i].block_ids[: -(-kv_len // bs)]
            chosen = method.decode_selection(
                layer, meta.steps[i], self._view(method, layer, q[i], kv_len, blocks, kmin, kmax, k_cache)
            )
            lists.extend(self._lists(chosen, kv_len, blocks, num_kv_heads))
            self.num_selections += chosen is not None
        if len({size for _, _, size in lists}) > 1:  # mixed answers in one step: all as single slots
            lists = [(_as_slots(entries, last, size), 1, 1) for entries, last, size in lists]
        page_size = lists[0][2]
        indptr, indices, last_len = [0], [], []
        for entries, last, _ in lists:
            indices.extend(entries)
            indptr.append(len(indices))
            last_len.append(last)
            self.tokens_read += (len(entries) - 1) * page_size + last
            self.max_list_pages = max(self.max_list_pages, len(entries))
        self.pages_read += len(indices)
        wrapper = self._wrapper(page_size)
        wrapper.plan(
            torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last_len, dtype=torch.int32),
            head_sparse=True,
            page_size=page_size,
            sm_scale=self.sm_scale,
            **self.shape,
        )
        return wrapper.run(q, k_cache, v_cache, out=out)

    def _lists(self, chosen: Selection | None, kv_len: int, blocks: list[int], num_kv_heads: int):
        """One (entries, last-entry tokens, page size) per KV head; entries are block ids or slot ids."""
        bs = self.shape["block_size"]
        if chosen is None or chosen.page_size == bs:
            num_pages = len(blocks)
            tail = kv_len - (num_pages - 1) * bs
            rows = [range(num_pages)] * num_kv_heads if chosen is None else chosen.indices.tolist()
            return [([blocks[p] for p in row], tail if row[-1] == num_pages - 1 else bs, bs) for row in rows]
        if chosen.page_size != 1:
            raise ValueError(f"a selection's page_size must be the block size ({bs}) or 1, got {chosen.page_size}")
        return [([blocks[t // bs] * bs + t % bs for t in row], 1, 1) for row in chosen.indices.tolist()]


def _as_slots(entries: list[int], last: int, size: int) -> list[int]:
    """A list of ``size``-token pages (the last one holding ``last`` tokens) as single slots."""
    if size == 1:
        return entries
    return [b * size + o for b in entries[:-1] for o in range(size)] + [entries[-1] * size + o for o in range(last)]
