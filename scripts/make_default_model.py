"""Write the embedded default model: a tiny random Qwen3 checkpoint in HF format with a BPE tokenizer.

The weights are random (a trained tiny model replaces them in a later issue); the point is a real
HF-format folder that the README's main command can load on any machine without a model hub.
The tokenizer is a byte-level BPE trained on the docstrings of the Python standard library, so it
is reproducible from what every machine has. Run from the repo root:

    uv run python scripts/make_default_model.py
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).resolve().parents[1] / "packages/sparse-serve/src/sparse_serve/assets/tiny-qwen3"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def stdlib_docstrings(limit_bytes: int = 4_000_000):
    """Yield docstrings of the standard library's modules, classes and functions (deterministic order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    total += len(doc)
                    yield doc
                    if total > limit_bytes:
                        return


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_docstrings(), trainer=trainer)
    return tok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(args.vocab_size)
    tok.save(str(args.out / "tokenizer.json"))
    eos_id = tok.token_to_id("<|endoftext|>")
    (args.out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}, indent=2)
    )
    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    (args.out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
