import random
from pathlib import Path

import pytest

from sparse_serve.eval.tasks import TASKS, Haystack, TaskSample, make_sample, token_counter
from sparse_serve.tokenizer import Tokenizer

ASSET = Path(__file__).resolve().parents[1] / "src/sparse_serve/assets/tiny-retrieval"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def haystack():
    return Haystack.from_stdlib(max_chars=200_000)


def _needle_token_depth(tok, sample: TaskSample, needle: str) -> float:
    """Relative token position of ``needle`` between the header line and the question."""
    prompt = sample.prompt
    start = prompt.index("\n") + 1
    end = prompt.rindex("Question:") if "Question:" in prompt else prompt.rindex("<|im_start|>user")
    before = len(tok.encode(prompt[start : prompt.index(needle)]))
    return before / len(tok.encode(prompt[start:end]))


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed(tok, haystack, task):
    a = make_sample(task, 768, 0.3, random.Random(7), tok, haystack)
    b = make_sample(task, 768, 0.3, random.Random(7), tok, haystack)
    c = make_sample(task, 768, 0.3, random.Random(8), tok, haystack)
    assert a == b
    assert a != c


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 1024, 4096])
def test_prompt_length_close_to_target(tok, haystack, task, length):
    for seed in range(3):
        s = make_sample(task, length, random.Random(seed).random(), random.Random(seed), tok, haystack)
        assert abs(len(tok.encode(s.prompt)) - length) <= 0.05 * length
        assert s.context_length == length and s.task == task


@pytest.mark.parametrize("depth", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_single_needle_at_depth(tok, haystack, depth):
    s = make_sample("niah_single", 2048, depth, random.Random(1), tok, haystack)
    needle = next(line for line in s.prompt.splitlines() if "special magic numbers for" in line)
    assert needle.endswith(f"is: {s.answer}.")
    assert s.prompt.count(s.answer) == 1
    assert abs(_needle_token_depth(tok, s, needle) - depth) <= 0.03


def test_question_at_end_and_answer_format(tok, haystack):
    for task in TASKS:
        s = make_sample(task, 1024, 0.5, random.Random(3), tok, haystack)
        tail = s.prompt[-200:]
        if task == "multiturn_recall":
            assert s.prompt.endswith("<|im_start|>assistant\n")
            assert "What is the special magic number for" in tail
        else:
            assert s.prompt.endswith("\nAnswer: ")
            assert "Question: " in tail
        assert s.answer and "\n" not in s.answer and s.answer == s.answer.strip()


def test_multikey_queried_needle_at_depth(tok, haystack):
    s = make_sample("niah_multikey", 2048, 0.25, random.Random(5), tok, haystack)
    key = s.prompt.rsplit("magic number for ", 1)[1].split(" mentioned", 1)[0]
    needles = [line for line in s.prompt.splitlines() if line.startswith("One of the special magic numbers")]
    assert len(needles) >= 3
    queried = [line for line in needles if f" for {key} is:" in line]
    assert queried == [f"One of the special magic numbers for {key} is: {s.answer}."]
    assert abs(_needle_token_depth(tok, s, queried[0]) - 0.25) <= 0.03


def test_multivalue_answers_in_order(tok, haystack):
    s = make_sample("niah_multivalue", 2048, 0.1, random.Random(2), tok, haystack)
    values = s.answer.split(", ")
    assert len(values) >= 2
    positions = [s.prompt.index(f"is: {v}.") for v in values]
    assert positions == sorted(positions)
    needle = next(line for line in s.prompt.splitlines() if line.endswith(f"is: {values[0]}."))
    assert abs(_needle_token_depth(tok, s, needle) - 0.1) <= 0.03


def test_variable_tracking_chain_resolves(tok, haystack):
    s = make_sample("variable_tracking", 1024, 0.4, random.Random(4), tok, haystack)
    assign = dict(line[4:-1].split(" = ") for line in s.prompt.splitlines() if line.startswith("VAR "))
    name = s.prompt.rsplit("value of VAR ", 1)[1].split("?", 1)[0]
    value = assign[name]
    while value.startswith("VAR "):
        value = assign[value[4:]]
    assert value == s.answer


def test_multiturn_uses_chatml_turns(tok, haystack):
    s = make_sample("multiturn_recall", 2048, 0.6, random.Random(6), tok, haystack)
    assert s.prompt.startswith("<|im_start|>user\n")
    assert s.prompt.count("<|im_start|>assistant\nNoted.<|im_end|>") >= 2
    key = s.prompt.rsplit("magic number for ", 1)[1].split("?", 1)[0]
    assert f"the special magic number for {key} is {s.answer}." in s.prompt


def test_counting_callable_and_tokenizers_object(haystack):
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(ASSET / "tokenizer.json"))
    a = make_sample("niah_single", 512, 0.5, random.Random(0), hf, haystack)
    b = make_sample("niah_single", 512, 0.5, random.Random(0), lambda text: len(hf.encode(text).ids), haystack)
    assert a == b
    assert token_counter(hf) is token_counter(hf)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"task": "nope"},
        {"context_length": 0},
        {"context_length": 100.0},
        {"context_length": 20},
        {"depth": -0.1},
        {"depth": 1.5},
        {"rng": 0},
        {"haystack": ["text"]},
        {"tokenizer": object()},
    ],
)
def test_bad_arguments_raise(tok, haystack, kwargs):
    args = {"task": "niah_single", "context_length": 512, "depth": 0.5, "rng": random.Random(0)}
    args |= {"tokenizer": tok, "haystack": haystack} | kwargs
    with pytest.raises(ValueError):
        make_sample(**args)


def test_haystack_validation():
    with pytest.raises(ValueError):
        Haystack([])
    with pytest.raises(ValueError):
        Haystack.from_stdlib(max_chars=0)
    h = Haystack(["alpha beta", "", "gamma"])
    assert h.lines == ("alpha beta", "gamma")
