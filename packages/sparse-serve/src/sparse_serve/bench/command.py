"""``sparse-serve bench``: decode throughput against the memory roofline, prefill time and TFLOP/s,
end-to-end batches, with an HF baseline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_BENCH_MODEL = Path(__file__).parent / "configs" / "qwen3-8b"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {e}") from e


def _batches(text: str) -> tuple[int | None, ...]:
    """``1,8,max`` -> (1, 8, None); None is the largest batch that fits."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        if x == "max":
            out.append(None)
        elif x.isdigit() and int(x) > 0:
            out.append(int(x))
        else:
            raise argparse.ArgumentTypeError(f"batch sizes are positive integers or 'max', got {x!r}")
    return tuple(out)


def add_bench_parser(sub, add_engine_flags: Callable, engine_config_from_args: Callable) -> None:
    """Register ``bench`` on the CLI's subparsers (the engine flags come from ``cli``)."""
    p = sub.add_parser(
        "bench", help="decode throughput (tok/s, ms/step, bandwidth vs copy), prefill TFLOP/s, e2e + HF baseline"
    )
    p.add_argument("--model", default=str(DEFAULT_BENCH_MODEL), help="model folder (default: Qwen3-8B shape config)")
    p.add_argument("--prompt-len", type=_ints, default=(32768, 131072), help="comma-separated prompt lengths")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (memory planned for all)")
    p.add_argument("--batch-size", type=_batches, default=(1, None), help="comma-separated batch sizes; 'max' fits")
    p.add_argument(
        "--prefill",
        choices=("synthetic", "real"),
        default="synthetic",
        help="synthetic: the KV a method keeps after prefill, filled with noise; real: run the prompts "
        "(timed: prefill seconds, tokens/s, TFLOP/s; decodes wait until the whole batch is prefilled)",
    )
    p.add_argument(
        "--e2e",
        type=_ints,
        default=(),
        metavar="N[,N...]",
        help="end-to-end mode instead of the decode cases: N requests of --prompt-len in / --output-len out "
        "arrive at once; wall time to the last token (prefill included), tokens/s, TTFT",
    )
    p.add_argument(
        "--profile-prefill",
        action="store_true",
        help="profile one prefill chunk per prompt length (its last: after the whole prefix); top kernels",
    )
    p.add_argument("--warmup-steps", type=int, default=3, help="decode steps run before timing")
    p.add_argument("--timed-steps", type=int, default=None, help="decode steps timed (default: all remaining)")
    p.add_argument("--profile-steps", type=int, default=0, help="extra steps under the profiler (GPU busy ms/step)")
    p.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also time HF transformers at batch 1 (run first): decode, and prefill with --prefill real",
    )
    p.add_argument("--hf-steps", type=int, default=20, help="HF decode steps timed per prompt length")
    p.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--out", type=Path, default=Path("results/bench/latest"), help="folder for bench.json/.md/.png")
    p.add_argument("--append", action="store_true", help="add to the folder's bench.json instead of replacing it")
    p.add_argument("--no-progress", action="store_true")
    add_engine_flags(p)
    p.set_defaults(func=lambda args: _bench(args, engine_config_from_args), bench_parser=p)


def _command_line(args: argparse.Namespace) -> str:
    """The invocation as flags, defaults left out (what the report's readers rerun)."""
    parser: argparse.ArgumentParser = args.bench_parser
    parts = ["sparse-serve", "bench"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == action.default or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            parts.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            parts.append(flag)
        elif isinstance(value, tuple):
            parts += [flag, ",".join("max" if v is None else str(v) for v in value)]
        else:
            parts += [flag, str(value)]
    return " ".join(parts)


def _bench(args: argparse.Namespace, engine_config_from_args: Callable) -> int:
    from sparse_serve.bench.report import markdown_tables, write_report
    from sparse_serve.bench.suite import BenchPlan, run_bench
    from sparse_serve.config import EngineConfig

    config = engine_config_from_args(args)
    if "load_format" not in config.model_fields_set:  # benchmarks default to random weights
        config = EngineConfig(**config.model_dump(exclude_unset=True), load_format="dummy")
    plan = BenchPlan(
        prompt_lens=args.prompt_len,
        batch_sizes=args.batch_size,
        output_len=args.output_len,
        prefill=args.prefill,
        warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps,
        profile_steps=args.profile_steps,
        hf_baseline=args.hf_baseline,
        hf_steps=args.hf_steps,
        e2e=args.e2e,
        profile_prefill=args.profile_prefill,
        seed=config.seed,
        commit=args.commit,
    )
    report = run_bench(config, plan, progress=not args.no_progress)
    report["command"] = _command_line(args)
    paths = write_report(args.out, report, append=args.append)
    print(markdown_tables(report["runs"]))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0
