"""Train the tiny long-context retrieval model (tokenizer, data, model, eval) in under ten minutes on one GPU.

Everything comes from the Python standard library's docstrings: a byte-level BPE tokenizer (digits
split one per token, so numbers copy digit by digit), synthetic RULER/NIAH tasks from
``sparse_serve.eval.tasks`` (loss on the answer tokens only) and plain docstring text (loss on every
token) so the model also continues text readably. The model is a transformers ``Qwen3ForCausalLM``
trained under bf16 autocast with AdamW and a cosine schedule; contexts grow from 256 to 4096 tokens.
At the end it saves an HF folder (bf16 weights, tokenizer, ChatML chat template, generation config),
measures dense greedy exact-match accuracy per task and context length, and writes a model card.

    python3 scripts/train_tiny_model.py --out DIR --minutes 9            # on the GPU
    python3 scripts/train_tiny_model.py --out /tmp/m --minutes 0.3 --device cpu --tiny   # smoke test

``--minutes`` bounds the whole run (tokenizer, training, saving, evaluation); ``--resume`` continues
from ``--ckpt`` with the training time that is left.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch.utils.data import DataLoader, IterableDataset


def _load_tasks():
    """Import ``sparse_serve/eval/tasks.py`` by path: it is pure Python, and the package's ``__init__``
    pulls in engine dependencies (pydantic, ...) that a bare GPU box may lack."""
    path = Path(__file__).resolve().parents[1] / "packages/sparse-serve/src/sparse_serve/eval/tasks.py"
    spec = importlib.util.spec_from_file_location("sparse_serve_eval_tasks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


_tasks = _load_tasks()
TASKS, Haystack, make_sample, token_counter = _tasks.TASKS, _tasks.Haystack, _tasks.make_sample, _tasks.token_counter

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Share of rows per task in a training batch; single-key retrieval is the headline target.
MIX = {"text": 0.15, "niah_single": 0.30, "niah_multikey": 0.20, "niah_multivalue": 0.12,
       "variable_tracking": 0.11, "multiturn_recall": 0.12}  # fmt: skip
BUCKETS = (256, 512, 1024, 2048, 4096)
EVAL_LENGTHS = (512, 1024, 2048, 4096)
EVAL_DEPTHS = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output HF model folder")
    p.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of the whole run")
    p.add_argument("--ckpt", type=Path, default=None, help="checkpoint file (default: OUT.ckpt.pt beside OUT)")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a very small model and batch for CPU smoke tests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=131072)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--eval-samples", type=int, default=36, help="samples per (task, length) cell")
    p.add_argument("--eval-seconds", type=float, default=75.0, help="time reserved for saving and evaluation")
    p.add_argument("--haystack-chars", type=int, default=4_000_000)
    args = p.parse_args()
    if args.tiny:
        args.tokens_per_step, args.vocab_size, args.eval_samples = 4096, 1024, 3
    args.ckpt = args.ckpt or args.out.with_name(args.out.name + ".ckpt.pt")
    return args


def train_tokenizer(haystack: Haystack, vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the haystack; digits are pre-split so every number is one token per digit."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(haystack.lines, trainer=trainer)
    return tok


def model_config(vocab_size: int, tiny: bool):
    from transformers import Qwen3Config

    size = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32) if tiny else \
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64)  # fmt: skip
    return Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=[0, 2],
        pad_token_id=0,
        **size,
    )


class TaskBatches(IterableDataset):
    """Endless batches ``(input_ids, labels, is_text)``, one context-length bucket per batch.

    The shared ``progress`` (0..1, elapsed training time) drives the length curriculum in every worker.
    """

    def __init__(self, tok: Tokenizer, haystack: Haystack, tokens_per_step: int, progress, seed: int, tiny: bool):
        self.tok, self.haystack, self.tokens_per_step = tok, haystack, tokens_per_step
        self.progress, self.seed, self.tiny = progress, seed, tiny
        self.end_ids = {"plain": tok.token_to_id("<|endoftext|>"), "chat": tok.token_to_id("<|im_end|>")}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1000 + (info.id if info else 0) + int(time.time() * 1e3) % 100000)
        while True:
            yield self.batch(rng, self.bucket(rng))

    def bucket(self, rng: random.Random) -> int:
        if self.tiny:
            return rng.choice((256, 512))
        p = self.progress.value
        allowed = BUCKETS[:3] if p < 0.08 else BUCKETS[:4] if p < 0.2 else BUCKETS
        weights = [1.0] * len(allowed) if p < 0.45 else [1.0, 1.0, 1.5, 2.0, 3.0]
        return rng.choices(allowed, weights=weights[: len(allowed)])[0]

    def row(self, rng: random.Random, length: int) -> tuple[list[int], list[int], bool]:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if kind == "text":
            ids = self.tok.encode(self.haystack.text(rng, length * 6)).ids[:length]
            return ids, ids, True
        depth = rng.choice((0.0, 1.0)) if rng.random() < 0.1 else rng.random()
        context_length = int(length * rng.uniform(0.7, 1.04))
        try:
            sample = make_sample(kind, context_length, depth, rng, self.tok, self.haystack)
        except ValueError:  # too short for this task's fixed text: fall back to the shortest task
            kind = "niah_single"
            sample = make_sample(kind, max(context_length, 128), depth, rng, self.tok, self.haystack)
        prompt = self.tok.encode(sample.prompt).ids
        end = self.end_ids["chat" if kind == "multiturn_recall" else "plain"]
        answer = self.tok.encode(sample.answer).ids + [end]
        return prompt + answer, [-100] * len(prompt) + answer, False

    def batch(self, rng: random.Random, length: int):
        rows = [self.row(rng, length) for _ in range(max(1, self.tokens_per_step // length))]
        width = max(len(ids) for ids, _, _ in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # right padding with id 0: causal, no mask
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (ids, lab, _) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
        return input_ids, labels, torch.tensor([t for _, _, t in rows])


def loss_fn(model, input_ids, labels, is_text):
    """Cross entropy on labelled positions only: task rows' answers, text rows' every token.

    The two parts are averaged separately and summed (text weighted 0.5), so the few answer tokens
    are not drowned by the many text tokens. The LM head runs only on labelled positions.
    """
    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [B, T-1, H]
    targets = labels[:, 1:]
    mask = targets != -100
    logits = model.lm_head(hidden[mask]).float()  # [N, V]
    ce = F.cross_entropy(logits, targets[mask], reduction="none")
    text_tok = is_text[:, None].expand_as(mask)[mask]
    task_loss = ce[~text_tok].mean() if (~text_tok).any() else ce.new_zeros(())
    text_loss = ce[text_tok].mean() if text_tok.any() else ce.new_zeros(())
    return task_loss + 0.5 * text_loss, task_loss.detach(), text_loss.detach()


def lr_at(step: int, progress: float, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args, tok: Tokenizer, haystack: Haystack, t_start: float) -> tuple[torch.nn.Module, dict]:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    config = model_config(tok.get_vocab_size(), args.tiny)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").to(args.device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=args.device.startswith("cuda"))  # fmt: skip
    log = {"step": 0, "tokens": 0, "train_seconds": 0.0, "curve": []}
    if args.resume and args.ckpt.is_file():
        state = torch.load(args.ckpt, map_location=args.device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        log = state["log"]
        print(f"resumed from {args.ckpt} at step {log['step']}", flush=True)
    budget = args.minutes * 60 - args.eval_seconds - (time.time() - t_start)  # training seconds this run
    total_train = log["train_seconds"] + max(budget, 1.0)
    progress = mp.Value("d", log["train_seconds"] / total_train)
    data = TaskBatches(tok, haystack, args.tokens_per_step, progress, args.seed + log["step"], args.tiny)
    loader = DataLoader(data, batch_size=None, num_workers=args.workers, prefetch_factor=4,
                        pin_memory=args.device.startswith("cuda"), persistent_workers=False)  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, training for {budget:.0f}s, {args.workers} workers", flush=True)
    model.train()
    t0, last_ckpt, window = time.time(), time.time(), []
    amp = torch.autocast("cuda" if args.device.startswith("cuda") else "cpu", dtype=torch.bfloat16)
    for input_ids, labels, is_text in loader:
        elapsed = log["train_seconds"] + time.time() - t0
        progress.value = elapsed / total_train
        if elapsed >= total_train:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(log["step"], progress.value, args)
        input_ids, labels = input_ids.to(args.device, non_blocking=True), labels.to(args.device, non_blocking=True)
        with amp:
            loss, task_loss, text_loss = loss_fn(model, input_ids, labels, is_text.to(args.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log["step"] += 1
        log["tokens"] += input_ids.numel()
        window.append((task_loss, text_loss))
        if log["step"] % 25 == 0:
            tl, xl = (torch.stack(v).mean().item() for v in zip(*window, strict=True))
            window = []
            log["curve"].append({"step": log["step"], "seconds": round(elapsed, 1), "tokens": log["tokens"],
                                 "seq_len": input_ids.shape[1], "task_loss": round(tl, 4), "text_loss": round(xl, 4),
                                 "lr": opt.param_groups[0]["lr"]})  # fmt: skip
            if log["step"] % 100 == 0:
                print(json.dumps(log["curve"][-1]), flush=True)
        if time.time() - last_ckpt > 90:
            save_checkpoint(args, model, opt, log, t0)
            last_ckpt = time.time()
    log["train_seconds"] += time.time() - t0
    log["params"] = n_params
    save_checkpoint(args, model, opt, log, None)
    return model, log


def save_checkpoint(args, model, opt, log, t0) -> None:
    state_log = dict(log, train_seconds=log["train_seconds"] + (time.time() - t0 if t0 else 0.0))
    args.ckpt.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "log": state_log}, str(args.ckpt) + ".tmp")
    os.replace(str(args.ckpt) + ".tmp", args.ckpt)


def save_model(args, model, tok: Tokenizer) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": 8192, "chat_template": CHAT_TEMPLATE}, indent=2))  # fmt: skip
    (args.out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0, "do_sample": False}, indent=2))  # fmt: skip


@torch.no_grad()
def evaluate(args, tok: Tokenizer, haystack: Haystack, deadline: float) -> dict:
    """Dense greedy exact match per (task, context length) on the saved folder, through transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(args.device).eval()
    count = token_counter(tok)
    cells, by_depth, skipped = {}, {}, []
    order = [("niah_single", n) for n in EVAL_LENGTHS] + [(t, n) for t in TASKS[1:] for n in EVAL_LENGTHS]
    for task, length in order:
        if time.time() > deadline:
            skipped.append(f"{task}@{length}")
            continue
        rng = random.Random(f"eval-{args.seed}-{task}-{length}")  # str seeds are stable across processes
        samples = [make_sample(task, length, EVAL_DEPTHS[i % len(EVAL_DEPTHS)], rng, count, haystack)
                   for i in range(args.eval_samples)]  # fmt: skip
        correct = []
        batch = max(1, min(len(samples), 131072 // length)) if args.device.startswith("cuda") else 4
        for i in range(0, len(samples), batch):
            correct += generate_and_score(model, tok, samples[i : i + batch], args.device)
        cells[f"{task}@{length}"] = {"task": task, "context_length": length, "n": len(correct),
                                     "accuracy": sum(correct) / len(correct),
                                     "mean_prompt_tokens": sum(len(tok.encode(s.prompt).ids) for s in samples)
                                     / len(samples)}  # fmt: skip
        if task == "niah_single":
            for s, ok in zip(samples, correct, strict=True):
                by_depth.setdefault(f"{length}@{s.depth}", []).append(ok)
        print(f"eval {task}@{length}: {cells[f'{task}@{length}']['accuracy']:.3f}", flush=True)
    depth_acc = {k: sum(v) / len(v) for k, v in by_depth.items()}
    return {"metric": "greedy exact match (generated text before EOS, whitespace-stripped, == answer)",
            "depths": list(EVAL_DEPTHS), "samples_per_cell": args.eval_samples, "cells": cells,
            "niah_single_by_length_depth": depth_acc, "skipped_for_time": skipped}  # fmt: skip


def generate_and_score(model, tok: Tokenizer, samples, device: str) -> list[bool]:
    prompts = [tok.encode(s.prompt).ids for s in samples]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # left padding for batched generation
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    max_new = max(len(tok.encode(s.answer).ids) for s in samples) + 3
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=[0, 2], pad_token_id=0)  # fmt: skip
    results = []
    for s, row in zip(samples, out[:, width:].tolist(), strict=True):
        row = row[: next((j for j, t in enumerate(row) if t in (0, 2)), len(row))]
        results.append(tok.decode(row).strip() == s.answer)
    return results


def write_card(args, log: dict, evals: dict, config) -> None:
    rows = []
    for task in TASKS:
        accs = [evals["cells"].get(f"{task}@{n}") for n in EVAL_LENGTHS]
        rows.append(f"| {task} | " + " | ".join(f"{c['accuracy'] * 100:.1f}" if c else "-" for c in accs) + " |")
    last = log["curve"][-1] if log["curve"] else {}
    size_mb = (args.out / "model.safetensors").stat().st_size / 1e6
    card = f"""# tiny-retrieval

A {log["params"] / 1e6:.1f}M-parameter Qwen3-architecture model ({size_mb:.1f} MB in bf16) trained from scratch in
{log["train_seconds"] / 60:.1f} minutes on one GPU for synthetic long-context retrieval. It is SparseEngine's test
model: small enough to ship in the package, good enough at dense needle retrieval that a sparse method's
accuracy loss is visible.

## Architecture
`Qwen3ForCausalLM`: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} query
heads and {config.num_key_value_heads} KV heads of dim {config.head_dim} (GQA), SwiGLU MLP {config.intermediate_size},
RMSNorm with QK-norm, RoPE theta {config.rope_parameters["rope_theta"]:.0f}, tied embeddings, vocab {config.vocab_size}.
Trained on contexts up to 4096 tokens (`max_position_embeddings` {config.max_position_embeddings} is a ceiling, not a
trained length).

## Tokenizer
Byte-level BPE ({config.vocab_size} tokens) trained with `tokenizers` on the standard library's docstrings; digits
are split one per token. Special tokens `<|endoftext|>` (0), `<|im_start|>` (1), `<|im_end|>` (2); both 0 and 2
end generation. `tokenizer_config.json` carries a ChatML `chat_template`.

## Data
Generated on the fly by `sparse_serve.eval.tasks` over lines of the Python standard library's docstrings:
niah_single, niah_multikey (3-5 keys), niah_multivalue (2-4 values), variable_tracking (1-3 hops plus a decoy
chain), multiturn_recall (ChatML turns), plus 15% rows of plain docstring text. Loss is on the answer tokens (and
the closing `<|endoftext|>` / `<|im_end|>`) for task rows and on every token for text rows. Context lengths
follow a curriculum: up to 1K, then 2K, then 4K tokens, with long contexts weighted up in the second half.

## Training
{log["step"]} steps, {log["tokens"] / 1e6:.0f}M tokens (padding included), {log["train_seconds"]:.0f} s of training,
AdamW (betas 0.9/0.95, weight decay 0.1), peak LR {args.lr}, {args.warmup_steps} warmup steps, cosine to 10%,
bf16 autocast, SDPA attention, {args.tokens_per_step} tokens per step. Final losses: answer tokens
{last.get("task_loss", float("nan")):.3f}, text {last.get("text_loss", float("nan")):.3f}.

## Dense accuracy (greedy exact match, %, {evals["samples_per_cell"]} samples per cell, depths {evals["depths"]})

| task | {" | ".join(str(n) for n in EVAL_LENGTHS)} |
| --- | {" | ".join("---" for _ in EVAL_LENGTHS)} |
{chr(10).join(rows)}

Prompts are plain text: header, haystack with needle lines, then `Question: ...` and `Answer: `
(multiturn_recall: ChatML turns ending in `<|im_start|>assistant\\n`). Prompt and answer are encoded separately.
The evaluation haystack is the same docstring text as in training (at other random offsets) with fresh keys
and numbers.

## Reproduce
`python3 scripts/train_tiny_model.py --out DIR --minutes 9` on one H200 (Python 3.12's stdlib there; another
stdlib version gives a different tokenizer and text, but the same recipe).
"""
    (args.out / "README.md").write_text(card)


def main() -> int:
    t_start = time.time()
    args = parse_args()
    random.seed(args.seed)
    haystack = Haystack.from_stdlib(max_chars=args.haystack_chars)
    tok = train_tokenizer(haystack, args.vocab_size)
    assert [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2], "special tokens must be ids 0, 1, 2"
    print(f"tokenizer: vocab {tok.get_vocab_size()}, haystack {len(haystack.lines)} lines, "
          f"{time.time() - t_start:.1f}s", flush=True)  # fmt: skip
    model, log = train(args, tok, haystack, t_start)
    save_model(args, model, tok)
    log["wall_seconds_before_eval"] = time.time() - t_start
    try:
        evals = evaluate(args, tok, haystack, deadline=t_start + args.minutes * 60 - 5)
    except Exception as exc:  # keep the trained model and the log even if evaluation breaks
        evals = {"error": repr(exc), "cells": {}, "samples_per_cell": 0, "depths": []}
        print(f"evaluation failed: {exc!r}", flush=True)
    log["wall_seconds"] = time.time() - t_start
    (args.out / "eval_dense.json").write_text(json.dumps(evals, indent=1))
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    write_card(args, log, evals, model.config)
    print(f"done in {log['wall_seconds']:.0f}s: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
