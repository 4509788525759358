"""Decode batches on the fused projections (``DecoderLayer.decode_fused``) give the unfused model's
logits within bf16 rounding, and run only where they apply.

On CPU the Triton kernels run under the interpreter (``SPARSE_KERNELS_BACKEND=triton``); the unfused
reference is the HF-exact path (``reference``), itself checked against HF in ``test_parity``.
"""

from __future__ import annotations

import pytest
import torch

from sparse_models import load_model
from sparse_models.models import llama


def _counting(monkeypatch) -> list[int]:
    calls = []
    original = llama.DecoderLayer.decode_fused

    def counted(self, *args, **kwargs):
        calls.append(self.self_attn.layer_idx)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(llama.DecoderLayer, "decode_fused", counted)
    return calls


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])  # q/k norms; biases; rope scaling; window
def test_fused_decode_logits_equal_the_unfused_model(family, hf_checkpoint, random_batch, our_logits, monkeypatch):
    _, path = hf_checkpoint(family)
    model, config = load_model(path, dtype=torch.bfloat16)
    seqs = random_batch(config.vocab_size, seq_lens=(1, 1, 1, 1, 1))  # a decode batch: one token each
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", "reference")
    want = our_logits(model, seqs)
    calls = _counting(monkeypatch)
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", "triton")
    got = our_logits(model, seqs)
    assert calls == list(range(config.num_hidden_layers))  # every layer took the fused path
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_fused_path_only_where_it_applies(hf_checkpoint, random_batch, our_logits, monkeypatch):
    _, path = hf_checkpoint("qwen3")
    model, config = load_model(path, dtype=torch.bfloat16)
    calls = _counting(monkeypatch)
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", "reference")
    our_logits(model, random_batch(config.vocab_size, seq_lens=(1, 2)))
    assert not calls  # the reference backend: HF's ops
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", "triton")
    our_logits(model, random_batch(config.vocab_size, seq_lens=(9, 8)))
    assert not calls  # 17 rows: past the small-M kernel
    fp32, _ = load_model(path)
    our_logits(fp32, random_batch(config.vocab_size, seq_lens=(1, 2)))
    assert not calls  # fp32: F.linear's rows, not the bf16 kernel's


def test_moe_layers_keep_the_unfused_path(hf_checkpoint, random_batch, our_logits, monkeypatch):
    _, path = hf_checkpoint("qwen3_moe")
    model, config = load_model(path, dtype=torch.bfloat16)
    assert not model.model._fusable  # routed experts behind the post-attention norm
    calls = _counting(monkeypatch)
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", "triton")
    our_logits(model, random_batch(config.vocab_size, seq_lens=(1, 1)))
    assert not calls
