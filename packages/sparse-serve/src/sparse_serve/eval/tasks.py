"""RULER/NIAH-style synthetic long-context tasks over a haystack of Python standard-library text.

One generator serves training (``scripts/train_tiny_model.py``) and evaluation, so the prompt format
the model learned is exactly the one it is tested on. Everything is pure Python and seeded by the
``random.Random`` passed in: the same seed, tokenizer and haystack give the same samples.

Prompt format (plain-text completion; multi-turn recall uses ChatML turns):

    <header line>
    <haystack lines, with needle lines inserted at the requested depths>
    Question: <question about a needle>
    Answer: <- the prompt ends here, with the trailing space

The answer is the text the model must produce next (e.g. ``"4817302"``), compared by exact match
after stripping whitespace; the training script appends ``<|endoftext|>`` (``<|im_end|>`` for
``multiturn_recall``) after it. Encode the prompt and the answer separately, never their
concatenation, so that a BPE merge across the boundary cannot change the prompt's tokens.

``tokenizer`` is anything with ``encode(text)`` returning a list of ids or an object with ``.ids``
(``tokenizers.Tokenizer``, ``sparse_serve.tokenizer.Tokenizer``, HF tokenizers), or a plain callable
``count_tokens(text) -> int``. Token lengths are hit by summing per-line counts, so a prompt lands
within a few percent of ``context_length``, not exactly on it.

``depth`` is the relative token position, within the haystack part of the prompt (0 = right after the
header, 1 = right before the question), of the needle that answers the question: the queried key
for multi-key and multi-turn recall, the first value for multi-value, and the first assignment (the
one holding the number) for variable tracking. Other needles go at random depths (after ``depth``
for multi-value values and later assignments of the chain, so their order is the order asked for).
"""

from __future__ import annotations

import random
import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from inspect import cleandoc
from pathlib import Path

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "multiturn_recall")

HEADER = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize them. I will quiz you about them afterwards."
)
VT_HEADER = "Memorize and track the chains of variable assignments hidden in the following text."
ANSWER_PROMPT = "\nAnswer: "
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
_DOCSTRING = re.compile(r'"""(.*?)"""', re.DOTALL)
_ADJECTIVES = (
    "amber brave calm daring eager fancy gentle happy icy jolly keen lively mellow noble odd polite quiet rapid "
    "shiny tidy urban vivid witty young zesty bold crisp dusty early faint grand hollow lucky misty nimble proud "
    "rusty silent tender upper velvet wild"
).split()
_NOUNS = (
    "apple bridge castle dragon engine falcon garden harbor island jacket kettle lantern meadow needle orchard "
    "pebble quartz river saddle tiger umbrella valley walnut yacht zebra anchor button candle desert ember forest "
    "glacier hammer igloo jungle kitten ladder mirror nectar oyster parrot rocket"
).split()

Counter = Callable[[str], int]
_COUNTERS: dict[int, tuple[object, Counter]] = {}  # one stable counter per tokenizer, so caches can key on it


@dataclass(frozen=True, slots=True)
class TaskSample:
    task: str
    context_length: int  # target prompt length in tokens
    depth: float  # relative position of the (queried / first) needle in the haystack part, 0..1
    prompt: str  # full prompt text the model is given (ends right where the answer starts)
    answer: str  # exact expected completion text (before EOS), e.g. "4817302"


def token_counter(tokenizer) -> Counter:
    """Return ``count_tokens(text) -> int`` for a tokenizer object or a counting callable (memoized)."""
    cached = _COUNTERS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        if callable(tokenizer):
            return tokenizer
        raise ValueError(f"tokenizer must have encode(text) or be a callable count_tokens(text); got {tokenizer!r}")

    def count(text: str) -> int:
        ids = encode(text)
        return len(getattr(ids, "ids", ids))

    _COUNTERS[id(tokenizer)] = (tokenizer, count)
    return count


class Haystack:
    """Filler text: non-empty lines of standard-library docstrings, in a deterministic order.

    Per-line token counts are computed lazily and cached per tokenizer, so building a 4K-token
    context costs a sum over ~200 cached counts rather than re-encoding the whole context.
    """

    def __init__(self, lines: Sequence[str]):
        self.lines = tuple(line for line in lines if line.strip())
        if not self.lines:
            raise ValueError("haystack needs at least one non-empty line")
        self._counts: dict[int, tuple[object, list[int | None]]] = {}

    @classmethod
    def from_stdlib(cls, max_chars: int = 3_000_000, root: str | Path | None = None) -> Haystack:
        """Triple-quoted strings (docstrings, mostly) of the stdlib's ``.py`` files, sorted by path."""
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        root = Path(root or sysconfig.get_paths()["stdlib"])
        lines: list[str] = []
        total = 0
        for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
                continue
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for match in _DOCSTRING.finditer(source):
                for line in cleandoc(match.group(1)).splitlines():
                    line = line.rstrip()
                    if line.strip() and "<|" not in line:
                        lines.append(line)
                        total += len(line) + 1
                if total >= max_chars:
                    return cls(lines)
        if not lines:
            raise ValueError(f"no docstrings found under {root}")
        return cls(lines)

    def line_tokens(self, index: int, count: Counter) -> int:
        """Token count of line ``index`` preceded by its newline, cached per counter.

        The newline goes in front because byte-level BPE merges it with the next line's indentation.
        """
        key = id(count)
        entry = self._counts.get(key)
        if entry is None or entry[0] is not count:
            entry = (count, [None] * len(self.lines))
            self._counts[key] = entry
        cached = entry[1][index]
        if cached is None:
            cached = entry[1][index] = count("\n" + self.lines[index])
        return cached

    def filler(self, rng: random.Random, num_tokens: int, count: Counter) -> tuple[list[str], list[int]]:
        """Consecutive lines from a random start (wrapping) totalling about ``num_tokens`` tokens.

        Returns the lines and their token counts; the last line is cut by characters to fit.
        """
        lines: list[str] = []
        counts: list[int] = []
        i = rng.randrange(len(self.lines))
        total = 0
        while total < num_tokens:
            n = self.line_tokens(i, count)
            if total + n > num_tokens:
                part = self.lines[i][: max(1, len(self.lines[i]) * (num_tokens - total) // n)]
                n = count("\n" + part)
                if total + n > num_tokens:
                    break
                lines.append(part)
                counts.append(n)
                break
            lines.append(self.lines[i])
            counts.append(n)
            total += n
            i = (i + 1) % len(self.lines)
        return lines, counts

    def text(self, rng: random.Random, num_chars: int) -> str:
        """Plain text of at least ``num_chars`` characters from a random start (for LM samples)."""
        i, parts, total = rng.randrange(len(self.lines)), [], 0
        while total < num_chars:
            parts.append(self.lines[i])
            total += len(self.lines[i]) + 1
            i = (i + 1) % len(self.lines)
        return "\n".join(parts)


def _insert(lines: list[str], counts: list[int], needles: list[tuple[float, str]]) -> list[str]:
    """Insert needle lines so each starts at ``depth`` of the filler's tokens; ties keep list order."""
    cumulative, total = [], 0
    for n in counts:
        cumulative.append(total)  # tokens before line i
        total += n
    slots: dict[int, list[str]] = {}
    for depth, text in needles:
        target = depth * total
        index = next((i for i, c in enumerate(cumulative) if c >= target), len(lines))
        slots.setdefault(index, []).append(text)
    out: list[str] = []
    for i in range(len(lines) + 1):
        out.extend(slots.get(i, ()))
        if i < len(lines):
            out.append(lines[i])
    return out


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _later(rng: random.Random, depth: float, n: int) -> list[float]:
    return sorted(rng.uniform(depth, 1.0) for _ in range(n))


def _niah(task: str, depth: float, rng: random.Random) -> tuple[str, list[tuple[float, str]], str, str]:
    """Header, needles (depth, line), question and answer of the three NIAH variants."""
    if task == "niah_multivalue":
        key = _keys(rng, 1)[0]
        values = [_number(rng) for _ in range(rng.randint(2, 4))]
        depths = [depth, *_later(rng, depth, len(values) - 1)]
        needles = [(d, _needle(key, v)) for d, v in zip(depths, values, strict=True)]
        question = f"Question: What are all the special magic numbers for {key} mentioned in the provided text?"
        return HEADER, needles, question, ", ".join(values)
    keys = _keys(rng, 1 if task == "niah_single" else rng.randint(3, 5))
    values = [_number(rng) for _ in keys]
    needles = [(depth, _needle(keys[0], values[0]))]
    needles += [(rng.random(), _needle(k, v)) for k, v in zip(keys[1:], values[1:], strict=True)]
    question = f"Question: What is the special magic number for {keys[0]} mentioned in the provided text?"
    return HEADER, needles, question, values[0]


def _variable_tracking(depth: float, rng: random.Random) -> tuple[str, list[tuple[float, str]], str, str]:
    names: list[str] = []
    while len(names) < 8:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value, other = _number(rng, 5), _number(rng, 5)
    hops = rng.randint(1, 3)
    chain, decoy = names[: hops + 1], names[hops + 1 : hops + 3]

    def assignments(chain_names: list[str], number: str) -> list[str]:
        first = f"VAR {chain_names[0]} = {number}."
        return [first] + [f"VAR {b} = VAR {a}." for a, b in zip(chain_names, chain_names[1:], strict=False)]

    needles = list(zip([depth, *_later(rng, depth, hops)], assignments(chain, value), strict=True))
    needles += list(zip(sorted(rng.random() for _ in decoy), assignments(decoy, other), strict=True))
    return VT_HEADER, needles, f"Question: What is the value of VAR {chain[-1]}?", value


def _plain_prompt(header, needles, question, context_length, rng, count, haystack, task) -> str:
    fixed = count(header) + sum(count("\n" + text) for _, text in needles) + count("\n" + question + ANSWER_PROMPT)
    lines, counts = haystack.filler(rng, _budget(context_length, fixed, task), count)
    return "\n".join([header, *_insert(lines, counts, needles), question]) + ANSWER_PROMPT


def _budget(context_length: int, fixed: int, task: str) -> int:
    budget = context_length - fixed
    if budget < 16:
        raise ValueError(f"context_length={context_length} is too short for {task} (needs >= {fixed + 16} tokens)")
    return budget


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _multiturn(context_length, depth, rng, count, haystack) -> tuple[str, str]:
    num_turns = rng.randint(2, min(6, 2 + context_length // 512))
    keys = _keys(rng, num_turns)
    values = [_number(rng) for _ in keys]
    queried = rng.randrange(num_turns)
    facts = [f"Remember: the special magic number for {k} is {v}." for k, v in zip(keys, values, strict=True)]
    needles = [(depth if i == queried else rng.random(), fact) for i, fact in enumerate(facts)]
    question = _turn("user", f"What is the special magic number for {keys[queried]}?") + f"{IM_START}assistant\n"
    markup = count(_turn("user", "") + _turn("assistant", "Noted.")) * num_turns + count(HEADER + "\n")
    fixed = markup + sum(count("\n" + f) for f in facts) + count(question)
    lines, counts = haystack.filler(rng, _budget(context_length, fixed, "multiturn_recall"), count)
    body = _insert(lines, counts, needles)
    # Split into turns so that each fact sits in a turn of its own order: cut right after each fact.
    cuts = sorted(body.index(f) + 1 for f in facts)
    turns, start = [], 0
    for end in [*cuts[:-1], len(body)]:
        turns.append("\n".join(body[start:end]))
        start = end
    header = f"{HEADER}\n" if turns else ""
    text = "".join(
        _turn("user", (header if i == 0 else "") + t) + _turn("assistant", "Noted.") for i, t in enumerate(turns)
    )
    return text + question, values[queried]


def make_sample(
    task: str, context_length: int, depth: float, rng: random.Random, tokenizer, haystack: Haystack
) -> TaskSample:
    """One sample of ``task`` whose prompt is about ``context_length`` tokens, needle at ``depth``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int, got {context_length!r}")
    if not isinstance(depth, int | float) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth!r}")
    if not isinstance(rng, random.Random):
        raise ValueError(f"rng must be a random.Random, got {type(rng).__name__}")
    if not isinstance(haystack, Haystack):
        raise ValueError(f"haystack must be a Haystack, got {type(haystack).__name__}")
    count = token_counter(tokenizer)
    depth = float(depth)
    if task == "multiturn_recall":
        prompt, answer = _multiturn(context_length, depth, rng, count, haystack)
    else:
        parts = _variable_tracking(depth, rng) if task == "variable_tracking" else _niah(task, depth, rng)
        header, needles, question, answer = parts
        prompt = _plain_prompt(header, needles, question, context_length, rng, count, haystack, task)
    return TaskSample(task=task, context_length=context_length, depth=depth, prompt=prompt, answer=answer)
