"""Help text for the method-parameter flags: one flag serves every method that has the parameter, so
its help says, per method, what the parameter means there and its default."""

from __future__ import annotations

import sparse_methods


def method_parameter_help(name: str) -> str:
    """``"[pyramidkv, snapkv] <description> (default 7616); [omnikv] <description> (default 4096)"``: methods
    with the same description and default grouped, in registry order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for method, config in sparse_methods.parameter_owners().items():
        info = config.model_fields.get(name)
        if info is not None:
            key = ((info.description or "").rstrip("."), repr(info.default))
            groups.setdefault(key, []).append(method)
    return "; ".join(f"[{', '.join(ms)}] {desc} (default {default})" for (desc, default), ms in groups.items())
