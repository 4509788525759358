"""Incremental detokenization and stop-string detection.

Decoding token by token breaks multi-byte characters and merges (a lone byte token is not text),
so each step decodes a short window ending at the new token and emits only the text that window
adds over the window's stable prefix, holding back while the tail is an incomplete character.
"""

from __future__ import annotations

from sparse_serve.tokenizer import Tokenizer

_WINDOW = 5  # tokens of left context kept so merges across the boundary decode the same


class IncrementalDetokenizer:
    """``include_stop``: the text keeps the stop string that ended it. ``skip_special_tokens``: special
    tokens (EOS, chat markers) add no text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_WINDOW:])  # only the prompt's tail affects the first output text
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token. Returns (new text, the stop string hit or None); text stops before a stop string."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append_checking_stop(delta)

    def _append_checking_stop(self, delta: str) -> tuple[str, str | None]:
        if not self.stop:
            self.text += delta
            return delta, None
        start = max(len(self.text) - self._max_stop + 1, 0)
        old_len = len(self.text)
        self.text += delta
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return delta, None
        cut, stop = min(hits)
        self.text = self.text[: cut + len(stop) if self.include_stop else cut]
        return self.text[old_len:], stop
