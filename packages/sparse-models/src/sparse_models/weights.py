"""Routing checkpoint tensors into parameters.

Each parameter carries its own ``weight_loader(param, loaded[, shard_id])``; a merged projection
(qkv, gate_up) knows where each of its shards goes. The model class names which checkpoint modules
were merged into which of its own in ``packed_modules_mapping``, e.g.
``{"q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", "gate")}``. This file only matches
names, calls loaders and keeps the books: which parameters (and which of their shards) were
filled, so that a missing tensor is an error rather than silent garbage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint does not match the model: missing, unexpected or misshaped tensors, or no files."""


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a whole tensor into ``param`` (casting dtype, moving device)."""
    copy_checked(param.data, loaded)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` with an exact shape check (copy_ would silently broadcast)."""
    check_shape(src, dst.shape)
    dst.copy_(src)


def check_shape(src: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """A checkpoint tensor has exactly ``expected``'s shape (a tensor-parallel slice checks the full
    tensor before cutting its part)."""
    if tuple(src.shape) != tuple(expected):
        raise ValueError(f"shape mismatch: checkpoint has {tuple(src.shape)}, parameter expects {tuple(expected)}")


def _route(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """Map a checkpoint name to ``(parameter name, shard id or None)`` through the packing table."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            merged, shard_id = packed[part]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), shard_id
    return name, None


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], skip: Iterable[str] = ()) -> None:
    """Load ``(checkpoint name, tensor)`` pairs into ``model``'s parameters, then check completeness.

    Parameters
    ----------
    model : a registered model; may define ``packed_modules_mapping``, ``skip_checkpoint_suffixes``
        (names of tensors that are not parameters, e.g. ``rotary_emb.inv_freq``) and
        ``route_checkpoint_name(name) -> (parameter name, shard id) | None``, tried first, for names
        the packing table cannot express (one tensor per expert stacked into one parameter).
    tensors : pairs in any order; consumed lazily so a checkpoint streams tensor by tensor.
    skip : further exact checkpoint names to ignore (e.g. ``lm_head.weight`` when it is tied).

    Raises
    ------
    CheckpointError
        An unexpected or misshaped tensor (named), or parameters left unloaded (all named).
    """
    packed = getattr(model, "packed_modules_mapping", {})
    route = getattr(model, "route_checkpoint_name", lambda name: None)
    suffixes = tuple(getattr(model, "skip_checkpoint_suffixes", ()))
    skip = set(skip)
    params = dict(model.named_parameters())
    filled: dict[str, set[str | None]] = {name: set() for name in params}
    for ckpt_name, tensor in tensors:
        if ckpt_name in skip or (suffixes and ckpt_name.endswith(suffixes)):
            continue
        param_name, shard_id = route(ckpt_name) or _route(ckpt_name, packed)
        param = params.get(param_name)
        if param is None:
            raise CheckpointError(f"unexpected tensor {ckpt_name!r} in checkpoint (no parameter {param_name!r})")
        loader = getattr(param, "weight_loader", None)
        try:
            if shard_id is None:
                (loader or default_weight_loader)(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise CheckpointError(f"tensor {ckpt_name!r} -> {param_name!r}: {e}") from e
        filled[param_name].add(shard_id)
    missing = [n for name, shards in filled.items() for n in _missing_names(name, params[name], shards, packed)]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): {missing}")


def _missing_names(
    name: str, param: nn.Parameter, shards: set[str | None], packed: dict[str, tuple[str, str]]
) -> list[str]:
    """Checkpoint names still owed to ``name``: none once written whole, else its unwritten shards."""
    if None in shards:
        return []
    expected = getattr(param, "shard_ids", None)
    if expected is None:
        return [] if shards else [name]
    unpacked = {target: source for source, target in packed.items()}  # ("qkv_proj", "q") -> "q_proj"
    parts = name.split(".")
    owed = []
    for shard_id in expected:
        if shard_id in shards:
            continue
        for i, part in enumerate(parts):  # name the tensor the checkpoint should have had
            if (part, shard_id) in unpacked:
                owed.append(".".join([*parts[:i], unpacked[(part, shard_id)], *parts[i + 1 :]]))
                break
        else:
            owed.append(f"{name}[{shard_id}]")
    return owed
