"""Chat template rendering: messages -> prompt text, as ``transformers``' ``apply_chat_template`` does.

The template comes from the tokenizer folder: ``chat_template.jinja``, else the ``chat_template``
of ``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is used).
A folder without one gets ``FALLBACK_CHAT_TEMPLATE``, ChatML (the format of Qwen and of the
embedded tiny model):

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

Templates run in jinja2's sandbox with the names HF templates expect: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception`` and a ``tojson``
filter. jinja2 is imported lazily: it comes with torch and is not a declared dependency here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages do not fit the template (for example roles that must alternate)."""


def _token_text(entry: Any) -> str:
    # tokenizer_config.json stores special tokens as a string or as {"content": ...}.
    if isinstance(entry, dict):
        return entry.get("content") or ""
    return entry or ""


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template; ``render(messages)`` returns the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", is_fallback: bool = False):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.source = source
        self.is_fallback = is_fallback
        self._template = env.from_string(source)
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        self.special_tokens = (bos_token, eos_token)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTemplate:
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            source = jinja_file.read_text()
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if not source:
            return cls(FALLBACK_CHAT_TEMPLATE, bos, eos, is_fallback=True)
        return cls(source, bos, eos)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Prompt text for ``messages`` (dicts with ``role`` and ``content``); ChatTemplateError on misuse."""
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
