"""Tensor-parallel linears (Megatron-LM's split, https://arxiv.org/abs/1909.08053).

A column-parallel layer keeps a slice of the output rows: its output is this rank's part (heads, MLP
channels) and needs no communication. A row-parallel layer keeps the matching slice of the input
columns; each rank's partial product is summed over the ranks (``all_reduce``), so the pair
``down(act(gate_up(x)))`` or ``o(attn(qkv(x)))`` costs one all-reduce. Weights load from the full
(logical) checkpoint tensors: each loader cuts its own slice, so every rank reads the same files and
dummy weights drawn at the logical shape (``param.logical_shape``) give every rank the same model.
On one rank these are exactly ``Linear`` / ``MergedLinear``.
"""

from __future__ import annotations

import torch
from torch import nn

from sparse_kernels import linear
from sparse_models.distributed import all_reduce, kv_head_shard, shard, tp_rank
from sparse_models.layers.linear import Linear, MergedLinear
from sparse_models.weights import check_shape, copy_checked


class MergedColumnParallelLinear(MergedLinear):
    """``MergedLinear`` holding, of each shard, the rows ``[start, start + size)`` of its full tensor.

    Parameters
    ----------
    in_features : input size (every rank reads the whole input).
    shards : ``{shard_id: (full_size, start, size)}``: the shard's full output size and this rank's rows.
    bias : whether every shard has a bias.
    """

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int, int]], bias: bool = False):
        super().__init__(in_features, {name: size for name, (_, _, size) in shards.items()}, bias)
        self.full_sizes = {name: full for name, (full, _, _) in shards.items()}
        self.starts = {name: start for name, (_, start, _) in shards.items()}
        full = sum(self.full_sizes.values())
        for param in self.parameters():
            param.logical_shape = (full, *param.shape[1:])

    @classmethod
    def even(cls, in_features: int, sizes: dict[str, int], bias: bool = False) -> MergedColumnParallelLinear:
        """Every shard split evenly over the ranks (gate/up, or one projection's heads)."""
        return cls(in_features, {name: (full, *shard(full, name)) for name, full in sizes.items()}, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # the full fused tensor (a fused checkpoint, or dummy weights)
            check_shape(loaded, param.logical_shape)
            for name, part in zip(self.full_sizes, loaded.split(list(self.full_sizes.values())), strict=True):
                self.weight_loader(param, part, name)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; this layer has {list(self.shard_offsets)}")
        check_shape(loaded, (self.full_sizes[shard_id], *param.shape[1:]))
        mine = loaded.narrow(0, self.starts[shard_id], self.shard_sizes[shard_id])
        copy_checked(param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id]), mine)


def qkv_parallel_linear(
    hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
) -> MergedColumnParallelLinear:
    """q/k/v of this rank's heads: ``num_heads / world`` query heads and their KV heads (replicated
    when there are fewer KV heads than ranks, see ``kv_head_shard``)."""
    q_start, q_count = shard(num_heads, "num_attention_heads")
    kv_start, kv_count = kv_head_shard(num_kv_heads)
    q = (num_heads * head_dim, q_start * head_dim, q_count * head_dim)
    kv = (num_kv_heads * head_dim, kv_start * head_dim, kv_count * head_dim)
    return MergedColumnParallelLinear(hidden_size, {"q": q, "k": kv, "v": kv}, bias)


def column_parallel_linear(in_features: int, out_features: int, bias: bool = False) -> MergedColumnParallelLinear:
    """One projection whose output rows (e.g. heads) are split evenly; loads as an unsharded tensor."""
    layer = MergedColumnParallelLinear.even(in_features, {"out": out_features}, bias)
    for param in layer.parameters():
        del param.shard_ids  # the checkpoint stores it whole: the loader calls with shard id None
    return layer


class RowParallelLinear(Linear):
    """``y = sum_ranks x_r W_r^T (+ b)``: this rank's input columns ``x_r`` (the previous column-parallel
    layer's output) times its columns of ``W``; the bias is added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.start, local = shard(in_features, "input features")
        super().__init__(local, out_features, bias)
        self.weight.logical_shape = (out_features, in_features)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard id {shard_id!r}")
        if param is self.weight:
            check_shape(loaded, param.logical_shape)
            loaded = loaded.narrow(1, self.start, param.shape[1])
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(linear(x, self.weight, self.bias if tp_rank() == 0 else None))
