"""The markdown tables of ``sparse-serve bench``: decode, prefill, end to end, profiled prefill chunks,
and the side-by-side ratios. A run without ``mode`` is a decode run (older bench.json files)."""

from __future__ import annotations

GB = 1e9
GIB = 2**30


def mode(run: dict) -> str:
    return run.get("mode", "decode")


def label(run: dict) -> str:
    if run["engine"] == "hf-transformers":
        return "HF transformers"
    text = run["sparse_method"]
    if run.get("prefill_sparse_method"):
        text += f" + {run['prefill_sparse_method']} prefill"
    store = run.get("kv_store", "")
    if store.startswith("quantized"):  # e.g. "kivi [kivi, 2 bits]", "snapkv [fp8, 8 bits]"
        text += " [" + store[store.rindex("(") + 1 : -1] + "]"  # the scheme's parentheses (summaries' come first)
    text += " (async)" if run.get("async_scheduling") else ""
    if run.get("tensor_parallel_size", 1) > 1:  # its bytes and bandwidth are one rank's
        text += f" (TP {run['tensor_parallel_size']}, per GPU)"
    if (run.get("kernels") or {}).get("pdl") is False:
        text += " (PDL off)"
    return text


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    return "" if value is None else f"{value / scale:.{digits}f}"


def _batch(run: dict) -> str:
    return f"{run['batch_size']} (max)" if run.get("batch_size_arg") == "max" else str(run["batch_size"])


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lines += ["| " + " | ".join(row + [""] * (len(head) - len(row))) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_table(runs: list[dict]) -> str:
    """Decode runs: step time, throughput, bytes and bandwidth, memory."""
    head = "engine / method | prefill | prompt | output | batch | resident min-max | steps | ms/step | median ms | "
    head += "tok/s | GB/step (W+KV) | GB/s | % copy BW | bytes-bound ms | GPU busy ms | peak GiB | KV in use GiB"
    rows = []
    for r in (r for r in runs if mode(r) == "decode"):
        cells = [label(r), r["prefill"], str(r["prompt_len"]), str(r["output_len"]), _batch(r)]
        if "error" in r:
            rows.append(cells + [f"error: {r['error'][:80]}"])
            continue
        m, raw = r["metrics"], r["raw"]
        lo, hi = m["min_running"], m.get("max_running", m["min_running"])
        cells += [
            str(lo) if lo == hi else f"{lo}-{hi}",
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
        rows.append(cells)
    return _table(head.split(" | "), rows)


def hf_prefill_speedup(run: dict, runs: list[dict]) -> float | None:
    """The engine's prefill tokens/s over HF transformers' (batch 1, same prompt length, same folder)."""
    if run["engine"] != "sparse-engine" or "prefill_metrics" not in run:
        return None
    for hf in runs:
        if hf["engine"] == "hf-transformers" and hf["prompt_len"] == run["prompt_len"] and "prefill_metrics" in hf:
            return run["prefill_metrics"]["tokens_per_s"] / hf["prefill_metrics"]["tokens_per_s"]
    return None


def _is_dense(run: dict) -> bool:
    return run["engine"] == "sparse-engine" and run["sparse_method"] == "dense" and not run.get("prefill_sparse_method")


def _dense_prefill_speedup(run: dict, runs: list[dict]) -> float | None:
    """The run's prefill tokens/s over dense's (same prompt length and batch), for the other methods."""
    if run["engine"] != "sparse-engine" or _is_dense(run) or "prefill_metrics" not in run:
        return None
    for d in runs:
        same = (d["prompt_len"], d["batch_size"]) == (run["prompt_len"], run["batch_size"])
        if _is_dense(d) and same and "prefill_metrics" in d:
            return run["prefill_metrics"]["tokens_per_s"] / d["prefill_metrics"]["tokens_per_s"]
    return None


def prefill_table(runs: list[dict]) -> str:
    """Runs with a timed prefill: seconds from the first chunk to the last, tokens/s, TFLOP/s, vs HF
    and vs dense (tokens/s ratios)."""
    head = "engine / method | prompt | batch | prefill s | prefill tok/s | TFLOP/s | attention % of FLOPs | "
    head += "vs HF (tok/s ratio) | vs dense (tok/s ratio) | peak GiB"
    rows = []
    for r in runs:
        cells = [label(r), str(r["prompt_len"]), _batch(r)]
        if "prefill_error" in r:
            rows.append(cells + [f"error: {r['prefill_error'][:80]}"])
        elif "prefill_metrics" in r:
            p = r["prefill_metrics"]
            x, y = hf_prefill_speedup(r, runs), _dense_prefill_speedup(r, runs)
            peak = p.get("peak_memory_bytes", (r.get("raw") or {}).get("peak_memory_bytes"))
            rows.append(
                cells
                + [
                    _fmt(p["seconds"], digits=2),
                    _fmt(p["tokens_per_s"], digits=0),
                    _fmt(p["tflops_per_s"], digits=1),
                    _fmt(p["attention_flops"] / p["flops"] if p["flops"] else None, 0.01, 1),
                    "" if x is None else f"{x:.2f}x",
                    "" if y is None else f"{y:.2f}x",
                    _fmt(peak, GIB, 1),
                ]
            )
    return _table(head.split(" | "), rows) if rows else ""


def e2e_table(runs: list[dict]) -> str:
    """End-to-end runs: wall time from the arrival to the last token, throughput, TTFT, vs dense."""
    head = "method | prompt | output | requests | wall s | vs dense (wall) | output tok/s | total tok/s | "
    head += "TTFT mean / p50 / p90 / max s | mean ITL ms | steps | preempted | peak GiB"
    rows = []
    e2e = [r for r in runs if mode(r) == "e2e"]
    for r in e2e:
        cells = [label(r), str(r["prompt_len"]), str(r["output_len"]), str(r["num_requests"])]
        if "error" in r:
            rows.append(cells + [f"error: {r['error'][:80]}"])
            continue
        m, raw = r["metrics"], r["raw"]
        dense = _e2e_dense(r, e2e)
        ttft = " / ".join(_fmt(m[f"ttft_{k}_s"], digits=2) for k in ("mean", "p50", "p90", "max"))
        rows.append(
            cells
            + [
                _fmt(m["wall_seconds"], digits=2),
                "" if dense is None else f"{dense['metrics']['wall_seconds'] / m['wall_seconds']:.2f}x",
                _fmt(m["output_tokens_per_s"]),
                _fmt(m["total_tokens_per_s"], digits=0),
                ttft,
                _fmt(m["mean_itl_ms"], digits=2),
                str(raw["steps"]),
                str(raw["preemptions"]),
                _fmt(raw.get("peak_memory_bytes"), GIB, 1),
            ]
        )
    return _table(head.split(" | "), rows) if rows else ""


def _e2e_dense(run: dict, e2e: list[dict]) -> dict | None:
    def shape(r: dict) -> tuple[int, int, int]:
        return r["prompt_len"], r["output_len"], r["num_requests"]

    dense = (r for r in e2e if _is_dense(r) and "error" not in r and shape(r) == shape(run))
    return next(dense, None)


def profile_table(profile: dict, top: int = 8) -> str:
    """One profiled prefill chunk: its top kernels (CPU operators on a CPU run) by time."""
    where = "GPU kernels" if profile["device"] == "cuda" else "CPU operators (self time)"
    title = (
        f"Prefill chunk profile: {profile['sparse_method']}, prompt {profile['prompt_len']}, chunk of "
        f"{profile['chunk_tokens']} tokens after {profile['prefix_len']} cached; busy {profile['busy_ms']:.1f} ms "
        f"({_fmt(profile['flops'] and profile['flops'] / profile['busy_ms'] / 1e9, digits=0)} TFLOP/s over busy "
        "time), step "
        f"{profile['step_ms_profiled']:.1f} ms under the profiler; top {where}:\n\n"
    )
    rows = [
        [
            k["name"].replace("|", "/"),
            _fmt(k["ms_per_step"], digits=2),
            f"{k['calls_per_step']:.0f}",
            _fmt(k["ms_per_step"] / profile["busy_ms"], 0.01, 1),
        ]
        for k in profile["top"][:top]
    ]
    return title + _table(["kernel", "ms", "calls", "% of busy"], rows)


def ratios(runs: list[dict]) -> list[str]:
    """Side-by-side ratios as markdown bullet lines: decode tok/s (engine vs HF, each method vs dense at
    dense's largest batch) and prefill (engine vs HF at batch 1)."""
    ok = [r for r in runs if "error" not in r and mode(r) == "decode"]
    engine = [r for r in ok if r["engine"] == "sparse-engine"]
    lines = []
    for hf in (r for r in ok if r["engine"] == "hf-transformers"):
        for r in engine:
            if r["sparse_method"] == "dense" and r["batch_size"] == 1 and r["prompt_len"] == hf["prompt_len"]:
                x = r["metrics"]["tokens_per_s"] / hf["metrics"]["tokens_per_s"]
                lines.append(f"- {label(r)} engine vs HF transformers, batch 1, prompt {r['prompt_len']}: **{x:.2f}x**")
    for r in engine:
        x = hf_prefill_speedup(r, runs)
        if x is not None and r["sparse_method"] == "dense" and r["batch_size"] == 1:
            lines.append(
                f"- prefill tok/s, {label(r)} engine vs HF transformers, batch 1, prompt {r['prompt_len']}: "
                f"**{x:.2f}x**"
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
