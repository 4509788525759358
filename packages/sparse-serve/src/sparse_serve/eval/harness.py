"""Quality harness: generate a seeded grid of long-context tasks, run them through the engine, score.

The grid is tasks x context lengths x needle depths x samples. Every sample goes through the real
engine (continuous batching, paged KV, whatever engine config is given), greedy, and is scored by
exact match of the first generated line against the answer.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from dataclasses import asdict, dataclass

from sparse_serve.eval.tasks import TASKS, Haystack, TaskSample, make_sample
from sparse_serve.llm import LLM
from sparse_serve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EvalGrid:
    """Which samples to generate; the same grid and seed give the same prompts."""

    tasks: tuple[str, ...] = ("niah_single",)
    context_lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples_per_cell: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"unknown or no tasks {unknown}; choose from {', '.join(TASKS)}")
        if not self.context_lengths or min(self.context_lengths) < 64:
            raise ValueError(f"context lengths must be >= 64 tokens, got {self.context_lengths}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must lie in [0, 1], got {self.depths}")
        if self.samples_per_cell < 1:
            raise ValueError(f"samples_per_cell must be >= 1, got {self.samples_per_cell}")


@dataclass(frozen=True, slots=True)
class EvalResult:
    task: str
    context_length: int
    depth: float
    prompt_tokens: int
    answer: str
    output: str
    correct: bool


def _cell_rng(grid: EvalGrid, task: str, length: int, depth: float, i: int) -> random.Random:
    # Each cell's samples depend on the cell alone, so growing the grid never changes old prompts.
    key = f"{grid.seed}/{task}/{length}/{depth:.6f}/{i}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def make_samples(grid: EvalGrid, tokenizer, haystack: Haystack) -> list[TaskSample]:
    return [
        make_sample(task, length, depth, _cell_rng(grid, task, length, depth, i), tokenizer, haystack)
        for task in grid.tasks
        for length in grid.context_lengths
        for depth in grid.depths
        for i in range(grid.samples_per_cell)
    ]


def score(output: str, answer: str) -> bool:
    """Exact match of the first line of the output (whitespace-stripped) against the answer."""
    first_line = output.strip().split("\n", 1)[0].strip() if output.strip() else ""
    return first_line == answer.strip()


def run_eval(llm: LLM, samples: list[TaskSample], progress: bool = True) -> list[EvalResult]:
    """Run all samples through the engine (batched by the scheduler) and score them."""
    tok = llm.tokenizer
    if tok is None:
        raise ValueError("the eval harness needs a model with a tokenizer")
    prompts = [tok.encode(s.prompt) for s in samples]
    max_answer = max(len(tok.encode(s.answer, add_special_tokens=False)) for s in samples)
    params = SamplingParams(max_tokens=max_answer + 4, temperature=0.0, stop=("\n",))
    texts = [out.text for out in llm.generate(prompts, params, use_tqdm=progress)]
    return [
        EvalResult(s.task, s.context_length, s.depth, len(p), s.answer, texts[i], score(texts[i], s.answer))
        for i, (s, p) in enumerate(zip(samples, prompts, strict=True))
    ]


def summarize(results: list[EvalResult]) -> dict:
    """Accuracy overall, per task, per (task, length) and per (task, depth, length)."""

    def acc(rows: list[EvalResult]) -> float:
        return sum(r.correct for r in rows) / len(rows)

    by_task, by_len, by_cell = defaultdict(list), defaultdict(list), defaultdict(list)
    for r in results:
        by_task[r.task].append(r)
        by_len[(r.task, r.context_length)].append(r)
        by_cell[(r.task, r.depth, r.context_length)].append(r)
    return {
        "accuracy": acc(results),
        "num_samples": len(results),
        "per_task": {t: acc(rows) for t, rows in by_task.items()},
        "per_task_length": [{"task": t, "context_length": n, "accuracy": acc(rows)} for (t, n), rows in by_len.items()],
        "per_cell": [
            {"task": t, "depth": d, "context_length": n, "accuracy": acc(rows)} for (t, d, n), rows in by_cell.items()
        ],
    }


def results_as_dicts(results: list[EvalResult]) -> list[dict]:
    return [asdict(r) for r in results]
