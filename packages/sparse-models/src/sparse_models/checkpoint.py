"""Finding a checkpoint's safetensors files and streaming their tensors one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from sparse_models.weights import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(path: str | Path) -> list[Path]:
    """The files that hold a checkpoint's weights, in load order.

    The shard index wins, then a single ``model.safetensors``, then any ``*.safetensors`` except
    Mistral's ``consolidated*`` files (the same weights again, under other names).

    Raises
    ------
    CheckpointError
        No weight files, or the index names a file that is not there.
    """
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard files that do not exist: {absent}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise CheckpointError(
            f"no safetensors weights in {path} (looked for {INDEX_FILE}, {SINGLE_FILE}, *.safetensors)"
        )
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every file, reading each only when asked for.

    Tensors come on the CPU; the parameter's loader copies them to the model's device and dtype,
    so peak host memory is one tensor, not the checkpoint.
    """
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
