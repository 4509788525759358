"""Write benchmark invocations as ``bench.json``, markdown tables ``bench.md`` and ``bench.png``.

A folder may collect several invocations (``--append``: e.g. one per method); the tables and the
plot cover all of them, and the ratios (engine vs HF at batch 1, each method vs dense at dense's
largest batch, end to end vs dense) pair runs of the same prompt length.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparse_serve.bench.report_tables import (
    GB,
    GIB,  # noqa: F401 (agent_report's)
    _fmt,  # noqa: F401 (agent_report's)
    e2e_table,
    label,
    markdown_table,
    mode,
    prefill_table,
    profile_table,
    ratios,
)


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


def markdown_tables(runs: list[dict]) -> str:
    """The decode, prefill and end-to-end tables of ``runs`` (those that have rows)."""
    decode = markdown_table(runs) if any(mode(r) == "decode" for r in runs) else ""
    parts = [decode, prefill_table(runs), e2e_table(runs)]
    return "\n".join(p for p in parts if p)


def _kernels_note(env: dict) -> str:
    kernels = env.get("kernels")
    if not kernels:
        return ""
    pdl = "on" if kernels.get("pdl") else "off"
    swap = kernels.get("quantized_swap_ab")
    swapped = f", quantized decode dots transposed (per-token / KIVI) {swap}" if swap and any(swap) else ""
    pairs = ", KIVI codes in PTX pairs" if kernels.get("kivi_pairs") else ""
    pairs += ", KIVI values by channel group" if kernels.get("kivi_grouped") else ""
    pairs += f", KIVI decode at most {kernels['kivi_maxnreg']} registers" if kernels.get("kivi_maxnreg") else ""
    return f"; kernels: PDL {pdl}, small-M linear up to {kernels.get('small_m_linear_max_rows')} rows{swapped}{pairs}"


def markdown_report(invocations: list[dict]) -> str:
    runs = all_runs(invocations)
    parts = ["# sparse-serve bench\n"]
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
    decode = any(mode(r) == "decode" for r in runs)
    if decode:
        parts.append(markdown_table(runs))
    lines = ratios(runs)
    if lines:
        parts.append("\nRatios (measured in the runs above):\n\n" + "\n".join(lines) + "\n")
    if decode:
        parts.append(_DECODE_NOTE)
    prefill = prefill_table(runs)
    if prefill:
        parts += ["## Prefill\n", prefill, _PREFILL_NOTE]
    e2e = e2e_table(runs)
    if e2e:
        parts += ["## End to end\n", e2e, _E2E_NOTE]
    profiles = [p for inv in invocations for p in inv.get("prefill_profiles", [])]
    if profiles:
        parts += ["## Profiled prefill chunks\n", *(profile_table(p) for p in profiles)]
    return "\n".join(parts)


_DECODE_NOTE = (
    "\nms/step is the mean over the timed steady-state steps (warm-up skipped): their end-to-end wall time "
    "(device synchronized before the first and after the last) over their number; median ms is the median "
    "of the single step() calls (unsynchronized: a diagnostic of outliers). resident min-max: requests "
    "running before each timed step (with real prefill, decodes wait until the whole batch is prefilled). "
    "(async): pipelined decode steps (async_scheduling). GB/step counts weights read "
    "once (the input embedding only by its rows) plus every resident KV slot read once per layer and request; "
    "% copy BW is that over the step time, against the device copy bandwidth measured in the same process. "
    "(TP N, per GPU): under tensor parallelism GB/step, GB/s and % copy BW are one GPU's: its weight shard "
    "(replicated weights whole) and its KV heads. "
    "bytes-bound ms = GB/step / copy bandwidth; GPU busy ms (profiled steps, when asked) is the union of the "
    "device's kernel and copy intervals per step, so ms/step minus it is host time the GPU sat idle.\n"
)
_PREFILL_NOTE = (
    "\nprefill s: from the step of the batch's first chunk to the end of the step of its last (device "
    "synchronized; decodes held meanwhile, so prefill work only); HF transformers: one forward of the whole "
    "prompt (batch 1, fresh DynamicCache, logits of the last token only) after a short warm-up. TFLOP/s counts "
    "the q/k/v/o projections, the gated MLP, causal attention over the cached prefix (QK^T and PV) and the LM "
    "head of each prompt's last token, as dense (`sparse_serve.bench.flops`). vs HF: prefill tokens/s over HF's "
    "at batch 1 and the same prompt length (at batch 1, HF's seconds over ours); vs dense: over the dense "
    "engine's at the same prompt length and batch.\n"
)
_E2E_NOTE = (
    "\nEvery request arrives at once; wall s runs from the arrival to the last token (prefill included, the "
    "engine's own scheduling: chunked prefill mixed with decodes). total tok/s counts prompt and output "
    "tokens; TTFT is arrival to first token; mean ITL is each request's (last - first token) / (tokens - 1), "
    "averaged. vs dense: dense's wall time over this run's, same prompt, output and requests.\n"
)


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
    """Decode tok/s against the batch size; beside it, when any run timed its prefill, prefill TFLOP/s
    against the prompt length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: `uv sync --extra plot` (or the dev group) brings matplotlib
        return None
    runs = all_runs(invocations)
    decode: dict[str, list[tuple[int, float]]] = {}
    prefill: dict[str, list[tuple[int, float]]] = {}
    for r in (r for r in runs if "error" not in r and mode(r) == "decode"):
        n = r["prompt_len"]
        decode.setdefault(f"{label(r)}, " + (f"{n // 1024}K" if n >= 1024 else str(n)), []).append(
            (r["batch_size"], r["metrics"]["tokens_per_s"])
        )
    for r in (r for r in runs if (r.get("prefill_metrics") or {}).get("tflops_per_s") is not None):
        key = f"{label(r)}, batch {r['batch_size']}"
        prefill.setdefault(key, []).append((r["prompt_len"], r["prefill_metrics"]["tflops_per_s"]))
    panels = [p for p in (decode, prefill) if p]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    gpu = invocations[-1]["environment"].get("gpu") or invocations[-1]["environment"].get("device")
    for ax, series in zip(axes[0], panels, strict=True):
        _lines(ax, series)
        if series is decode:
            ax.set_yscale("log")
            ax.set_xlabel("batch size (requests decoding together)")
            ax.set_ylabel("aggregate decode tokens/s")
            ax.set_title(f"Decode throughput ({gpu})", fontsize=10)
        else:
            ax.set_xlabel("prompt length (tokens)")
            ax.set_ylabel("prefill TFLOP/s (dense-equivalent FLOPs)")
            ax.set_title(f"Prefill ({gpu})", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _lines(ax, series: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib.ticker

    for key, points in sorted(series.items()):
        xs, ys = zip(*sorted(points), strict=True)
        hf = key.startswith("HF")
        ax.plot(xs, ys, marker="s" if hf else "o", linestyle=":" if hf else "-", label=key)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
