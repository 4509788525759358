"""``sparse-serve`` command line: ``generate`` for one-off text generation."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic_core import PydanticUndefined

import sparse_methods
from sparse_serve.cli_help import method_parameter_help
from sparse_serve.config import EngineConfig
from sparse_serve.sampling_params import SamplingParams

DEFAULT_MODEL = Path(__file__).parent / "assets" / "tiny-retrieval"


def _flag_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), list(args)  # int literals (kivi_bits) parse as ints
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return _flag_type(args[0])
    if annotation is bool:
        return "bool", None
    return annotation, None


def _with_default(field) -> str | None:
    if field.default is None or field.default is PydanticUndefined:
        return field.description
    return f"{field.description or ''} (default: {field.default})".strip()


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (``--block-size`` for ``block_size``), defaults left to the config."""
    group = parser.add_argument_group("engine config (same names as EngineConfig / LLM(...))")
    group.add_argument("--config", type=Path, help="JSON file of engine config fields; flags override it")
    method_params = sparse_methods.parameter_fields()
    for name, field in EngineConfig.model_fields.items():
        if name == "model":
            continue
        kind, choices = _flag_type(field.annotation)
        flag = "--" + name.replace("_", "-")
        # A method parameter's meaning and default depend on the method: the help lists each one's.
        text = method_parameter_help(name) if name in method_params else _with_default(field)
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, type=kind, choices=choices, default=None, help=text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {n: getattr(args, n) for n in EngineConfig.model_fields if getattr(args, n, None) is not None}
    overrides["model"] = str(args.model)
    if args.config is not None:
        return EngineConfig.from_json(args.config, **overrides)
    return EngineConfig(**overrides)


def _generate(args: argparse.Namespace) -> int:
    from sparse_serve.llm import LLM

    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**config.model_dump())
    prompt = [int(t) for t in args.prompt_token_ids.split(",")] if args.prompt_token_ids else args.prompt
    if not args.prompt_token_ids and prompt is None:
        raise ValueError("give --prompt or --prompt-token-ids")
    finished = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        finished = out
    sys.stdout.write("\n")  # the text ends its line before the stats line, even with both streams in one pipe
    sys.stdout.flush()
    print(
        f"[{len(finished.token_ids)} tokens, finish_reason={finished.finish_reason}, "
        f"prompt_tokens={len(finished.prompt_token_ids)}]",
        file=sys.stderr,
    )
    return 0


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values: {e}") from e

    return parse


def _eval(args: argparse.Namespace) -> int:
    from sparse_serve.eval.harness import EvalGrid, make_samples, results_as_dicts, run_eval, summarize
    from sparse_serve.eval.report import markdown_table, write_report
    from sparse_serve.eval.tasks import Haystack
    from sparse_serve.llm import LLM

    grid = EvalGrid(args.tasks, args.context_lengths, args.depths, args.samples_per_cell, args.eval_seed)
    config = engine_config_from_args(args)
    llm = LLM(**config.model_dump())
    samples = make_samples(grid, llm.tokenizer, Haystack.from_stdlib())
    results = run_eval(llm, samples, progress=not args.no_progress)
    summary = summarize(results)
    settings = {
        **config.model_dump(exclude_defaults=True),
        "model": _display_path(config.model),
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "sparse_method": config.model_dump().get("sparse_method", "dense"),
        "grid": {name: getattr(grid, name) for name in grid.__slots__},
    }
    paths = write_report(args.out, summary, results_as_dicts(results), settings)
    print(markdown_table(summary))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _display_path(path: str) -> str:
    """A path relative to the working directory when it lies below it (reports stay machine-neutral)."""
    p = Path(path).resolve()
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(path)


def _serve(args: argparse.Namespace) -> int:
    from sparse_serve.server import run_server
    from sparse_serve.server.cli_args import server_config_from_args

    run_server(engine_config_from_args(args), server_config_from_args(args))
    return 0


def _methods(args: argparse.Namespace) -> int:
    """Print the method registry: declarations and each parameter's default."""
    import sparse_methods

    for name in sparse_methods.method_names():
        cls = sparse_methods.get_method_class(name)
        aliases = getattr(cls, "aliases", ())
        also = f" (also: {', '.join(aliases)})" if aliases else ""
        print(
            f"{name}{also}: {cls.category} | prefill_policy={cls.prefill_policy} | prefix_cache={cls.prefix_cache_mode}"
        )
        for field, info in cls.Config.model_fields.items():
            print(f"    {field}={info.default!r}  {info.description or ''}")
    print("prefill_sparse_method: " + ", ".join(sparse_methods.prefill_method_names()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-serve", description="SparseEngine command line")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    gen.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: embedded tiny model)"
    )
    gen.add_argument("--prompt", help="prompt text")
    gen.add_argument("--prompt-token-ids", help="prompt as comma-separated token ids (instead of --prompt)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_flags(gen)
    gen.set_defaults(func=_generate)

    ev = sub.add_parser("eval", help="long-context retrieval accuracy (RULER/NIAH-style) through the engine")
    ev.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: embedded model)")
    # String defaults go through `type` like typed values, and print as typed in --help.
    ev.add_argument(
        "--tasks",
        type=_csv(str),
        default="niah_single",
        help="comma-separated task names: niah_single, niah_multikey, niah_multivalue, variable_tracking, "
        "multiturn_recall (default: %(default)s)",
    )
    ev.add_argument(
        "--context-lengths", type=_csv(int), default="512,1024,2048,4096", help="prompt lengths (default: %(default)s)"
    )
    ev.add_argument(
        "--depths", type=_csv(float), default="0,0.25,0.5,0.75,1", help="needle depths (default: %(default)s)"
    )
    ev.add_argument("--samples-per-cell", type=int, default=4, help="samples per (task, length, depth) (default: 4)")
    ev.add_argument("--eval-seed", type=int, default=0, help="seed of the generated samples (default: 0)")
    ev.add_argument(
        "--out",
        type=Path,
        default=Path("results/eval"),
        help="folder for eval.json, eval.md and the heatmap (default: %(default)s, the committed results: give "
        "another folder for trial runs)",
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_flags(ev)
    ev.set_defaults(func=_eval)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    srv.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: embedded model)")
    from sparse_serve.server.cli_args import add_server_flags

    add_server_flags(srv)
    add_engine_flags(srv)
    srv.set_defaults(func=_serve)

    sub.add_parser("methods", help="list the sparse methods with their parameters and defaults").set_defaults(
        func=_methods
    )

    from sparse_serve.bench.command import add_bench_parser

    add_bench_parser(sub, add_engine_flags, engine_config_from_args)
    from sparse_serve.bench.agent_command import add_agent_parser

    add_agent_parser(sub, add_engine_flags, engine_config_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"sparse-serve: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
