"""Prefill chunks that read only the history a method selects (plus themselves, causally).

For each prefill chunk of a layer the method sees a ``PrefillView`` (the chunk's queries and, if it
asked, the history keys) and answers which history slots the chunk reads (None: all of it). The
answers become per-request slot lists (the chosen history, then the chunk's own slots) that the
paged prefill kernel reads through a one-slot-per-page view of the pool; causality inside the chunk
holds because the chunk's slots come last. Selections must be the same for every KV head.
"""

from __future__ import annotations

import torch

from sparse_kernels import BatchPrefillWithPagedKVCache
from sparse_methods import PrefillView, SparseMethod
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata, table_slots


class SelectivePrefill:
    def __init__(self, device: torch.device, shape: dict, sm_scale: float):
        self.prefill = BatchPrefillWithPagedKVCache(device)
        self.device = device
        self.shape = shape
        self.sm_scale = sm_scale
        self.num_selections = 0  # chunks that read a chosen subset of their history
        self.max_history_read = 0  # most history slots a selecting chunk read

    def run(
        self,
        method: SparseMethod,
        layer: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMetadata,
        group: LayerGroupMetadata,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of the step's prefill rows (``q``, after the decode rows) into ``out``."""
        bs = self.shape["block_size"]
        nd = meta.num_decode_tokens
        flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        keys_needed = method.layer_plan(layer).prefill_keys
        qo_indptr, kv_indptr, indices = [0], [0], []
        for i in range(nd, len(meta.steps)):
            step = meta.steps[i]
            n, history = step.num_new_tokens, group.kv_lens[i]
            slots = table_slots(group.block_ids[i], history + n, bs)
            start = meta.row_starts[i] - meta.row_starts[nd]
            chosen = None
            if history:
                keys = flat_k[slots[:history].to(self.device)] if keys_needed else None
                chosen = method.prefill_selection(layer, step, PrefillView(q[start : start + n], history, keys))
            if chosen is not None:
                rows = chosen.indices
                if chosen.page_size != 1 or not torch.equal(rows, rows[:1].expand_as(rows)):
                    raise ValueError("a prefill selection must be single slots, the same for every KV head")
                kept = rows[0].to(torch.int64).cpu()
                slots = torch.cat([slots[kept], slots[history:]])
                self.num_selections += 1
                self.max_history_read = max(self.max_history_read, kept.numel())
            indices.extend(slots.tolist())
            kv_indptr.append(len(indices))
            qo_indptr.append(qo_indptr[-1] + n)
        shape = {**self.shape, "block_size": 1}
        self.prefill.plan(
            torch.tensor(qo_indptr, dtype=torch.int32),
            torch.tensor(kv_indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.ones(len(kv_indptr) - 1, dtype=torch.int32),
            causal=True,
            sm_scale=self.sm_scale,
            **shape,
        )
        one_slot = (-1, 1, k_cache.shape[2], k_cache.shape[3])
        return self.prefill.run(q, k_cache.view(one_slot), v_cache.view(one_slot), out=out)
