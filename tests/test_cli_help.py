"""``--help`` says what each flag defaults to (per method for the shared method parameters), and the
generated text ends its line before the stats line, also when stdout and stderr share one pipe."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import sparse_methods
from sparse_serve.cli import build_parser


@functools.cache
def _flag_help(command: str) -> dict[str, str]:
    """``--flag`` -> its help text as ``sparse-serve COMMAND --help`` prints it (``%(default)s`` filled in)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {a.option_strings[0]: (a.help or "") % {"default": a.default} for a in sub._actions if a.option_strings}


def test_method_flags_give_each_methods_default():
    for name in sorted(sparse_methods.parameter_fields()):
        _check_method_flag(name, _flag_help("generate")["--" + name.replace("_", "-")])


def _check_method_flag(name: str, text: str) -> None:
    # "[<methods>] <description> (default <value>)", groups joined by "; "
    parts = re.split(r"(?:^|; )\[([a-z0-9_, ]+)\] ", text)[1:]
    groups = {m: rest for names, rest in zip(parts[::2], parts[1::2], strict=True) for m in names.split(", ")}
    for method in sparse_methods.method_names():
        field = sparse_methods.get_method_class(method).Config.model_fields.get(name)
        if field is None:
            assert method not in groups, f"--{name}: {text}"
        else:
            expected = f"{(field.description or '').rstrip('.')} (default {field.default!r})"
            assert groups[method] == expected, f"--{name}: {text}"


def test_decode_keep_tokens_help_is_per_method():
    text = _flag_help("generate")["--decode-keep-tokens"]
    assert "[adakv, pyramidkv, snapkv] Best-scored middle tokens kept, in tokens (default 7616)" in text
    assert "[omnikv] Tokens the filter layers select, in tokens (default 4096)" in text


def test_eval_help_shows_defaults():
    helps = _flag_help("eval")
    for flag in ("--tasks", "--context-lengths", "--depths", "--samples-per-cell", "--eval-seed", "--out"):
        assert "(default: " in helps[flag], flag
    assert "(default: 512,1024,2048,4096)" in helps["--context-lengths"]
    assert "(default: 16)" in helps["--block-size"]


def test_generated_text_ends_its_line():
    r = subprocess.run(
        [sys.executable, "-m", "sparse_serve.cli", "generate", "--prompt", "Return the", "--max-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout
    text, stats = r.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.strip() and stats.startswith("[8 tokens") and r.stdout.endswith("]\n")
