"""One table and one plot from a serving run per method (``run_h200_long.sh``'s folders).

    python benchmarks/serving/report_methods.py results/serving/h200-qwen3-8b-long

reads ``DIR/<method>/bench.json`` for each method folder present and writes ``DIR/summary.md`` (a row
per method and request rate) and ``DIR/latency.png`` (TTFT and TPOT percentiles and output
throughput against the request rate, one line per method).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHOD_ORDER = ("dense", "snapkv", "quest")


def load(folder: Path) -> dict[str, dict]:
    runs = {}
    for sub in sorted(folder.iterdir(), key=lambda p: (METHOD_ORDER + (p.name,)).index(p.name)):
        if (sub / "bench.json").is_file():
            runs[sub.name] = json.loads((sub / "bench.json").read_text())
    return runs


def _three(d: dict) -> str:
    return " / ".join("-" if d.get(k) is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))


def table(runs: dict[str, dict]) -> str:
    lines = [
        "| method | rate (req/s) | done | duration s | req/s | out tok/s | total tok/s | TTFT p50 / p90 / p99 ms "
        "| ITL p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | preemptions | KV blocks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, result in runs.items():
        for run in result["runs"]:
            s, server = run["summary"], run.get("server", {})
            lines.append(
                f"| {method} | {run['request_rate']} | {s['completed']}/{s['num_requests']} | {s['duration_s']:.1f} "
                f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.0f} "
                f"| {s['total_token_throughput']:.0f} | {_three(s['ttft_ms'])} | {_three(s['itl_ms'])} "
                f"| {_three(s['tpot_ms'])} | {server.get('sparse_preemptions_total', 0):.0f} "
                f"| {server.get('sparse_kv_blocks_total') or 0:.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = sorted({r["request_rate"] for res in runs.values() for r in res["runs"]})
    for method, result in runs.items():
        rates = [labels.index(r["request_rate"]) for r in result["runs"]]  # evenly spaced, inf included
        summaries = [r["summary"] for r in result["runs"]]
        for ax, key in ((axes[0], "ttft_ms"), (axes[1], "tpot_ms")):
            (line,) = ax.plot(rates, [s[key]["p50"] for s in summaries], marker="o", label=f"{method} p50")
            ax.plot(
                rates,
                [s[key]["p99"] for s in summaries],
                ls="--",
                marker="x",
                color=line.get_color(),
                label=f"{method} p99",
            )
        axes[2].plot(rates, [s["output_token_throughput"] for s in summaries], marker="o", label=method)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output tokens/s"), strict=True):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_xticks(range(len(labels)), [f"{x:g}" for x in labels])
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    runs = load(args.folder)
    if not runs:
        parser.error(f"no <method>/bench.json under {args.folder}")
    first = next(iter(runs.values()))
    env, settings = first["environment"], first["settings"]
    header = [
        f"# Serving by method: {settings['model']}",
        "",
        f"commit `{env.get('commit')}`, GPU {env.get('gpu') or 'none (CPU)'}, torch {env.get('torch')}; "
        f"{settings['num_requests']} requests per rate, prompt lengths {settings['prompt_lens']}, output lengths "
        f"{settings['output_lens']} (uniform, random ids, ignore_eos, greedy, streamed); server args (dense) "
        f"`{' '.join(env['serve_args'])}`.",
        "",
    ]
    (args.folder / "summary.md").write_text("\n".join(header) + table(runs))
    plot(runs, args.folder / "latency.png")
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
