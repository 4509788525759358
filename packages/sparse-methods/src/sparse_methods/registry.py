"""The method registry: names -> classes, and building a method from flat parameters.

Parameters are one flat vocabulary (``sink_keep_tokens``, ``observation_window_size``, ...): the
same names appear in every method's config, in the engine config, on the CLI and in reports. A
parameter that the chosen method does not have is an error, never silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sparse_methods.base import MethodConfig, ModelShape, SparseMethod

_METHODS: dict[str, type[SparseMethod]] = {}
_PREFILL_METHODS: dict[str, frozenset[str]] = {}


def register(cls: type[SparseMethod]) -> type[SparseMethod]:
    """Class decorator adding a method under ``cls.name``."""
    if cls.name in _METHODS:
        raise ValueError(f"sparse method {cls.name!r} is already registered")
    _METHODS[cls.name] = cls
    return cls


def register_prefill_method(name: str, *, for_methods: frozenset[str]) -> None:
    """Declare a prefill variant ``name`` usable as ``prefill_sparse_method`` with ``for_methods``."""
    _PREFILL_METHODS[name] = frozenset(for_methods)


def method_names() -> list[str]:
    return sorted(_METHODS)


def prefill_method_names() -> list[str]:
    return sorted(_PREFILL_METHODS)


def get_method_class(name: str) -> type[SparseMethod]:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown sparse_method {name!r}; registered: {', '.join(method_names())}") from None


def check_prefill_method(sparse_method: str, prefill_sparse_method: str | None) -> None:
    if prefill_sparse_method is None:
        return
    allowed = _PREFILL_METHODS.get(prefill_sparse_method)
    if allowed is None:
        raise ValueError(
            f"unknown prefill_sparse_method {prefill_sparse_method!r}; registered: {', '.join(prefill_method_names())}"
        )
    if sparse_method not in allowed:
        raise ValueError(
            f"prefill_sparse_method {prefill_sparse_method!r} works with sparse_method in {sorted(allowed)}, "
            f"not {sparse_method!r}"
        )


def parameter_fields() -> dict[str, Any]:
    """Every method parameter name -> its pydantic FieldInfo (first declaration wins for defaults),
    except ``prefill_sparse_method``.

    Two methods declaring the same name must give it the same type (one vocabulary).
    """
    fields: dict[str, Any] = {}
    for cls in _METHODS.values():
        for name, info in cls.Config.model_fields.items():
            if name == "prefill_sparse_method":  # an engine field of its own, checked by check_prefill_method
                continue
            if name in fields and fields[name].annotation != info.annotation:
                raise TypeError(f"parameter {name!r} has different types in different methods")
            fields.setdefault(name, info)
    return fields


def make_config(name: str, prefill_sparse_method: str | None = None, **params: Any) -> MethodConfig:
    """Validate ``params`` against method ``name``'s config; a parameter it lacks is an error."""
    cls = get_method_class(name)
    unknown = sorted(set(params) - set(cls.Config.model_fields) - {"prefill_sparse_method"})
    if unknown:
        raise ValueError(
            f"sparse_method {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"its parameters: {', '.join(sorted(cls.Config.model_fields)) or '(none)'}"
        )
    check_prefill_method(name, prefill_sparse_method)
    if "prefill_sparse_method" in cls.Config.model_fields:
        params["prefill_sparse_method"] = prefill_sparse_method
    try:
        return cls.Config(**params)
    except ValidationError as e:
        raise ValueError(f"invalid parameters for sparse_method {name!r}: {e}") from None


def build_method(name: str, shape: ModelShape, prefill_sparse_method: str | None = None, **params: Any) -> SparseMethod:
    """Instantiate method ``name`` for a model of ``shape`` from flat parameters."""
    config = make_config(name, prefill_sparse_method, **params)
    return get_method_class(name)(config, shape)
