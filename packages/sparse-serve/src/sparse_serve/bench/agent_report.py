"""Write agent-workload invocations as ``agent.json``, a markdown report ``agent.md`` and ``agent.png``.

A folder collects one invocation per system (``--append``: each system runs in its own process,
one engine each); the table, the ratios and the plot cover all of them. Ratios pair runs of the
same workload shape (everything but the seed): at matched concurrency the end-to-end times of the
same work, and at each system's best concurrency (highest turns/s) the throughputs.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparse_serve.bench.report import GIB, _fmt

_SHAPE_KEYS = ("num_turns", "system_tokens", "task_tokens", "tool_tokens", "output_tokens")


def read_invocations(out_dir: str | Path) -> list[dict]:
    """The invocations already in ``out_dir/agent.json`` (none when there is no such file)."""
    path = Path(out_dir) / "agent.json"
    return json.loads(path.read_text())["invocations"] if path.exists() else []


def write_agent_report(out_dir: str | Path, invocations: list[dict]) -> list[Path]:
    """Write ``invocations`` as ``out_dir/agent.json`` (replacing it), ``agent.md`` and ``agent.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "agent.json"
    path.write_text(json.dumps({"invocations": invocations}, indent=1))
    md = out / "agent.md"
    md.write_text(markdown_report(invocations))
    png = _plot(out / "agent.png", invocations)
    return [path, md] if png is None else [path, md, png]


def all_runs(invocations: list[dict]) -> list[dict]:
    """Every run, invocation by invocation, each invocation's by concurrency."""
    return [run for inv in invocations for run in sorted(inv["runs"], key=lambda r: r["workload"]["num_sessions"])]


def _shape(run: dict) -> tuple:
    w = run["workload"]
    return tuple(tuple(w[k]) if isinstance(w[k], list) else w[k] for k in _SHAPE_KEYS)


def markdown_table(runs: list[dict]) -> str:
    head = (
        "| system | S | turns | tool tok | out tok | max prompt | prefilled | radix hit | chain reused | decode tok "
        "| wall s | turns/s | out tok/s | latency mean / p50 / p90 s | TTFT mean / p50 / p90 s | preempt "
        "| peak KV GiB |"
    )
    lines = [head, "|---" * 17 + "|"]
    for r in runs:
        w, m = r["workload"], r["summary"]
        lat, ttft = m["turn_latency_s"], m["ttft_s"]
        cells = [
            r["system"],
            str(w["num_sessions"]),
            str(m["num_turns_done"]),
            "{}-{}".format(*w["tool_tokens"]),
            str(w["output_tokens"]),
            str(m["max_prompt_tokens"]),
            str(m["prefilled_tokens"]),
            str(m["cached_tokens"]),
            str(m["reused_tokens"]),
            str(m["output_tokens"]),
            _fmt(m["wall_seconds"], digits=1),
            _fmt(m["turns_per_s"], digits=2),
            _fmt(m["output_tokens_per_s"], digits=0),
            " / ".join(_fmt(lat[k], digits=2) for k in ("mean", "p50", "p90")),
            " / ".join(_fmt(ttft[k], digits=2) for k in ("mean", "p50", "p90")),
            str(m["preemptions"]),
            _fmt(m["peak_kv_bytes_in_use"], GIB, 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ratios(runs: list[dict]) -> list[str]:
    """Each chain system against each radix system of the same workload shape, as markdown bullets."""
    lines = []
    for shape in dict.fromkeys(_shape(r) for r in runs):
        same = [r for r in runs if _shape(r) == shape]
        radix = [r for r in same if r["prefix_cache_mode"] == "radix"]
        chain = [r for r in same if r["prefix_cache_mode"] == "chain"]
        for base in {r["system"] for r in radix}:
            for other in {r["system"] for r in chain}:
                lines += _pair([r for r in radix if r["system"] == base], [r for r in chain if r["system"] == other])
    return lines


def _pair(base: list[dict], other: list[dict]) -> list[str]:
    def s(r):
        return r["workload"]["num_sessions"]

    lines = []
    by_s = {s(r): r for r in base}
    for r in other:
        b = by_s.get(s(r))
        if b is not None:
            x = b["summary"]["wall_seconds"] / r["summary"]["wall_seconds"]
            lines.append(
                f"- matched S={s(r)}: {r['system']} {r['summary']['wall_seconds']:.1f} s vs {b['system']} "
                f"{b['summary']['wall_seconds']:.1f} s end to end for the same turns: speedup **{x:.2f}x**"
            )
    best_b = max(base, key=lambda r: r["summary"]["turns_per_s"])
    best_o = max(other, key=lambda r: r["summary"]["turns_per_s"])
    x = best_o["summary"]["turns_per_s"] / best_b["summary"]["turns_per_s"]
    lines.append(
        f"- best S: {best_o['system']} at S={s(best_o)} {best_o['summary']['turns_per_s']:.2f} turns/s vs "
        f"{best_b['system']} at S={s(best_b)} {best_b['summary']['turns_per_s']:.2f} turns/s: speedup **{x:.2f}x**"
    )
    return lines


def markdown_report(invocations: list[dict]) -> str:
    runs = all_runs(invocations)
    parts = ["# Agent workload: concurrent multi-turn sessions, end to end\n"]
    for i, inv in enumerate(invocations):
        env, st = inv["environment"], inv["settings"]
        params = ", ".join(f"{k}={v}" for k, v in st["method_params"].items()) or "no parameters"
        parts.append(
            f"Invocation {i + 1}: `{inv.get('command', '')}`  \n"
            f"{env.get('gpu') or env.get('device')}, torch {env.get('torch')}, commit `{env.get('commit')}`; "
            f"`{st['sparse_method']}` ({params}), prefill_policy `{st['prefill_policy']}`, chunk "
            f"(max_num_batched_tokens) {st['chunk_size']}, block_size {st['block_size']}, {st['num_kv_blocks']} KV "
            f"blocks ({st['num_kv_blocks'] * st['kv_bytes_per_block'] / GIB:.1f} GiB), prefix caching "
            f"{st['engine_config'].get('enable_prefix_caching', True)}; engine load {inv['load_seconds']:.1f} s, "
            f"warm-up {inv['warmup_seconds']:.1f} s\n"
        )
        for skipped in inv.get("runs_skipped", []):
            parts.append(
                f"- S={skipped['num_sessions']} not run: estimated {skipped['estimate_s']:.0f} s, "
                f"{skipped['left_s']:.0f} s of the invocation's {inv['max_seconds']:.0f} s budget left\n"
            )
        if "error" in inv:
            parts.append(f"- stopped by an error: `{inv['error'][:300]}`\n")
    parts.append(markdown_table(runs))
    lines = ratios(runs)
    if lines:
        parts.append(
            "\nChain systems against radix systems (measured in the runs above):\n\n" + "\n".join(lines) + "\n"
        )
    parts.append(
        "\nS = concurrent sessions (closed loop: a session's next turn is submitted when its previous one "
        "finishes). prefilled = prompt rows the model computed (recomputes after preemption included); radix "
        "hit = prompt tokens served by the prefix cache; chain reused = prompt tokens resumed from a chain's "
        "retained KV; latency = submit to last token of a turn; TTFT = submit to its first token; peak KV = "
        "most blocks referenced at once (running requests and idle chains).\n"
    )
    return "\n".join(parts)


def _plot(path: Path, invocations: list[dict]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return None
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in all_runs(invocations):
        m = r["summary"]
        series.setdefault(r["system"], []).append((r["workload"]["num_sessions"], m["wall_seconds"], m["turns_per_s"]))
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in sorted(series.items()):
        xs, walls, rates = zip(*sorted(points), strict=True)
        ax_t.plot(xs, walls, marker="o", label=name)
        ax_r.plot(xs, rates, marker="o", label=name)
    for ax, label in ((ax_t, "end-to-end time (s)"), (ax_r, "turns / s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent sessions S")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    env = invocations[-1]["environment"]
    w = all_runs(invocations)[-1]["workload"]
    fig.suptitle(
        f"Agent workload on {env.get('gpu') or env.get('device')}: {w['num_turns']} turns, tool "
        "{}-{} tok, {} out tok per turn".format(*w["tool_tokens"], w["output_tokens"]),
        fontsize=10,
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
