"""RetroInfer's cluster index over one layer's keys (plain torch, the reference the kernels follow).

Per KV head, the keys of a token range ``[start, start + n)`` are centred (FP32 mean over the range)
and clustered by segmented spherical k-means:

- ``segments = max(1, n // 8192)`` equal slices of the range, ``C = (n // avg // segments) * segments``
  clusters, ``C / segments`` per slice; a slice's seed centres are its unit keys at evenly spaced
  positions ``floor((i + 0.5) * m / c)`` (``m`` tokens, ``c`` clusters in the slice).
- ``rounds`` rounds per slice: assign each key to the argmax of its dot product with the slice's
  unit centres (ties to the lower cluster), then each centre becomes the normalised mean of its unit
  keys; a cluster left empty keeps its old centre.
- One final assignment of every key over all ``C`` centres gives the index: ``centroids`` = mean of
  the assigned centred keys + the range's mean (keys' dtype; an empty cluster gets the mean alone),
  ``value_sums`` = FP32 sum of the assigned values, ``sizes`` (int32), ``offsets`` (exclusive
  cumulative sizes) and ``sorted_positions`` (token positions grouped by cluster: a stable argsort of
  the assignment, plus ``start``), so cluster ``c``'s tokens are
  ``sorted_positions[h, offsets[h, c] : offsets[h, c] + sizes[h, c]]``.

Later ranges are indexed on their own (one segment each) and appended (``concat_indexes`` is the plain
composition). Every step is per KV head, so blocks of several requests (or layers) of one length index
together with their heads stacked (``[n, blocks * H, D]``), each head's result the same as alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KMEANS_ROUNDS = 9
"""Rounds of spherical k-means per slice before the final assignment."""
SEGMENT_TOKENS = 8192
"""Tokens per k-means slice of a first index (``segments = max(1, n // SEGMENT_TOKENS)``)."""
ASSIGN_SCRATCH = 1 << 24
"""Elements of the ``[heads, chunk, clusters]`` scratch of one assignment product: keys are assigned in chunks
that keep it within this (at least ``ASSIGN_CHUNK`` keys a chunk), so a small index (an appended block, or many
requests' blocks stacked along the heads) takes one product a round."""
ASSIGN_CHUNK = 256


@dataclass(frozen=True, slots=True)
class ClusterIndex:
    """Clusters of one layer's tokens ``[start, end)``, per KV head (``H``), ``C`` clusters of ``D``.

    ``centroids`` ``[H, C, D]`` (keys' dtype), ``value_sums`` ``[H, C, D]`` float32 or None (built
    from keys alone), ``sizes`` int32 ``[H, C]``, ``offsets`` int64 ``[H, C]``,
    ``sorted_positions`` int32 ``[H, end - start]``.
    """

    start: int
    end: int
    centroids: torch.Tensor
    value_sums: torch.Tensor | None
    sizes: torch.Tensor
    offsets: torch.Tensor
    sorted_positions: torch.Tensor

    @property
    def num_clusters(self) -> int:
        return self.centroids.shape[1]

    def cluster_positions(self, head: int, clusters: torch.Tensor) -> torch.Tensor:
        """Ascending token positions of ``clusters`` (int64 ``[k]``) in KV head ``head``."""
        parts = [
            self.sorted_positions[head, int(o) : int(o) + int(s)]
            for o, s in zip(self.offsets[head, clusters].tolist(), self.sizes[head, clusters].tolist(), strict=True)
        ]
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.centroids.device)
        return torch.cat(parts).to(torch.int64).sort().values


def num_clusters(n: int, avg_cluster_size: int, segments: int) -> int:
    return (n // avg_cluster_size // segments) * segments


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _assign(unit_keys: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``[H, n]`` argmax over ``centres`` ``[H, C, D]`` of each key's dot product (first on ties)."""
    heads, n, _ = unit_keys.shape
    step = max(ASSIGN_CHUNK, ASSIGN_SCRATCH // max(1, heads * centres.shape[1]))
    if step >= n:
        return torch.bmm(unit_keys, centres.transpose(1, 2)).argmax(-1)
    out = torch.empty(heads, n, dtype=torch.int64, device=unit_keys.device)
    for lo in range(0, n, step):
        out[:, lo : lo + step] = torch.bmm(unit_keys[:, lo : lo + step], centres.transpose(1, 2)).argmax(-1)
    return out


def _cluster_sums(x: torch.Tensor, assign: torch.Tensor, num: int) -> torch.Tensor:
    """``[H, num, D]`` float32 sums of ``x`` ``[H, n, D]`` per cluster of ``assign`` ``[H, n]``."""
    sums = torch.zeros(x.shape[0], num, x.shape[2], dtype=torch.float32, device=x.device)
    return sums.scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, x.shape[2]), x.float())


def spherical_kmeans(unit_keys: torch.Tensor, num_clusters: int, segments: int, rounds: int) -> torch.Tensor:
    """Unit centres ``[H, num_clusters, D]`` float32 of unit keys ``[H, n, D]`` clustered per slice."""
    heads, n, _ = unit_keys.shape
    per = num_clusters // segments
    bounds = [s * n // segments for s in range(segments + 1)]
    centres = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        x = unit_keys[:, lo:hi]
        m = hi - lo
        # floor((i + 0.5) * m / per), made on the device (a host list copied there would wait for the stream)
        seeds = (2 * torch.arange(per, device=x.device) + 1) * m // (2 * per)
        c = x[:, seeds].clone()
        for _ in range(rounds):
            assign = _assign(x, c)
            sums = _cluster_sums(x, assign, per)
            counts = torch.zeros(heads, per, dtype=torch.int64, device=x.device)
            counts.scatter_add_(1, assign, torch.ones_like(assign))
            c = torch.where((counts > 0).unsqueeze(-1), _unit(sums), c)
        centres.append(c)
    return torch.cat(centres, dim=1)


def build_cluster_index(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    *,
    start: int,
    avg_cluster_size: int,
    segments: int | None = None,
    rounds: int = KMEANS_ROUNDS,
) -> ClusterIndex:
    """Index of ``keys`` / ``values`` ``[n, H, D]``, the tokens ``[start, start + n)`` of a layer.

    ``segments`` None: ``max(1, n // SEGMENT_TOKENS)`` (a first index); appended blocks pass 1.
    """
    n = keys.shape[0]
    segments = max(1, n // SEGMENT_TOKENS) if segments is None else segments
    count = num_clusters(n, avg_cluster_size, segments)
    if count < 1:
        raise ValueError(f"{n} tokens make no cluster of {avg_cluster_size} in {segments} segment(s)")
    k = keys.transpose(0, 1).float()  # [H, n, D]
    mean = k.mean(dim=1, keepdim=True)
    centred = k - mean
    centres = spherical_kmeans(_unit(centred), count, segments, rounds)
    assign = _assign(_unit(centred), centres)
    sizes = torch.zeros(k.shape[0], count, dtype=torch.int64, device=k.device)
    sizes.scatter_add_(1, assign, torch.ones_like(assign))
    centroids = _cluster_sums(centred, assign, count) / sizes.clamp_min(1).unsqueeze(-1) + mean
    value_sums = None if values is None else _cluster_sums(values.transpose(0, 1), assign, count)
    order = torch.sort(assign, dim=1, stable=True).indices
    return ClusterIndex(
        start=start,
        end=start + n,
        centroids=centroids.to(keys.dtype),
        value_sums=value_sums,
        sizes=sizes.to(torch.int32),
        offsets=torch.cumsum(sizes, dim=1) - sizes,
        sorted_positions=(order + start).to(torch.int32),
    )


def concat_indexes(first: ClusterIndex, block: ClusterIndex) -> ClusterIndex:
    """``first`` followed by ``block`` (which must start where ``first`` ends)."""
    if block.start != first.end:
        raise ValueError(f"index block starts at {block.start}, the index ends at {first.end}")
    if (first.value_sums is None) != (block.value_sums is None):
        raise ValueError("cannot append an index with value sums to one without (or the reverse)")
    return ClusterIndex(
        start=first.start,
        end=block.end,
        centroids=torch.cat([first.centroids, block.centroids], dim=1),
        value_sums=None if first.value_sums is None else torch.cat([first.value_sums, block.value_sums], dim=1),
        sizes=torch.cat([first.sizes, block.sizes], dim=1),
        offsets=torch.cat([first.offsets, block.offsets + first.sorted_positions.shape[1]], dim=1),
        sorted_positions=torch.cat([first.sorted_positions, block.sorted_positions], dim=1),
    )
