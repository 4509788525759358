"""``load_model``: config.json -> registered model class -> weights (from safetensors, or dummy)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from sparse_models.checkpoint import iter_tensors, safetensors_files
from sparse_models.config import ModelConfig
from sparse_models.dummy import fill_dummy_weights
from sparse_models.registry import get_model_class
from sparse_models.weights import load_weights


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_format: Literal["auto", "dummy"] = "auto",
    seed: int = 0,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model a checkpoint directory describes and load its weights.

    Parameters
    ----------
    path : directory holding ``config.json`` and (unless dummy) safetensors weights, single file or
        sharded with ``model.safetensors.index.json``.
    dtype : parameter dtype. Default: float32 on CPU; elsewhere the config's dtype, else float32.
    device : where parameters are allocated; weights are copied there tensor by tensor.
    load_format : ``"auto"`` reads safetensors; ``"dummy"`` reads only config.json and fills
        random weights (``seed``) for benchmarks.
    seed : seed of the dummy weights.

    Returns
    -------
    (model, config) with the model in eval mode.

    Raises
    ------
    UnsupportedArchitectureError
        No model class is registered for the config's architecture.
    CheckpointError
        No weight files; a tensor missing, unexpected or of the wrong shape (named in the message).
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    dtype = dtype or _default_dtype(config, device)
    model_cls = get_model_class(config.architecture)
    files = safetensors_files(path) if load_format == "auto" else []  # fail before allocating
    with _build_context(device, dtype):
        model = model_cls(config)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        # A tied lm_head is the embedding; some checkpoints still store a copy, which is not a second parameter.
        skip = ("lm_head.weight",) if config.tie_word_embeddings else ()
        with torch.no_grad():
            load_weights(model, iter_tensors(files), skip=skip)
    return model.eval(), config


def _default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    # CPU half-precision matmuls are slow and some ops lack kernels; CPU runs are tests and references.
    if device.type == "cpu":
        return torch.float32
    return config.torch_dtype or torch.float32


@contextmanager
def _build_context(device: torch.device, dtype: torch.dtype):
    """Allocate parameters directly on ``device`` in ``dtype``: no fp32 or host copy of an 8B model."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)
