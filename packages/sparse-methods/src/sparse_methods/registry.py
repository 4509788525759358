"""The method registry: names -> classes, and building a method from flat parameters.

Parameters are one flat vocabulary (``sink_keep_tokens``, ``observation_window_size``, ...): the
same names appear in every method's config, in the engine config, on the CLI and in reports. A
parameter that the chosen method does not have is an error, never silently dropped.

A ``prefill_sparse_method`` is either a variant of given methods (``h2o_prefill``: a field of the
method's own config) or a prefill attention method usable with any method (``flashprefill_v2``: its own
config, ``PrefillAttention``); the latter's parameters sit in the same flat vocabulary.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sparse_methods.base import MethodConfig, ModelShape, SparseMethod
from sparse_methods.prefill_attention import PrefillAttention

ANY_METHOD = "any"
_METHODS: dict[str, type[SparseMethod]] = {}
_ALIASES: dict[str, str] = {}  # another spelling -> the registered name
_PREFILL_METHODS: dict[str, frozenset[str] | str] = {}
_PREFILL_ATTENTION: dict[str, type[PrefillAttention]] = {}


def register(cls: type[SparseMethod]) -> type[SparseMethod]:
    """Class decorator adding a method under ``cls.name`` (and its ``aliases``, other spellings, if it has any)."""
    aliases = getattr(cls, "aliases", ())
    for name in (cls.name, *aliases):
        if name in _METHODS or name in _ALIASES:
            raise ValueError(f"sparse method {name!r} is already registered")
    _METHODS[cls.name] = cls
    _ALIASES.update(dict.fromkeys(aliases, cls.name))
    return cls


def canonical_method_name(name: str) -> str:
    """The registered name of ``name`` (itself, or what the alias stands for: ``skip-kv`` -> ``skipkv``)."""
    return _ALIASES.get(name, name)


def register_prefill_method(name: str, *, for_methods: frozenset[str] | str) -> None:
    """Declare a prefill variant ``name`` usable as ``prefill_sparse_method`` with ``for_methods``
    (or with every method: ``ANY_METHOD``)."""
    _PREFILL_METHODS[name] = for_methods if for_methods == ANY_METHOD else frozenset(for_methods)


def register_prefill_attention(cls: type[PrefillAttention]) -> type[PrefillAttention]:
    """Class decorator adding a prefill attention method, usable with every ``sparse_method``."""
    if cls.name in _PREFILL_METHODS:
        raise ValueError(f"prefill_sparse_method {cls.name!r} is already registered")
    register_prefill_method(cls.name, for_methods=ANY_METHOD)
    _PREFILL_ATTENTION[cls.name] = cls
    return cls


def parameter_owners() -> dict[str, type[MethodConfig]]:
    """Each method's and each prefill attention method's config, by name (methods first, sorted)."""
    return {**{n: _METHODS[n].Config for n in method_names()}, **{n: c.Config for n, c in _PREFILL_ATTENTION.items()}}


def method_names() -> list[str]:
    return sorted(_METHODS)


def prefill_method_names() -> list[str]:
    return sorted(_PREFILL_METHODS)


def get_method_class(name: str) -> type[SparseMethod]:
    try:
        return _METHODS[canonical_method_name(name)]
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
    if allowed != ANY_METHOD and sparse_method not in allowed:
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
    for config in parameter_owners().values():
        for name, info in config.model_fields.items():
            if name == "prefill_sparse_method":  # an engine field of its own, checked by check_prefill_method
                continue
            if name in fields and fields[name].annotation != info.annotation:
                raise TypeError(f"parameter {name!r} has different types in different methods")
            fields.setdefault(name, info)
    return fields


def make_config(name: str, prefill_sparse_method: str | None = None, **params: Any) -> MethodConfig:
    """Validate ``params`` against method ``name``'s config (and the prefill attention method's, if one is
    chosen); a parameter neither has is an error."""
    name = canonical_method_name(name)
    cls = get_method_class(name)
    check_prefill_method(name, prefill_sparse_method)
    own, prefill = _split_prefill_params(prefill_sparse_method, params)
    unknown = sorted(set(own) - set(cls.Config.model_fields) - {"prefill_sparse_method"})
    if unknown:
        raise ValueError(
            f"sparse_method {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"its parameters: {', '.join(sorted(cls.Config.model_fields)) or '(none)'}"
        )
    make_prefill_attention(prefill_sparse_method, **prefill)
    if "prefill_sparse_method" in cls.Config.model_fields:
        own["prefill_sparse_method"] = None if prefill_sparse_method in _PREFILL_ATTENTION else prefill_sparse_method
    try:
        return cls.Config(**own)
    except ValidationError as e:
        raise ValueError(f"invalid parameters for sparse_method {name!r}: {e}") from None


def make_prefill_attention(prefill_sparse_method: str | None, **params: Any) -> PrefillAttention | None:
    """The prefill attention method ``prefill_sparse_method`` names, from its flat parameters (None when
    it names none: no prefill method, or a variant that lives in the method's own config)."""
    cls = _PREFILL_ATTENTION.get(prefill_sparse_method)
    if cls is None:
        return None
    try:
        return cls(cls.Config(**params))
    except ValidationError as e:
        raise ValueError(f"invalid parameters for prefill_sparse_method {prefill_sparse_method!r}: {e}") from None


def _split_prefill_params(prefill_sparse_method: str | None, params: dict[str, Any]) -> tuple[dict, dict]:
    """``params`` split into the method's and the chosen prefill attention method's; a parameter of a
    prefill attention method that is not chosen is an error."""
    chosen = _PREFILL_ATTENTION.get(prefill_sparse_method)
    own, prefill = {}, {}
    for key, value in params.items():
        owner = next((n for n, c in _PREFILL_ATTENTION.items() if key in c.Config.model_fields), None)
        if owner is None:
            own[key] = value
        elif chosen is not None and owner == chosen.name:
            prefill[key] = value
        else:
            raise ValueError(f"{key} is a parameter of prefill_sparse_method {owner!r}, which is not chosen")
    return own, prefill


def build_method(name: str, shape: ModelShape, prefill_sparse_method: str | None = None, **params: Any) -> SparseMethod:
    """Instantiate method ``name`` for a model of ``shape`` from flat parameters (with its prefill
    attention method, ``method.prefill_attention``, when ``prefill_sparse_method`` names one)."""
    config = make_config(name, prefill_sparse_method, **params)
    method = get_method_class(name)(config, shape)
    _, prefill = _split_prefill_params(prefill_sparse_method, params)
    method.prefill_attention = make_prefill_attention(prefill_sparse_method, **prefill)
    return method
