"""Linear layers whose parameters know how to load themselves.

``MergedLinear`` stacks several projections that read the same input (q/k/v, gate/up) into one
matmul. Checkpoints store them apart, so its loader takes a shard id and writes the rows that
shard owns; a checkpoint that already stores the fused tensor loads whole (shard id None).
"""

from __future__ import annotations

import torch
from torch import nn

from sparse_kernels import linear
from sparse_models.weights import copy_checked


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W [out, in]``, allocated uninitialised (the loader fills it).

    Decode's few-row inputs on CUDA run ``sparse_kernels.linear``'s single-launch small-M kernel;
    everything else (and every CPU input) is ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard id {shard_id!r}")
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input, stacked along the output dim in the order given.

    Parameters
    ----------
    in_features : input size shared by all shards.
    shard_sizes : ``{shard_id: out_features}``, e.g. ``{"q": Hq*D, "k": Hkv*D, "v": Hkv*D}``.
    bias : whether every shard has a bias.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size
        for param in self.parameters():
            param.shard_ids = tuple(shard_sizes)  # lets the loader tell a partly loaded param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            copy_checked(param.data, loaded)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; this layer has {list(self.shard_offsets)}")
        # Rows [offset, offset + size) belong to this shard, for the weight [out, in] and bias [out] alike.
        copy_checked(param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id]), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Undo the stacking on an output ``[..., sum(sizes)]`` -> one view per shard."""
        return y.split(list(self.shard_sizes.values()), dim=-1)
