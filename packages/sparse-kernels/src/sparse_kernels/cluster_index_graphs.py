"""``build_cluster_index`` for index blocks of a repeated shape, replayed from CUDA graphs.

An appended index block (RetroInfer's ``retroinfer_update_tokens``, several requests' KV heads stacked) is
the same computation at the same shape every time: about 200 small torch ops a layer (k-means rounds of
products, arg-maxes and scatters), which eager dispatch turns into a host-bound step (~7,200 launches, 157-205
ms at batch 4-5 on the H200, session 21). ``GraphedIndexBuilder`` captures one CUDA graph per input shape on
first use and replays it after; on the CPU, during another capture, or for shapes above ``max_token_heads``,
it runs ``build_cluster_index`` eagerly. The replay computes exactly what the eager call computes (the same
kernels on the same inputs; CUDA's scatter-add order is not fixed in either).

All graphs share one memory pool, so their scratch is the largest graph's, not the sum: a replay's outputs
are views of that pool and stay valid only until the builder's next call (the caller copies them out, as
RetroInfer's arena write does, before it indexes the next block).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .cluster_index import KMEANS_ROUNDS, ClusterIndex, build_cluster_index

MAX_TOKEN_HEADS = 1 << 17
"""Largest ``tokens x stacked heads`` a graph is captured for (16 requests' 8 KV heads x 1024 tokens): the
pool keeps the largest graph's float32 scratch (several ``[heads, tokens, D]`` copies) for the engine's life,
so bigger blocks (a batch of many requests at once) run eagerly, where a step's host cost is shared by more
requests anyway."""
MAX_GRAPHS = 32
"""Shapes kept; the least recently used graph is dropped past this."""


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    keys: torch.Tensor
    values: torch.Tensor | None
    out: ClusterIndex


class GraphedIndexBuilder:
    """``build_cluster_index(keys, values, start=0, ...)`` with a CUDA graph per shape (see the module)."""

    def __init__(self, *, max_token_heads: int = MAX_TOKEN_HEADS, max_graphs: int = MAX_GRAPHS) -> None:
        self.max_token_heads = max_token_heads
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pool = None
        self.captures = 0
        self.replays = 0

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        *,
        avg_cluster_size: int,
        segments: int | None = None,
        rounds: int = KMEANS_ROUNDS,
    ) -> ClusterIndex:
        """The index of ``keys`` / ``values`` ``[n, H, D]`` over tokens ``[0, n)``, as ``build_cluster_index``."""
        args = dict(start=0, avg_cluster_size=avg_cluster_size, segments=segments, rounds=rounds)
        if (
            not keys.is_cuda
            or keys.shape[0] * keys.shape[1] > self.max_token_heads
            or torch.cuda.is_current_stream_capturing()
        ):
            return build_cluster_index(keys, values, **args)
        key = (
            tuple(keys.shape), keys.dtype, keys.device,
            None if values is None else (tuple(values.shape), values.dtype),
            avg_cluster_size, segments, rounds,
        )  # fmt: skip
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(keys, values, args)
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            entry.keys.copy_(keys)
            if values is not None:
                entry.values.copy_(values)
        entry.graph.replay()
        self.replays += 1
        return entry.out

    def _capture(self, keys: torch.Tensor, values: torch.Tensor | None, args: dict) -> _Graph:
        static_k = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device).copy_(keys)
        static_v = None
        if values is not None:
            static_v = torch.empty(values.shape, dtype=values.dtype, device=values.device).copy_(values)
        side = torch.cuda.Stream(device=keys.device)
        side.wait_stream(torch.cuda.current_stream(keys.device))
        with torch.cuda.stream(side):  # warm-up off the capture (library handles, allocator blocks)
            build_cluster_index(static_k, static_v, **args)
        torch.cuda.current_stream(keys.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = build_cluster_index(static_k, static_v, **args)
        self.captures += 1
        return _Graph(graph, static_k, static_v, out)
