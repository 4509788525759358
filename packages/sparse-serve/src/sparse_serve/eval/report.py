"""Write an eval run as JSON, a markdown table and a depth x length heatmap per task."""

from __future__ import annotations

import json
from pathlib import Path


def markdown_table(summary: dict) -> str:
    lengths = sorted({row["context_length"] for row in summary["per_task_length"]})
    lines = ["| task | " + " | ".join(f"{n} tok" for n in lengths) + " | all |", "|---" * (len(lengths) + 2) + "|"]
    per = {(r["task"], r["context_length"]): r["accuracy"] for r in summary["per_task_length"]}
    for task, overall in summary["per_task"].items():
        cells = [f"{100 * per[(task, n)]:.1f}" if (task, n) in per else "" for n in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {100 * overall:.1f} |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, summary: dict, results: list[dict], settings: dict) -> list[Path]:
    """Write ``eval.json``, ``eval.md`` and (with matplotlib) ``eval_heatmap.png``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "eval.json", out / "eval.md"]
    paths[0].write_text(json.dumps({"settings": settings, "summary": summary, "results": results}, indent=1))
    header = "Accuracy (%) by task and context length, exact match, greedy.\n\nSettings: " + ", ".join(
        f"`{k}={v}`" for k, v in settings.items()
    )
    paths[1].write_text(header + "\n\n" + markdown_table(summary))
    png = _heatmap(out / "eval_heatmap.png", summary, settings)
    if png is not None:
        paths.append(png)
    return paths


def _heatmap(path: Path, summary: dict, settings: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: `uv sync --extra plot` (or the dev group) brings matplotlib
        return None
    tasks = list(summary["per_task"])
    depths = sorted({c["depth"] for c in summary["per_cell"]})
    lengths = sorted({c["context_length"] for c in summary["per_cell"]})
    acc = {(c["task"], c["depth"], c["context_length"]): c["accuracy"] for c in summary["per_cell"]}
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks) + 1, 3.6), squeeze=False)
    for i, (ax, task) in enumerate(zip(axes[0], tasks, strict=True)):
        grid = [[acc.get((task, d, n), float("nan")) for n in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths] if i == 0 else [])
        ax.set_xlabel("context length (tokens)")
        if i == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(task, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy")
    method = settings.get("sparse_method", "dense")
    fig.suptitle(f"{Path(str(settings.get('model', ''))).name}: {method}", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
