"""HF ``tokenizer.json`` tokenizers, through the ``tokenizers`` library."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(entry) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as {"content": ...}.
    if isinstance(entry, dict):
        return entry.get("content")
    return entry


class Tokenizer:
    """Encode/decode plus the ids that end generation (EOS from the tokenizer and generation config)."""

    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: frozenset[int]):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str | Path, extra_eos_token_ids=()) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (pass token ids instead of text, or a tokenizer path)")
        tok = _HFTokenizer.from_file(str(file))
        eos: set[int] = set(extra_eos_token_ids)
        eos_text = _token_text(_read_json(path / "tokenizer_config.json").get("eos_token"))
        if eos_text is not None and tok.token_to_id(eos_text) is not None:
            eos.add(tok.token_to_id(eos_text))
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if gen_eos is not None:
            eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return cls(tok, frozenset(eos))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary's longest entry (byte-level
        entries spell one character per byte, and text has at most as many characters as bytes)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
