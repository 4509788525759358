"""``sparse-serve bench-agent``: the agent workload (``bench.agent``) over several concurrency levels on
one engine, one system per invocation (``--append`` collects systems in one folder)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from sparse_serve.bench.command import DEFAULT_BENCH_MODEL, _command_line, _ints


def _range(text: str) -> tuple[int, int]:
    values = _ints(text)
    if len(values) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected N or MIN,MAX, got {text!r}")
    return (values[0], values[-1])


def add_agent_parser(sub, add_engine_flags: Callable, engine_config_from_args: Callable) -> None:
    """Register ``bench-agent`` on the CLI's subparsers (the engine flags come from ``cli``)."""
    p = sub.add_parser(
        "bench-agent", help="concurrent multi-turn agent sessions end to end (chains vs radix prefix cache)"
    )
    p.add_argument("--model", default=str(DEFAULT_BENCH_MODEL), help="model folder (default: Qwen3-8B shape config)")
    p.add_argument(
        "--sessions", type=_ints, default=(4, 8, 16), help="comma-separated concurrency levels S, run in order"
    )
    p.add_argument("--turns", type=int, default=8, help="turns per session (the first is system + task)")
    p.add_argument("--system-tokens", type=int, default=2048, help="system prompt shared by every session of a run")
    p.add_argument("--task-tokens", type=int, default=512, help="each session's own task after the system prompt")
    p.add_argument("--tool-tokens", type=_range, default=(2048, 4096), help="tool output per later turn: N or MIN,MAX")
    p.add_argument("--output-tokens", type=int, default=256, help="tokens generated per turn (ignore_eos)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the token ids (a run of S uses seed + S)")
    p.add_argument("--no-warmup", action="store_true", help="skip the small untimed run before the sweep")
    p.add_argument(
        "--max-seconds", type=float, help="time budget from the engine's load on: skip runs estimated not to fit"
    )
    p.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--out", type=Path, default=Path("results/agent/latest"), help="folder for agent.json/.md/.png")
    p.add_argument("--append", action="store_true", help="add to the folder's agent.json instead of replacing it")
    p.add_argument("--no-progress", action="store_true")
    add_engine_flags(p)
    p.set_defaults(func=lambda args: _bench_agent(args, engine_config_from_args), bench_parser=p)


def run_agent_sweep(
    config,
    base,
    sessions: tuple[int, ...],
    *,
    warmup: bool = True,
    commit: str | None = None,
    progress: bool = False,
    max_seconds: float | None = None,
    on_update: Callable[[dict], None] = lambda invocation: None,
) -> dict:
    """One engine for ``config``; an untimed warm-up (unless not ``warmup``), then ``base`` at each S in
    the order given (run seed = ``base.seed + S``: the same S gets the same tokens on every system).

    ``max_seconds`` (from the engine's load on): a run is skipped when the time left is less than an
    estimate of it from the last run (``estimate_seconds``). ``on_update`` gets
    the invocation after each run, so a report survives a later crash or kill.
    """
    from sparse_serve.bench.agent import run_agent_workload
    from sparse_serve.bench.probes import environment
    from sparse_serve.bench.suite import engine_settings
    from sparse_serve.engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(config)
    load = time.perf_counter() - start
    invocation = {
        "environment": environment(engine.runner.device, commit),
        "settings": engine_settings(engine),
        "load_seconds": load,
        "warmup_seconds": 0.0,
        "max_seconds": max_seconds,
        "runs": [],
        "runs_skipped": [],
    }
    try:
        if warmup:  # compiles kernels and touches every path (compression too) before anything is timed
            t0 = time.perf_counter()
            small = dataclasses.replace(base, num_sessions=2, num_turns=min(base.num_turns, 3), output_tokens=8)
            run_agent_workload(engine, small)
            invocation["warmup_seconds"] = time.perf_counter() - t0
        _log(progress, f"engine load {load:.1f} s, warm-up {invocation['warmup_seconds']:.1f} s")
        last: dict | None = None
        for s in sessions:
            left = None if max_seconds is None else max_seconds - (time.perf_counter() - start)
            estimate = None if last is None else estimate_seconds(last, s)
            if left is not None and estimate is not None and estimate > left:
                invocation["runs_skipped"].append({"num_sessions": s, "estimate_s": estimate, "left_s": left})
                _log(progress, f"S={s} skipped: needs ~{estimate:.0f} s, {left:.0f} s left")
                continue
            run = run_agent_workload(engine, dataclasses.replace(base, num_sessions=s, seed=base.seed + s))
            invocation["runs"].append(run)
            last = run
            on_update(invocation)
            _log(progress, _run_line(run))
    except Exception as e:  # noqa: BLE001 - recorded in the report; the engine's state is unknown after it
        invocation["error"] = f"{type(e).__name__}: {e}"[:1000]
        _log(True, traceback.format_exc())
    on_update(invocation)
    del engine
    gc.collect()
    return invocation


def estimate_seconds(last: dict, num_sessions: int) -> float:
    """Wall time of a run at ``num_sessions`` from the ``last`` run's: the work outside decode-only
    steps (prefill, mixed) scales with the sessions; decode-only steps number about turns x output
    tokens whatever S is, each longer with a larger batch (taken as the square root of the ratio)."""
    m = last["summary"]
    ratio = num_sessions / last["workload"]["num_sessions"]
    decode = min(m["run_seconds_by_kind"].get("decode", 0.0), m["wall_seconds"])
    return (m["wall_seconds"] - decode) * ratio + decode * max(1.0, ratio) ** 0.5


def _log(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _run_line(run: dict) -> str:
    m = run["summary"]
    secs = {k: round(v, 2) for k, v in m["run_seconds_by_kind"].items()}
    return (
        f"{run['system']} S={run['workload']['num_sessions']}: {m['wall_seconds']:.1f} s, {m['turns_per_s']:.2f} "
        f"turns/s, prefilled {m['prefilled_tokens']}, preemptions {m['preemptions']}, steps {m['steps_by_kind']}, "
        f"forward s {secs}, peak blocks {m['peak_kv_blocks_in_use']}/{m['num_kv_blocks']}"
    )


def _bench_agent(args: argparse.Namespace, engine_config_from_args: Callable) -> int:
    from sparse_serve.bench.agent import AgentWorkload
    from sparse_serve.bench.agent_report import markdown_table, read_invocations, write_agent_report
    from sparse_serve.config import EngineConfig

    config = engine_config_from_args(args)
    if "load_format" not in config.model_fields_set:  # benchmarks default to random weights
        config = EngineConfig(**config.model_dump(exclude_unset=True), load_format="dummy")
    base = AgentWorkload(
        num_sessions=1,
        num_turns=args.turns,
        system_tokens=args.system_tokens,
        task_tokens=args.task_tokens,
        tool_tokens=args.tool_tokens,
        output_tokens=args.output_tokens,
        seed=args.workload_seed,
    )
    out, previous = args.out, read_invocations(args.out) if args.append else []
    command = _command_line(args).replace("sparse-serve bench", "sparse-serve bench-agent", 1)
    paths: list[Path] = []

    def write(invocation: dict) -> None:
        paths[:] = write_agent_report(out, [*previous, {**invocation, "command": command}])

    invocation = run_agent_sweep(
        config,
        base,
        args.sessions,
        warmup=not args.no_warmup,
        commit=args.commit,
        progress=not args.no_progress,
        max_seconds=args.max_seconds,
        on_update=write,
    )
    print(markdown_table(invocation["runs"]))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 1 if "error" in invocation else 0
