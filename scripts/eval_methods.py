"""Quality of every eviction method at a 25% budget on the embedded model (CPU), next to dense.

For each context length the budget is a quarter of it. Writes one report folder per (method,
length) under ``results/eval/methods/`` (JSON, markdown, heatmap via the eval harness) and a summary
``results/eval/methods/summary.{json,md}``. Run: ``uv run python scripts/eval_methods.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparse_serve import LLM
from sparse_serve.cli import DEFAULT_MODEL
from sparse_serve.eval.harness import EvalGrid, make_samples, results_as_dicts, run_eval, summarize
from sparse_serve.eval.report import write_report
from sparse_serve.eval.tasks import Haystack


def method_settings(length: int) -> dict[str, dict]:
    """Each method at a budget of ``length // 4`` tokens (the question sits in the last 32 tokens)."""
    budget = length // 4
    return {
        "dense": {},
        "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=budget - 4),
        "snapkv": dict(
            sparse_method="snapkv",
            sink_keep_tokens=4,
            recent_keep_tokens=32,
            observation_window_size=32,
            decode_keep_tokens=budget - 36,
        ),
        "pyramidkv": dict(
            sparse_method="pyramidkv",
            sink_keep_tokens=4,
            recent_keep_tokens=32,
            observation_window_size=32,
            decode_keep_tokens=budget - 36,
            pyramidkv_beta=4.0,
        ),
        "h2o": dict(sparse_method="h2o", h2o_prefill_budget=budget, h2o_recent_ratio=0.25, h2o_prefill_score_window=32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--depths", default="0.0,0.25,0.5,0.75,1.0")
    parser.add_argument("--samples-per-cell", type=int, default=4)
    parser.add_argument("--methods", default="dense,streamingllm,snapkv,pyramidkv,h2o")
    parser.add_argument("--out", type=Path, default=Path("results/eval/methods"))
    parser.add_argument(
        "--summary-only", action="store_true", help="rebuild summary.{json,md,png} from the run folders"
    )
    args = parser.parse_args()
    if args.summary_only:
        write_summary(args.out)
        return
    haystack = Haystack.from_stdlib()
    depths = tuple(float(d) for d in args.depths.split(","))
    for length in (int(x) for x in args.lengths.split(",")):
        for name, cfg in method_settings(length).items():
            if name not in args.methods.split(","):
                continue
            llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=length + 64, max_num_batched_tokens=512, **cfg)
            grid = EvalGrid(("niah_single",), (length,), depths, samples_per_cell=args.samples_per_cell, seed=0)
            results = run_eval(llm, make_samples(grid, llm.tokenizer, haystack), progress=True)
            summary = summarize(results)
            settings = {
                "model": "assets/tiny-retrieval",
                "sparse_method": name,
                **cfg,
                "budget_tokens": length // 4 if name != "dense" else length,
                "max_num_batched_tokens": 512,
                "prefill_policy": llm.engine.method.prefill_policy.value,
                "device": "cpu",
                "dtype": "float32",
                "grid": {"tasks": ["niah_single"], "context_lengths": [length], "depths": list(depths)},
            }
            write_report(args.out / f"{name}-{length}", summary, results_as_dicts(results), settings)
            print(name, length, summary["accuracy"], flush=True)
    write_summary(args.out)


def write_summary(out: Path) -> None:
    """``summary.{json,md}`` over every run folder under ``out`` (so runs can be added one at a time)."""
    order = list(method_settings(1024))
    rows = []
    for path in sorted(out.glob("*/eval.json")):
        data = json.loads(path.read_text())
        settings, summary = data["settings"], data["summary"]
        by_depth = {str(c["depth"]): c["accuracy"] for c in summary["per_cell"]}
        rows.append(
            {
                "method": settings["sparse_method"],
                "context_length": settings["grid"]["context_lengths"][0],
                "budget_tokens": settings["budget_tokens"],
                "accuracy": summary["accuracy"],
                "by_depth": by_depth,
                "settings": settings,
            }
        )
    rows.sort(key=lambda r: (r["context_length"], order.index(r["method"])))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    depths = list(rows[0]["by_depth"]) if rows else []
    lines = [
        "| method | context | budget | accuracy | " + " | ".join(f"depth {d}" for d in depths) + " |",
        "|" + "---|" * (4 + len(depths)),
    ]
    for r in rows:
        cells = " | ".join(f"{100 * v:.0f}" for v in r["by_depth"].values())
        lines.append(
            f"| {r['method']} | {r['context_length']} | {r['budget_tokens']} | {100 * r['accuracy']:.1f} | {cells} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(out / "summary.png", rows)


def _plot(path: Path, rows: list[dict]) -> None:
    """Accuracy by needle depth, one line per method, one panel per context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["context_length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.6), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        for r in (r for r in rows if r["context_length"] == length):
            depths = [float(d) for d in r["by_depth"]]
            ax.plot(
                depths,
                [100 * v for v in r["by_depth"].values()],
                marker="o",
                label=f"{r['method']} ({r['budget_tokens']})",
            )
        ax.set_title(f"niah_single, {length} tokens, budget in ()")
        ax.set_xlabel("needle depth")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
