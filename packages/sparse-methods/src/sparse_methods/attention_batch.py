"""What a method may read after one layer's attention, for every request the step observes at once.

``on_attention_end(layer, batch)`` is called once per full-attention layer. ``LayerAttentionBatch``
always gives each request's own view (``request(i)``: a ``LayerAttention``, built on demand). Where the
engine can (decode rows of one token each over a plain paged store) it also gives the whole batch as
tensors: the queries ``[B, 1, Hq, D]`` and the keys as ``PagedKeys``, a lazy view of the layer's pages
(the k-cache, each request's block-table row and its length; the v-cache too for a method that observes
values) that ``dense()`` gathers in one op, or that a fused scoring kernel reads in place. A method that
ranks a layer's requests together then does a few device ops per layer instead of per (request, layer),
with no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparse_methods.base import LayerAttention, RequestStep


@dataclass(frozen=True, slots=True)
class PagedKeys:
    """``B`` requests' keys in one layer, read through their block tables (nothing copied yet).

    ``k_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` the layer's pool. ``block_table``:
    int32 ``[B, P]`` on the pool's device, each request's blocks in table order (entries past a request's
    last block repeat it: any value read there is padding). ``kv_lens``: int64 ``[B]`` on the device, the
    slots each request holds after the step. ``kv_lens_cpu``: the same lengths on the host (shapes).
    ``v_cache``: the layer's value pool, like ``k_cache``, when the method observes values
    (``SparseMethod.observes_values``); ``dense_values()`` gathers it.
    """

    k_cache: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    kv_lens_cpu: tuple[int, ...]
    v_cache: torch.Tensor | None = None

    @property
    def max_len(self) -> int:
        return max(self.kv_lens_cpu)

    def take(self, index: list[int]) -> PagedKeys:
        """The view of requests ``index`` (ascending): slices when they are consecutive (no copy), else one
        gather of their rows (the index copied without waiting for the device)."""
        lens = tuple(self.kv_lens_cpu[i] for i in index)
        if index == list(range(index[0], index[0] + len(index))):
            rows = slice(index[0], index[0] + len(index))
        else:
            host = torch.tensor(index, dtype=torch.int64)
            cuda = self.kv_lens.device.type == "cuda"
            rows = host.pin_memory().to(self.kv_lens.device, non_blocking=True) if cuda else host
        return PagedKeys(self.k_cache, self.block_table[rows], self.kv_lens[rows], lens, self.v_cache)

    def slots(self) -> torch.Tensor:
        """int64 ``[B, L]`` pool slot of each request's slot ``0 .. L-1`` (``L``: the longest), made on the
        device from the block-table rows."""
        bs = self.k_cache.shape[1]
        pos = torch.arange(self.max_len, device=self.block_table.device)
        blocks = self.block_table[:, pos // bs].long()  # [B, L]
        return blocks.mul_(bs).add_(pos % bs)

    def spans(self, rows: list[int], starts: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(keys, values)`` ``[len(rows), length, num_kv_heads, head_dim]``: request ``rows[j]``'s slots
        ``starts[j] .. starts[j] + length - 1`` (within its length), in one gather each; values None when the
        view carries none."""
        bs = self.k_cache.shape[1]
        host = torch.tensor([rows, starts], dtype=torch.int64)
        cuda = self.block_table.device.type == "cuda"
        at = host.pin_memory().to(self.block_table.device, non_blocking=True) if cuda else host
        pos = at[1, :, None] + torch.arange(length, device=at.device)
        slots = self.block_table[at[0, :, None], pos // bs].long().mul_(bs).add_(pos % bs)

        def gather(cache: torch.Tensor) -> torch.Tensor:
            return cache.view(-1, *cache.shape[2:])[slots]

        return gather(self.k_cache), None if self.v_cache is None else gather(self.v_cache)

    def dense(self) -> torch.Tensor:
        """``[B, L, num_kv_heads, head_dim]`` every request's keys in slot order, zeros past its length:
        one gather."""
        return self._gather(self.k_cache)

    def dense_values(self) -> torch.Tensor:
        """Like ``dense()``, the values (``v_cache`` must be given)."""
        if self.v_cache is None:
            raise ValueError("these paged keys carry no values (the method does not observe them)")
        return self._gather(self.v_cache)

    def _gather(self, cache: torch.Tensor) -> torch.Tensor:
        flat = cache.view(-1, *cache.shape[2:])
        rows = flat[self.slots()]
        past = torch.arange(self.max_len, device=rows.device).view(1, -1) >= self.kv_lens.view(-1, 1)
        return rows.masked_fill_(past.view(*past.shape, 1, 1), 0)


@dataclass(frozen=True)
class LayerAttentionBatch:
    """Every request a step observes in one layer, after the layer's attention.

    ``requests``: their ``RequestStep``s, in the step's order. ``scale``: the softmax scale attention used.
    ``views``: ``i -> LayerAttention`` of request ``i`` (built on demand; ``request(i)`` caches it).
    ``queries`` / ``keys``: the batch as tensors when every request is a decode row of one token over a
    plain paged store: ``[B, 1, num_q_heads, head_dim]`` (after RoPE) and ``PagedKeys`` (this step's key
    stored, each request's last slot); None otherwise.
    """

    requests: tuple[RequestStep, ...]
    scale: float
    views: Callable[[int], LayerAttention]
    queries: torch.Tensor | None = None
    keys: PagedKeys | None = None
    _cache: dict[int, LayerAttention] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def batched(self) -> bool:
        """The batch is also given as tensors (``queries`` and ``keys``)."""
        return self.keys is not None

    def request(self, i: int) -> LayerAttention:
        """Request ``i``'s own view (today's per-request contract)."""
        view = self._cache.get(i)
        if view is None:
            view = self._cache[i] = self.views(i)
        return view

    def __iter__(self):
        """``(RequestStep, LayerAttention)`` of each request in order."""
        for i, step in enumerate(self.requests):
            yield step, self.request(i)

    @classmethod
    def of_views(cls, requests: tuple[RequestStep, ...], views: list[LayerAttention]) -> LayerAttentionBatch:
        """A batch of ready per-request views (an engine with no paged store, tests)."""
        if len(requests) != len(views):
            raise ValueError(f"{len(requests)} requests, {len(views)} views")
        scale = views[0].scale if views else 1.0
        return cls(tuple(requests), scale, views.__getitem__)
