"""Backend choice: auto picks Triton on CUDA and the reference on CPU; argument > environment > auto."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BACKEND_ENV, BatchDecodeWithPagedKVCache, resolve_backend


def test_auto_follows_device(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("auto", "cuda") == "triton"  # resolving needs no GPU, only an importable triton


def test_environment_overrides_auto_but_not_an_explicit_choice(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend("auto", "cpu") == "triton"
    assert resolve_backend("reference", "cpu") == "reference"
    assert BatchDecodeWithPagedKVCache("cpu").backend == "triton"
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert resolve_backend("auto", "cuda") == "reference"
    assert resolve_backend("triton", "cpu") == "triton"


def test_unknown_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", "cpu")
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend("auto", torch.device("cpu"))
