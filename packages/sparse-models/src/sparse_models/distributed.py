"""Tensor parallelism's process-wide state: this process's rank among ``world_size`` and the collectives
the parallel layers call (Megatron-LM, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053).

One process per rank; every rank builds the same model class, and each parallel layer keeps its slice
of the weights (``shard``) and calls ``all_reduce`` / ``all_gather`` where its partial results meet.
Without ``init_tensor_parallel`` (or with one rank) the state is rank 0 of 1 and every collective is the
identity, so single-process code never touches ``torch.distributed``. The state is per process on
purpose: model constructors stay ``model_cls(config)``, as checkpoints and the registry expect.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from sparse_models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1


_state = TensorParallel()


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str | None = None) -> None:
    """Join (or, with one rank, skip) the process group: NCCL when CUDA is available, else gloo."""
    global _state
    if world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _state = TensorParallel(rank, world_size)


def shutdown_tensor_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel()


def tp_rank() -> int:
    return _state.rank


def tp_world_size() -> int:
    return _state.world_size


def shard(size: int, what: str) -> tuple[int, int]:
    """``(start, length)`` of this rank's even slice of ``size`` (heads, channels, ...)."""
    world = _state.world_size
    if size % world:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({world})")
    n = size // world
    return _state.rank * n, n


def kv_head_shard(num_kv_heads: int) -> tuple[int, int]:
    """``(first KV head, count)`` this rank holds: an even split, or one replicated head when there are
    fewer KV heads than ranks (rank r then serves the query heads of KV head ``r // (world / Hkv)``)."""
    world = _state.world_size
    if num_kv_heads >= world:
        return shard(num_kv_heads, "num_key_value_heads")
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({world}) is not a multiple of num_key_value_heads ({num_kv_heads})")
    return _state.rank // (world // num_kv_heads), 1


def rank_attention_config(config: ModelConfig) -> ModelConfig:
    """``config`` with this rank's attention heads: its query heads and the KV heads it holds (what its
    KV pool and kernels see; an MLA model's one latent head is held whole by every rank)."""
    _, num_heads = shard(config.num_attention_heads, "num_attention_heads")
    _, num_kv_heads = kv_head_shard(config.num_key_value_heads)
    return replace(config, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads)


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (``op="max"``: the maximum of) ``x`` over the ranks, in place (the identity on one rank)."""
    if _state.world_size > 1:
        dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def gather_kv_group_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``x [..., local heads, D]``: this rank's query heads -> the query heads of its KV heads.

    With at least as many KV heads as ranks every KV group lies on one rank and ``x`` is returned.
    With fewer, a KV head is replicated over ``world / Hkv`` ranks that each hold part of its group;
    their heads are gathered in rank order, so each of them sees the whole group (what a selection
    shared by the group, e.g. a max or mean over its query heads, needs).
    """
    world = _state.world_size
    if num_kv_heads >= world:
        return x
    replicas = world // num_kv_heads
    first = (_state.rank // replicas) * replicas
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts[first : first + replicas], dim=-2)


def local_group_heads(x: torch.Tensor, num_local: int, dim: int = -2) -> torch.Tensor:
    """This rank's ``num_local`` query heads of ``x``, whose ``dim`` holds what ``gather_kv_group_heads``
    gathered (its KV heads' whole groups): the inverse of that gather (``x`` itself on a rank that holds
    whole groups)."""
    replicas = x.shape[dim] // num_local
    if replicas == 1:
        return x
    return x.narrow(dim, (_state.rank % replicas) * num_local, num_local)


def min_over_ranks(n: int) -> int:
    """The smallest of every rank's ``n`` (e.g. KV blocks: one scheduler plans for all ranks)."""
    if _state.world_size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_object(obj=None, src: int = 0):
    """``obj`` from rank ``src`` on every rank (pickled; for small host-side messages)."""
    if _state.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
