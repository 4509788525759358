"""Decode that reads only the pages a query-aware method selects, per (request, KV head).

For each decode query of a layer, the method sees the request's page summaries (``DecodeView``)
and answers which pages each KV head reads (None: all). The choices become a head-sparse CSR of
block ids (one list per request and KV head, the partial newest page last) that the decode kernel
reads, so the bytes a step reads scale with the budget rather than the context.

The choices are brought to the host to build the lists (one sync per layer); a device-side list
builder writing the kernel's fixed buffers would make this graph-capturable.
"""

from __future__ import annotations

import torch

from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_methods import DecodeView, SparseMethod
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata


class SelectiveDecode:
    def __init__(self, device: torch.device, shape: dict, sm_scale: float):
        self.decode = BatchDecodeWithPagedKVCache(device)
        self.device = device
        self.shape = shape
        self.sm_scale = sm_scale
        self.pages_read = 0  # pages read by selective decodes so far (KV heads x pages), for reports
        self.max_list_pages = 0  # longest (request, KV head) page list so far
        self.num_selections = 0  # decode queries whose method chose a subset (not None)

    def run(
        self,
        method: SparseMethod,
        layer: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kmin: torch.Tensor,
        kmax: torch.Tensor,
        meta: StepMetadata,
        group: LayerGroupMetadata,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of the ``q.shape[0]`` leading (decode) items of the step, into ``out``."""
        bs = self.shape["block_size"]
        num_kv_heads = self.shape["num_kv_heads"]
        indptr, indices, last_len = [0], [], []
        for i in range(q.shape[0]):
            kv_len = group.kv_lens[i] + 1
            num_pages = -(-kv_len // bs)
            blocks = meta.tables[i].block_ids[:num_pages]
            ids = torch.tensor(blocks, dtype=torch.int64, device=self.device)
            view = DecodeView(q[i], kmin[ids], kmax[ids], kv_len, bs)
            chosen = method.decode_selection(layer, meta.steps[i], view)
            rows = [range(num_pages)] * num_kv_heads if chosen is None else chosen.tolist()
            self.num_selections += chosen is not None
            self.max_list_pages = max(self.max_list_pages, max(len(pages) for pages in rows))
            tail = kv_len - (num_pages - 1) * bs
            for pages in rows:
                indices.extend(blocks[p] for p in pages)
                indptr.append(len(indices))
                last_len.append(tail if pages[-1] == num_pages - 1 else bs)
        self.pages_read += len(indices)
        self.decode.plan(
            torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last_len, dtype=torch.int32),
            head_sparse=True,
            sm_scale=self.sm_scale,
            **self.shape,
        )
        return self.decode.run(q, k_cache, v_cache, out=out)
