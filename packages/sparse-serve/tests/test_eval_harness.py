"""Eval harness plumbing: grid validation, scoring, summaries and the written report."""

import json
from pathlib import Path

import pytest

from sparse_serve import LLM
from sparse_serve.eval.harness import EvalGrid, EvalResult, make_samples, results_as_dicts, run_eval, score, summarize
from sparse_serve.eval.report import markdown_table, write_report
from sparse_serve.eval.tasks import Haystack

ASSET = Path(__file__).resolve().parents[1] / "src/sparse_serve/assets/tiny-retrieval"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tasks=("nope",)), "unknown"),
        (dict(tasks=()), "unknown"),
        (dict(context_lengths=(8,)), "context lengths"),
        (dict(depths=(1.5,)), "depths"),
        (dict(samples_per_cell=0), "samples_per_cell"),
    ],
)
def test_grid_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvalGrid(**kwargs)


def test_score_is_exact_match_of_the_first_line():
    assert score(" 4817302\nmore", "4817302")
    assert not score("48173020", "4817302")
    assert not score("", "4817302")


def test_summary_and_table():
    rows = [
        EvalResult("niah_single", 512, 0.0, 500, "1", "1", True),
        EvalResult("niah_single", 512, 0.5, 500, "1", "2", False),
        EvalResult("niah_single", 1024, 0.0, 1000, "1", "1", True),
    ]
    s = summarize(rows)
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert {(r["context_length"], r["accuracy"]) for r in s["per_task_length"]} == {(512, 0.5), (1024, 1.0)}
    assert "| niah_single | 50.0 | 100.0 | 66.7 |" in markdown_table(s)


def test_end_to_end_on_the_embedded_model(tmp_path):
    llm = LLM(str(ASSET), device="cpu", max_model_len=1024)
    grid = EvalGrid(context_lengths=(128, 256), depths=(0.0, 1.0), samples_per_cell=1, seed=3)
    samples = make_samples(grid, llm.tokenizer, Haystack.from_stdlib(max_chars=200_000))
    assert samples == make_samples(grid, llm.tokenizer, Haystack.from_stdlib(max_chars=200_000))
    results = run_eval(llm, samples, progress=False)
    assert len(results) == 4 and all(r.answer and r.prompt_tokens > 100 for r in results)
    paths = write_report(tmp_path, summarize(results), results_as_dicts(results), {"model": str(ASSET)})
    data = json.loads(paths[0].read_text())
    assert data["summary"]["num_samples"] == 4 and len(data["results"]) == 4
    assert (tmp_path / "eval_heatmap.png").stat().st_size > 1000
    assert llm.engine.kv.pool.num_used_blocks == 0
