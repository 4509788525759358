"""This rank's ``HeadReduction``: a method's per-shard results combined over the tensor-parallel ranks.

With at least as many KV heads as ranks each rank holds its own shard (``kv_head_shard``). With fewer,
``world / Hkv`` consecutive ranks hold the same replicated KV head and compute the same results from its
gathered query group, so a shard counts once: a sum takes only the first replica's share, a gather
only the first replica's part (an MLA model's one latent head is a single shard held by every rank).
"""

from __future__ import annotations

import torch

from sparse_methods import HeadReduction
from sparse_models.distributed import all_gather, all_reduce, tp_rank, tp_world_size


class RankHeadReduction(HeadReduction):
    def __init__(self, num_kv_heads: int) -> None:
        world = tp_world_size()
        self.replicas = max(1, world // num_kv_heads)  # ranks holding each shard
        self.num_shards = world // self.replicas
        self.shard = tp_rank() // self.replicas

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        own = x.clone() if tp_rank() % self.replicas == 0 else torch.zeros_like(x)
        return all_reduce(own)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x.clone(), "max")

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.replicas == 1:
            return all_gather(x, dim)
        parts = all_gather(x.unsqueeze(0), 0)  # [world, ...]: one part per rank
        return torch.cat(list(parts[:: self.replicas]), dim=dim)

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        n = x.shape[dim] // self.num_shards
        return x.narrow(dim, self.shard * n, n)


def head_reduction(num_kv_heads: int) -> HeadReduction:
    """The reduction a method of this rank uses for a model of ``num_kv_heads`` KV heads (the identity
    on one rank)."""
    return HeadReduction() if tp_world_size() == 1 else RankHeadReduction(num_kv_heads)
