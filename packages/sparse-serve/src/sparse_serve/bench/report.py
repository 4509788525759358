"""Write benchmark invocations as ``bench.json``, a markdown table ``bench.md`` and ``bench.png``.

A folder may collect several invocations (``--append``: e.g. one per method); the table and the
plot cover all of them, and the ratios (engine vs HF at batch 1, each method vs dense at dense's
largest batch) pair runs of the same prompt length.
"""

from __future__ import annotations

import json
from pathlib import Path

GB = 1e9
GIB = 2**30


def write_report(out_dir: str | Path, invocation: dict, *, append: bool = False) -> list[Path]:
    """Add ``invocation`` to ``out_dir/bench.json`` (replacing it unless ``append``); rewrite the rest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    invocations = json.loads(path.read_text())["invocations"] if append and path.exists() else []
    invocations.append(invocation)
    path.write_text(json.dumps({"invocations": invocations}, indent=1))
    return [path, *render(out)]


def render(out_dir: str | Path) -> list[Path]:
    """(Re)write ``bench.md`` and ``bench.png`` from the folder's ``bench.json``."""
    out = Path(out_dir)
    invocations = json.loads((out / "bench.json").read_text())["invocations"]
    md = out / "bench.md"
    md.write_text(markdown_report(invocations))
    png = _plot(out / "bench.png", invocations)
    return [md] if png is None else [md, png]


def all_runs(invocations: list[dict]) -> list[dict]:
    """Every run, with its invocation's GPU, commit and copy bandwidth attached."""
    runs = []
    for inv in invocations:
        env = inv["environment"]
        extra = {"gpu": env.get("gpu") or env.get("device"), "commit": env.get("commit"), "kernels": env.get("kernels")}
        extra["copy_bytes_per_s"] = inv["copy_bandwidth"]["bytes_per_s"]
        runs.extend({**run, **extra} for run in inv["runs"])
    return runs


def _label(run: dict) -> str:
    if run["engine"] == "hf-transformers":
        return "HF transformers"
    label = run["sparse_method"]
    store = run.get("kv_store", "")
    if store.startswith("quantized"):  # e.g. "kivi [kivi, 2 bits]", "snapkv [fp8, 8 bits]"
        label += " [" + store[store.index("(") + 1 : -1] + "]"
    label += " (async)" if run.get("async_scheduling") else ""
    if (run.get("kernels") or {}).get("pdl") is False:
        label += " (PDL off)"
    return label


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    return "" if value is None else f"{value / scale:.{digits}f}"


def markdown_table(runs: list[dict]) -> str:
    head = (
        "| engine / method | prefill | prompt | output | batch | steps | ms/step | median ms | tok/s "
        "| GB/step (W+KV) | GB/s | % copy BW | bytes-bound ms | GPU busy ms | peak GiB | KV in use GiB |"
    )
    lines = [head, "|---" * 16 + "|"]
    for r in runs:
        batch = f"{r['batch_size']} (max)" if r.get("batch_size_arg") == "max" else str(r["batch_size"])
        cells = [_label(r), r["prefill"], str(r["prompt_len"]), str(r["output_len"]), batch]
        if "error" in r:
            lines.append("| " + " | ".join(cells) + f" | error: {r['error'][:80]} |" + " |" * 10)
            continue
        m, raw = r["metrics"], r["raw"]
        cells += [
            str(m["steps_timed"]),
            _fmt(m["ms_per_step"], digits=2),
            _fmt(m.get("ms_per_step_median"), digits=2),
            _fmt(m["tokens_per_s"]),
            _fmt(m["bytes_per_step"], GB, 2),
            _fmt(m["achieved_bytes_per_s"], GB, 0),
            _fmt(m.get("fraction_of_copy_bw"), 0.01, 1),
            _fmt(m.get("bytes_bound_ms_per_step"), digits=2),
            _fmt(raw.get("gpu_kernel_ms_per_step"), digits=2),
            _fmt(raw.get("peak_memory_bytes"), GIB, 1),
            _fmt(raw.get("kv_bytes_in_use"), GIB, 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ratios(runs: list[dict]) -> list[str]:
    """Side-by-side ratios of aggregate decode tok/s, as markdown bullet lines."""
    ok = [r for r in runs if "error" not in r]
    engine = [r for r in ok if r["engine"] == "sparse-engine"]
    lines = []
    for hf in (r for r in ok if r["engine"] == "hf-transformers"):
        for r in engine:
            if r["sparse_method"] == "dense" and r["batch_size"] == 1 and r["prompt_len"] == hf["prompt_len"]:
                x = r["metrics"]["tokens_per_s"] / hf["metrics"]["tokens_per_s"]
                lines.append(
                    f"- {_label(r)} engine vs HF transformers, batch 1, prompt {r['prompt_len']}: **{x:.2f}x**"
                )
    for dense in (r for r in engine if r["sparse_method"] == "dense" and r.get("batch_size_arg") == "max"):
        for r in engine:
            if r["sparse_method"] == "dense" or r["prompt_len"] != dense["prompt_len"]:
                continue
            x = r["metrics"]["tokens_per_s"] / dense["metrics"]["tokens_per_s"]
            which = " (its max)" if r.get("batch_size_arg") == "max" else ""
            lines.append(
                f"- {r['sparse_method']} at batch {r['batch_size']}{which} vs dense at its max batch "
                f"{dense['batch_size']}, prompt {r['prompt_len']} (output {r['output_len']} vs {dense['output_len']}): "
                f"**{x:.2f}x**"
            )
    return lines


def _kernels_note(env: dict) -> str:
    kernels = env.get("kernels")
    if not kernels:
        return ""
    pdl = "on" if kernels.get("pdl") else "off"
    return f"; kernels: PDL {pdl}, small-M linear up to {kernels.get('small_m_linear_max_rows')} rows"


def markdown_report(invocations: list[dict]) -> str:
    runs = all_runs(invocations)
    parts = ["# Decode throughput\n"]
    for i, inv in enumerate(invocations):
        env, copy = inv["environment"], inv["copy_bandwidth"]
        parts.append(
            f"Invocation {i + 1}: `{inv.get('command', '')}`  \n"
            f"{env.get('gpu') or env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"transformers {env.get('transformers')}, commit `{env.get('commit')}`; copy bandwidth "
            f"{copy['bytes_per_s'] / GB:.0f} GB/s ({copy['method']}){_kernels_note(env)}\n"
        )
        for run in [r for r in inv["runs"] if r["engine"] == "sparse-engine"][:1]:
            parts.append(_settings_line(run))
    parts.append(markdown_table(runs))
    lines = ratios(runs)
    if lines:
        parts.append("\nAggregate decode tok/s ratios (measured in the runs above):\n\n" + "\n".join(lines) + "\n")
    parts.append(
        "\nms/step is the mean over the timed steady-state steps (warm-up skipped): their end-to-end wall time "
        "(device synchronized before the first and after the last) over their number; median ms is the median "
        "of the single step() calls (unsynchronized: a diagnostic of outliers). (async): pipelined decode "
        "steps (async_scheduling). GB/step counts weights read "
        "once (the input embedding only by its rows) plus every resident KV slot read once per layer and request; "
        "% copy BW is that over the step time, against the device copy bandwidth measured in the same process. "
        "bytes-bound ms = GB/step / copy bandwidth; GPU busy ms (profiled steps, when asked) is the union of the "
        "device's kernel and copy intervals per step, so ms/step minus it is host time the GPU sat idle.\n"
    )
    return "\n".join(parts)


def _settings_line(run: dict) -> str:
    shape = run["model_shape"]
    params = ", ".join(f"{k}={v}" for k, v in run["method_params"].items())
    return (
        f"Settings: model `{run['model']}` ({run['load_format']} weights, {run['dtype']}; {shape['num_hidden_layers']} "
        f"layers, hidden {shape['hidden_size']}, {shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, "
        f"head_dim {shape['head_dim']}, intermediate {shape['intermediate_size']}, vocab {shape['vocab_size']}); "
        f"sparse_method `{run['sparse_method']}` ({params or 'no parameters'}), prefill_policy "
        f"`{run['prefill_policy']}`, chunk_size (max_num_batched_tokens) {run['chunk_size']}, block_size "
        f"{run['block_size']}, {run['num_kv_blocks']} KV blocks, gpu_memory_utilization "
        f"{run['gpu_memory_utilization']}, enforce_eager {run['enforce_eager']}, async_scheduling "
        f"{run.get('async_scheduling', False)}\n"
    )


def _plot(path: Path, invocations: list[dict]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:  # plots are optional: `uv sync --extra plot` (or the dev group) brings matplotlib
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    for r in all_runs(invocations):
        if "error" not in r:
            n = r["prompt_len"]
            key = f"{_label(r)}, " + (f"{n // 1024}K" if n >= 1024 else str(n))
            series.setdefault(key, []).append((r["batch_size"], r["metrics"]["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, points in sorted(series.items()):
        xs, ys = zip(*sorted(points), strict=True)
        hf = key.startswith("HF")
        ax.plot(xs, ys, marker="s" if hf else "o", linestyle=":" if hf else "-", label=key)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests decoding together)")
    ax.set_ylabel("aggregate decode tokens/s")
    gpu = invocations[-1]["environment"].get("gpu") or invocations[-1]["environment"].get("device")
    ax.set_title(f"Decode throughput ({gpu})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
