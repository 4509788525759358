"""``sparse-serve`` command line: ``generate`` for one-off text generation."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from sparse_serve.config import EngineConfig
from sparse_serve.sampling_params import SamplingParams

DEFAULT_MODEL = Path(__file__).parent / "assets" / "tiny-qwen3"


def _flag_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(args)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return _flag_type(args[0])
    if annotation is bool:
        return "bool", None
    return annotation, None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (``--block-size`` for ``block_size``), defaults left to the config."""
    group = parser.add_argument_group("engine config (same names as EngineConfig / LLM(...))")
    group.add_argument("--config", type=Path, help="JSON file of engine config fields; flags override it")
    for name, field in EngineConfig.model_fields.items():
        if name == "model":
            continue
        kind, choices = _flag_type(field.annotation)
        flag = "--" + name.replace("_", "-")
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        else:
            group.add_argument(flag, type=kind, choices=choices, default=None, help=field.description)


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
    sys.stdout.write("\n")
    print(
        f"[{len(finished.token_ids)} tokens, finish_reason={finished.finish_reason}, "
        f"prompt_tokens={len(finished.prompt_token_ids)}]",
        file=sys.stderr,
    )
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
