"""Quality of the quantized KV stores (or of sparse prefill) on the embedded model, next to dense.

Every configuration of the chosen set answers the same prompts. ``--set kv_dtypes`` (default):
dense bf16/fp32, fp8, KIVI 4 and 2 bits, TurboQuant 4 and 3 bits. ``--set prefill``: dense and
flashprefill_v2 at several thresholds, each prompt prefilled in one chunk (``--chunk``) with sparse
selection from 512 queries on (the default ``min_sparse_q_len`` of 4096 would leave a 4096-token
prompt dense). ``--set methods``: every registered decode method at a budget of a quarter of the
prompt (``method_settings``; a method that cannot run gets its error in the table, the others go
on). ``--set retroinfer``: dense and RetroInfer at its defaults (no index below 16384 tokens: dense
here), and at its default ratios with an index at these lengths (``retroinfer_settings``). ``--set composed``:
Quest, OmniKV and SnapKV over compressed stores next to the same method over the model dtype.
The prompts: the harness's five retrieval tasks at the model's longest trained context (4096 tokens)
over nine needle depths. Accuracy is reported with a Wilson 95% interval, and the difference to
dense is paired (same prompts): its 95% interval comes from the discordant pairs, so "within one
point of dense" can be read off directly. Writes ``summary.{json,md}`` under ``--out``.

Run: ``uv run python scripts/eval_kv_dtypes.py --device cuda`` (about a minute on a GPU; on CPU
use fewer ``--samples-per-cell``); ``--set methods --device cuda --samples-per-cell 8`` for the
methods.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from eval_methods import method_settings as eviction_settings  # scripts/: the eviction methods' 25% settings

from sparse_serve import LLM
from sparse_serve.cli import DEFAULT_MODEL
from sparse_serve.eval.harness import EvalGrid, make_samples, run_eval
from sparse_serve.eval.tasks import TASKS, Haystack

STORES = {
    "dense": {},
    "fp8_kv": dict(sparse_method="fp8_kv"),
    "kivi-4": dict(sparse_method="kivi", kivi_bits=4),
    "kivi-2": dict(sparse_method="kivi", kivi_bits=2),
    "turboquant-4": dict(sparse_method="turboquant", turboquant_bits=4),
    "turboquant-3": dict(sparse_method="turboquant", turboquant_bits=3),
}
_SPARSE_PREFILL = dict(prefill_sparse_method="flashprefill_v2", flashprefill_v2_min_sparse_q_len=512)
PREFILL = {
    "dense": {},
    **{f"flashprefill-{t}": dict(_SPARSE_PREFILL, flashprefill_v2_abs_threshold=t) for t in (0.002, 0.01, 0.05, 0.2)},
}


def method_settings(length: int) -> dict[str, dict]:
    """Every registered decode method at a budget of ``length // 4`` tokens: dense, StreamingLLM,
    SnapKV, PyramidKV and H2O as in ``scripts/eval_methods.py``; the others with the same sink 4 and
    recent 32 where they have them. R-KV and skipkv compress only after generated tokens: they cut back to
    the budget from the first one (interval 1). RetroInfer reads the best quarter of its clusters exactly
    from an index built at 1024 tokens, estimating none (the budget counts tokens read exactly)."""
    budget = length // 4
    snapkv = eviction_settings(length)["snapkv"]
    protected = dict(sink_keep_tokens=4, recent_keep_tokens=32, decode_keep_tokens=budget - 36)
    return {
        **eviction_settings(length),
        "adakv": {**snapkv, "sparse_method": "adakv"},
        "kvzip": dict(sparse_method="kvzip", kvzip_token_budget=budget, kvzip_score_chunk_size=1024),
        "tova": dict(sparse_method="tova", **protected),
        "rkv": dict(sparse_method="rkv", **protected, rkv_compression_interval=1, rkv_observation_tokens=1),
        "skipkv": dict(sparse_method="skipkv", **protected, skipkv_compression_interval=1),
        "quest": dict(
            sparse_method="quest", sink_keep_tokens=16, recent_keep_tokens=32, decode_keep_tokens=budget - 48
        ),
        "omnikv": dict(sparse_method="omnikv", **protected),
        "retroinfer": _retroinfer(0.25),
    }


def _retroinfer(ratio: float, estimation: float = 0.0, **extra) -> dict:
    return dict(
        sparse_method="retroinfer",
        retroinfer_min_index_tokens=1024,
        retroinfer_retrieval_ratio=ratio,
        retroinfer_estimation_ratio=estimation,
        **extra,
    )


def retroinfer_settings(length: int) -> dict[str, dict]:
    """RetroInfer at its defaults (an index from 16384 tokens on: below that, as at the embedded model's
    4096, it reads every token), then indexed from 1024 tokens: the default ratios (1.8% of clusters read
    exactly, the next 23.2% estimated), the same without the estimation, the default ratios with update
    blocks of 128 tokens instead of 1024 (a decode query reads its unindexed tail exactly: at 4096 tokens
    the default blocks alone are a quarter of the context), and 25% of clusters read exactly; the default
    ratios with centroids as int8 codes instead of the model dtype (``-int8``)."""
    return {
        "dense": {},
        "retroinfer": dict(sparse_method="retroinfer"),
        "retroinfer-0.018+0.232": _retroinfer(0.018, 0.232),
        "retroinfer-0.018+0.232-int8": _retroinfer(0.018, 0.232, retroinfer_centroid_dtype="int8"),
        "retroinfer-0.018": _retroinfer(0.018),
        "retroinfer-0.018+0.232-u128": _retroinfer(0.018, 0.232, retroinfer_update_tokens=128),
        "retroinfer-0.25": _retroinfer(0.25),
    }


def quest_summary_settings(length: int) -> dict[str, dict]:
    """Quest with its page summaries as int8 codes (the default) against the model dtype's exact min / max, at a
    quarter of the context and at a sixteenth (fewer pages picked: the bounds' ranking matters more)."""
    out = {"dense": {}}
    for name, budget in (("", length // 4), ("-1/16", length // 16)):
        quest = dict(sparse_method="quest", sink_keep_tokens=16, recent_keep_tokens=32, decode_keep_tokens=budget - 48)
        out[f"quest{name}"] = quest
        out[f"quest{name}-model"] = dict(quest, quest_summary_dtype="model")
    return out


def composed_settings(length: int) -> dict[str, dict]:
    """Query-aware and eviction methods over compressed stores at a quarter of the context, next to the same
    method over the model dtype: Quest over fp8 and KIVI-4 (16-token pages, Quest's; its pages' key
    statistics as summaries), OmniKV over fp8 (filter layers from codes), SnapKV over fp8 and KIVI-4."""
    methods = method_settings(length)
    kivi = dict(kv_cache_dtype="kivi", kivi_bits=4, kv_quant_page_size=16)
    return {
        "dense": {},
        "quest": methods["quest"],
        "quest-fp8": dict(methods["quest"], kv_cache_dtype="fp8"),
        "quest-kivi4": dict(methods["quest"], **kivi),
        "omnikv": methods["omnikv"],
        "omnikv-fp8": dict(methods["omnikv"], kv_cache_dtype="fp8"),
        "snapkv": methods["snapkv"],
        "snapkv-fp8": dict(methods["snapkv"], kv_cache_dtype="fp8"),
        "snapkv-kivi4": dict(methods["snapkv"], **kivi),
    }


SETS: dict[str, Callable[[int], dict[str, dict]]] = {
    "kv_dtypes": lambda _: STORES,
    "prefill": lambda _: PREFILL,
    "methods": method_settings,
    "retroinfer": retroinfer_settings,
    "quest_summaries": quest_summary_settings,
    "composed": composed_settings,
}
DEPTHS = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def paired_difference(ours: list[bool], base: list[bool], z: float = 1.96) -> tuple[float, float, float]:
    """Accuracy difference (ours - base) on the same samples and its normal-approximation 95% interval
    from the discordant pairs (the variance of a paired difference of proportions)."""
    n = len(ours)
    b = sum(o and not d for o, d in zip(ours, base, strict=True))  # ours right, base wrong
    c = sum(d and not o for o, d in zip(ours, base, strict=True))
    diff = (b - c) / n
    var = ((b + c) / n - diff * diff) / n
    half = z * math.sqrt(max(var, 0.0))
    return diff, diff - half, diff + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="context length (the longest trained: 4096)")
    parser.add_argument("--samples-per-cell", type=int, default=8, help="per (task, depth)")
    parser.add_argument("--set", choices=SETS, default="kv_dtypes", help="which configurations to compare")
    parser.add_argument("--stores", default=None, help="comma-separated names within the set (default: all)")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="default: results/eval/<set> (methods: methods_quality)")
    args = parser.parse_args()
    configs = SETS[args.set](args.length)
    # results/eval/methods holds scripts/eval_methods.py's CPU runs (another layout): this set writes beside it.
    args.out = args.out or Path("results/eval") / {"methods": "methods_quality"}.get(args.set, args.set)
    tasks = tuple(args.tasks.split(","))
    grid = EvalGrid(tasks, (args.length,), DEPTHS, samples_per_cell=args.samples_per_cell, seed=0)
    haystack = Haystack.from_stdlib()
    runs: dict[str, list] = {}
    settings, failed = {}, {}
    for name in (args.stores or ",".join(configs)).split(","):
        cfg = configs[name]
        try:
            runs[name], settings[name] = run_config(args, grid, haystack, cfg)
        except Exception as e:  # a method that cannot run here says why in the table; the others go on
            failed[name] = {**cfg, "error": f"{type(e).__name__}: {e}"}
            print(name, "failed:", failed[name]["error"], flush=True)
            continue
        print(name, sum(r.correct for r in runs[name]), "/", len(runs[name]), flush=True)
    write(args, grid, runs, settings, failed)


def run_config(args, grid: EvalGrid, haystack: Haystack, cfg: dict) -> tuple[list, dict]:
    """Every sample of ``grid`` through an engine with ``cfg``: the results and the settings that ran."""
    llm = LLM(
        str(DEFAULT_MODEL),
        device=args.device,
        max_model_len=args.length + 64,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=64,
        num_kv_blocks=64 * -(-(args.length + 64) // 16) + 64,  # every running request at full length
        **cfg,
    )
    samples = make_samples(grid, llm.tokenizer, haystack)
    t0 = time.perf_counter()
    results = run_eval(llm, samples, progress=False)
    settings = {
        **cfg,
        "kv_store": llm.engine.runner.store.describe(),
        "kv_bytes_per_token": llm.engine.runner.kv_bytes_per_block / llm.engine.config.block_size,
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype),
        "block_size": llm.engine.config.block_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return results, settings


def write(args, grid: EvalGrid, runs: dict[str, list], settings: dict, failed: dict[str, dict]) -> None:
    """``summary.{json,md}``: a row per configuration that ran, then one per configuration that failed."""
    base = [r.correct for r in runs["dense"]] if "dense" in runs else None
    rows = []
    for name, results in runs.items():
        correct = [r.correct for r in results]
        k, n = sum(correct), len(correct)
        lo, hi = wilson(k, n)
        row = {
            "store": name,
            "correct": k,
            "samples": n,
            "accuracy": k / n,
            "wilson95": [lo, hi],
            "per_task": {
                t: sum(r.correct for r in results if r.task == t) / max(1, sum(r.task == t for r in results))
                for t in grid.tasks
            },
            "settings": settings[name],
        }
        if base is not None and name != "dense":
            diff, dlo, dhi = paired_difference(correct, base)
            row["diff_vs_dense"] = diff
            row["diff_vs_dense_95"] = [dlo, dhi]
            row["disagreements"] = sum(a != b for a, b in zip(correct, base, strict=True))
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "assets/tiny-retrieval",
        "context_length": args.length,
        "tasks": list(grid.tasks),
        "depths": list(grid.depths),
        "samples_per_cell": grid.samples_per_cell,
        "command": (
            f"uv run python scripts/eval_kv_dtypes.py --set {args.set} --chunk {args.chunk} --device {args.device} "
            f"--samples-per-cell {grid.samples_per_cell}"
            + (f" --length {args.length}" if args.length != 4096 else "")
            + (f" --tasks {args.tasks}" if args.tasks != ",".join(TASKS) else "")
            + (f" --stores {args.stores}" if args.stores else "")
        ),
    }
    (args.out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows, "failed": failed}, indent=1))
    lines = [
        f"Embedded model, {args.length}-token prompts, tasks {', '.join(grid.tasks)}, {len(grid.depths)} depths x "
        f"{grid.samples_per_cell} samples per (task, depth). Greedy exact match. `{meta['command']}`",
        "",
        "| store | correct / samples | accuracy % | Wilson 95% | vs dense (paired), points | 95% | disagreements | "
        + " | ".join(grid.tasks)
        + " |",
        "|" + "---|" * (7 + len(grid.tasks)),
    ]
    for r in rows:
        lo, hi = r["wilson95"]
        d = r.get("diff_vs_dense")
        dd = "" if d is None else f"{100 * d:+.1f}"
        di = "" if d is None else f"[{100 * r['diff_vs_dense_95'][0]:+.1f}, {100 * r['diff_vs_dense_95'][1]:+.1f}]"
        tasks = " | ".join(f"{100 * r['per_task'][t]:.1f}" for t in grid.tasks)
        lines.append(
            f"| {r['store']} | {r['correct']} / {r['samples']} | {100 * r['accuracy']:.1f} | "
            f"[{100 * lo:.1f}, {100 * hi:.1f}] | {dd} | {di} | {r.get('disagreements', '')} | {tasks} |"
        )
    for name, f in failed.items():
        error = f["error"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | not run: {error} |" + " |" * (5 + len(grid.tasks)))
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
