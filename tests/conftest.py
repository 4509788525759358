"""Shared fixtures for cross-package tests."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from tiny_models import family_config


@pytest.fixture(scope="session", autouse=True)
def _freeze_imports():
    """What the session imported before its first test (torch, transformers, every test module: ~500K objects)
    moves out of the collector's generations, so ``_free_engines``' collection after each test walks only what
    tests made since (0.25 s -> milliseconds a test; the engine freezes its start-up state the same way on a
    GPU). Unfrozen at the end, so that the interpreter's exit frees them as before."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _free_engines(_freeze_imports):
    """Collect each test's engines right after it: an engine's object graph has cycles, and its KV pool
    (up to ``cpu_kv_cache_gib``) would otherwise wait for a later cyclic collection, piling up GiBs."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family)`` -> (folder, HF model in eval mode, fp32)."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(family: str):
        if family not in made:
            config, cls = family_config(family)
            torch.manual_seed(1234)
            model = cls(config).eval()
            # HF initialises some biases to zero; random ones make the Qwen2 bias path observable.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0.0, 0.2)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            made[family] = (path, model)
        return made[family]

    return make
