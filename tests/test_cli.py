"""The README's main command as a user runs it, in process (``main(argv)``: the same parser, config and
generation; ``test_cli_help.test_generated_text_ends_its_line`` runs it as a subprocess, through
``python -m sparse_serve.cli``)."""

import json

import pytest
from tiny_models import DEFAULT_MODEL


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``sparse-serve ARGS``: its exit code (argparse's and the CLI's errors exit through ``SystemExit``),
    stdout and stderr."""
    from sparse_serve.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_default_model(capsys):
    code, out, err = _main(capsys, "generate", "--prompt", "Return the", "--max-tokens", "8", "--device", "cpu")
    assert code == 0, err
    assert out.strip(), "no text streamed"
    assert "finish_reason=length" in err and "[8 tokens" in err or "finish_reason=stop" in err


def test_generate_with_flags_and_config_file(tmp_path, capsys):
    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"block_size": 4, "max_num_batched_tokens": 5}))
    code, _, err = _main(
        capsys,
        "generate",
        "--model",
        str(DEFAULT_MODEL),
        "--prompt-token-ids",
        "5,6,7,8,9,10,11",
        "--config",
        str(cfg),
        "--max-num-seqs",
        "2",
        "--device",
        "cpu",
        "--max-tokens",
        "3",
        "--ignore-eos",
    )
    assert code == 0, err
    assert "3 tokens" in err


def test_unknown_flag_and_bad_config_are_clear_errors(tmp_path, capsys):
    code, _, err = _main(capsys, "generate", "--prompt", "x", "--blok-size", "4")
    assert code == 2 and "unrecognized arguments: --blok-size" in err
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"blok_size": 4}))
    code, _, err = _main(capsys, "generate", "--prompt", "x", "--config", str(cfg), "--device", "cpu")
    assert code == 2 and "blok_size" in err


def test_quantized_kv_flags_parse_their_integer_choices(capsys):
    """``--kivi-bits 2`` is an int choice (a string "2" would be refused by argparse's choices), and a bit width
    outside the choices is a clear error (the parser and the config it makes, without generating)."""
    from sparse_serve.cli import build_parser, engine_config_from_args

    base = ["generate", "--prompt", "Return the", "--device", "cpu"]
    args = build_parser().parse_args([*base, "--sparse-method", "kivi", "--kivi-bits", "2"])
    config = engine_config_from_args(args)
    assert config.sparse_method == "kivi" and config.kivi_bits == 2 and isinstance(config.kivi_bits, int)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*base, "--kv-cache-dtype", "turboquant", "--turboquant-bits", "5"])
    assert exit_info.value.code != 0 and "invalid choice" in capsys.readouterr().err


def test_method_aliases_resolve_and_are_listed(capsys):
    """SE's spellings of a method (``skip-kv``, ``skip_kv``) name the registered one everywhere."""
    from sparse_serve.cli import build_parser, engine_config_from_args, main

    args = build_parser().parse_args(["generate", "--prompt", "x", "--sparse-method", "skip-kv"])
    assert engine_config_from_args(args).sparse_method == "skipkv"
    assert main(["methods"]) == 0
    assert "skipkv (also: skip-kv, skip_kv): physical eviction" in capsys.readouterr().out
