from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_serve.detokenizer import IncrementalDetokenizer
from sparse_serve.tokenizer import Tokenizer

ASSET = Path(__file__).resolve().parents[1] / "src/sparse_serve/assets/tiny-retrieval"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(ASSET)


@pytest.mark.parametrize("text", ["Return the value of x.", "naïve café — ünïcode ✓ 你好", "a\n\tb  c"])
def test_incremental_equals_full_decode(tok, text):
    prompt = tok.encode("Hello")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add(t)[0] for t in ids]
    assert "".join(pieces) == d.text == tok.decode(ids)


def test_stop_string_truncates_and_reports(tok):
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=("STOP",))
    hit = None
    for t in ids:
        _, hit = d.add(t)
        if hit:
            break
    assert hit == "STOP" and d.text == "alpha beta "


def test_eos_from_tokenizer_and_generation_config(tok):
    # <|endoftext|> from tokenizer_config.json, <|im_end|> too from generation_config.json.
    ids = {tok.encode(t, add_special_tokens=False)[0] for t in ("<|endoftext|>", "<|im_end|>")}
    assert len(ids) == 2 and tok.eos_token_ids == ids


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=40), st.integers(0, 8))
def test_incremental_equals_full_decode_on_any_text(tok, text, prompt_len):
    prompt = tok.encode("Return the value " * 2)[:prompt_len]
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(d.add(t)[0] for t in ids)
    full = tok.decode(ids)
    # Held-back text is only ever an incomplete character at the very end.
    assert streamed == d.text and full.startswith(streamed)
    assert full == streamed or full.endswith("\ufffd")
