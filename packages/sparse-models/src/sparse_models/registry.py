"""Model classes by HF ``architectures`` name.

A model file registers its class with ``@register_model("XForCausalLM")``; the loader finds it with
``get_model_class(config.architecture)``. Nothing else names model classes, so a new family is a
new file plus its decorator.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no registered model class."""


def register_model(*architectures: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator registering a model class under one or more HF architecture names.

    The class must be constructible as ``cls(config: ModelConfig)`` and provide
    ``forward(input_ids, positions, attn)`` and ``compute_logits(hidden)``.
    """
    if not architectures:
        raise ValueError("register_model needs at least one architecture name")

    def decorator(cls: type[nn.Module]) -> type[nn.Module]:
        for arch in architectures:
            if arch in _MODELS and _MODELS[arch] is not cls:
                raise ValueError(f"architecture {arch!r} is already registered to {_MODELS[arch].__name__}")
            _MODELS[arch] = cls
        return cls

    return decorator


def is_registered(architecture: str) -> bool:
    return architecture in _MODELS


def supported_architectures() -> list[str]:
    """Registered architecture names, sorted."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class registered for ``architecture``.

    Raises
    ------
    UnsupportedArchitectureError
        Nothing is registered under that name; the message lists what is.
    """
    try:
        return _MODELS[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {supported_architectures()}"
        ) from None
