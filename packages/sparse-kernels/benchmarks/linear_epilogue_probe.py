"""The small-M projections with and without ``linear_epilogue``'s epilogues, side by side (GPU only).

Per Qwen3-8B projection at ``--rows`` token rows: the plain kernel (``linear``) against the epilogue each
takes in a fused decode layer (o and down: residual add + the next norm's scaled copy and sums of squares;
qkv: the row scale; gate/up: the row scale and ``silu(gate) * up``), plus the launches the epilogue
replaces (``fused_add_rms_norm`` after o / down, ``silu_and_mul`` after gate/up). Each timing replays a
CUDA graph over distinct weights (more bytes than the L2), as ``small_m_linear.py`` does.

Usage: ``python packages/sparse-kernels/benchmarks/linear_epilogue_probe.py [--rows 1,5] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import capture, median_ms  # benchmarks/ (run as scripts)

from sparse_kernels import fused_add_rms_norm, linear, silu_and_mul
from sparse_kernels.linear_epilogue import add_norm_inputs, linear_add_norm, linear_normed

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = {"qkv": 36, "o": 36, "gate_up": 16, "down": 16}


def per_call_us(fn, calls: int) -> float:
    return 1e3 * median_ms(capture(fn).replay, iters=10) / calls


def cases(name: str, m: int, gen: torch.Generator) -> dict:
    """``{label: fn}``: the plain kernel, it plus the launch its epilogue replaces, and the fused kernel."""
    n, k = SHAPES[name]
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    ws = [torch.randn(n, k, generator=gen, **bf16) * 0.02 for _ in range(LAYERS[name])]
    x = torch.randn(m, k, generator=gen, **bf16)
    hidden, g = torch.randn(m, n, generator=gen, **bf16), torch.ones(n, **bf16)
    normed = add_norm_inputs(x, torch.ones(k, **bf16), 1e-6)

    def bare():
        return [linear(x, w) for w in ws]

    if name in ("o", "down"):

        def glue():
            return [fused_add_rms_norm(linear(x, w), hidden, g, 1e-6) for w in ws]

        def fused():
            return [linear_add_norm(x, w, None, hidden, g, 1e-6) for w in ws]

    else:
        gated = name == "gate_up"

        def glue():
            return [silu_and_mul(linear(x, w)) if gated else linear(x, w) for w in ws]

        def fused():
            return [linear_normed(normed, w, gated=gated) for w in ws]

    return {"linear": bare, "linear + glue": glue, "fused": fused, "calls": len(ws)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for m in (int(v) for v in args.rows.split(",")):
        for name in SHAPES:
            fns = cases(name, m, gen)
            row = {"rows": m, "proj": name}
            for label in ("linear", "linear + glue", "fused"):
                row[label] = per_call_us(fns[label], fns["calls"])
            rows_out.append(row)
            print(
                f"M {m:>2} {name:<8} linear {row['linear']:7.2f} us  + glue launch {row['linear + glue']:7.2f}"
                f"  fused {row['fused']:7.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
