"""Prefill attention methods: a ``prefill_sparse_method`` that changes only how prefill chunks attend.

Such a method is an axis of its own (FlashPrefill, block-sparse prefill): it composes with every
``sparse_method``, which keeps its KV store, its selection and its evictions, and it never touches
what is stored (keys and values are stored before attention), only the attention output of prefill
chunks. The engine asks it for a prefill wrapper with ``BatchPrefillWithPagedKVCache``'s plan/run
interface and runs that in place of the dense prefill kernel; nothing else changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from sparse_methods.base import MethodConfig


class PrefillAttention(ABC):
    """Base of prefill attention methods: a validated config and a factory of prefill wrappers."""

    name: ClassVar[str]
    Config: ClassVar[type[MethodConfig]]

    def __init__(self, config: MethodConfig):
        if not isinstance(config, self.Config):
            raise TypeError(f"{self.name} needs a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config

    def fingerprint(self) -> dict:
        """What the attention output (so every later layer's KV) depends on: goes into cache salts."""
        return {"prefill_sparse_method": self.name, **self.config.model_dump()}

    @abstractmethod
    def prefill_wrapper(self, device: torch.device) -> Any:
        """A new wrapper with ``BatchPrefillWithPagedKVCache``'s ``plan(...)`` / ``run(q, k_cache, v_cache,
        out=None)``, for the engine's prefill chunks on ``device``."""
