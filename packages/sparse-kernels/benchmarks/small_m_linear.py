"""Small-M linear (decode projections) against cuBLAS, side by side (GPU only).

Shapes: Qwen3-8B's projections (qkv 6144x4096, o 4096x4096, gate/up 24576x4096, down 4096x12288,
lm head 151936x4096), bf16, M = 1, 2, 4, 8, 16 token rows (``--rows``; above 16 rows, as at a large decode
batch, the sweep uses shorter K tiles). Each timing replays a CUDA graph of the
projection over ``LAYERS`` distinct weights (as a decode step runs the layers; more bytes than the
60 MB L2), so time per call = graph time / calls. Achieved bandwidth = weight bytes / time per call,
against the device copy bandwidth (read + write) measured in the same run. Every Triton variant's
output is checked against ``F.linear`` (max |diff| in the table). Sweeps the kernel's launch shape.

Usage: ``python packages/sparse-kernels/benchmarks/small_m_linear.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from _timing import capture, copy_bandwidth, median_ms  # benchmarks/ (run as scripts)

from sparse_kernels._triton import launch
from sparse_kernels._triton.linear import small_m_linear_triton
from sparse_kernels.linear import linear_config

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
LAYERS = {"qkv": 36, "o": 36, "gate_up": 16, "down": 16, "lm_head": 2}


def graph_ms_per_call(fn, calls: int) -> float:
    return median_ms(capture(fn).replay, iters=10) / calls


FMA_TILES = [(4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256)]
DOT_TILES = [(16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128)]
# Above 16 rows the x tile is [BLOCK_M = next power of two, BLOCK_K] (128 x K at batch 65-128): shorter K tiles
MID_TILES = [(16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128), (128, 64)]


SPLIT_TILES = [(32, 256, 4, 4), (32, 128, 4, 4), (16, 256, 4, 4), (64, 128, 4, 3)]


def variants(quick: bool, m: int, n: int, k: int, split_k: list[int] | None = None):
    yield "default", linear_config(m, n, k)
    if quick:
        return
    if split_k:  # only the split-K sweep: a few tiles x the given split counts
        for (bn, bk, w, st), sk in itertools.product(SPLIT_TILES, split_k):
            cfg = {"USE_DOT": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "SPLIT_K": sk}
            yield f"dot_split{sk}", cfg
        return
    if m == 1:
        for (bn, bk), w, st in itertools.product(FMA_TILES, [4, 8], [2, 3, 4]):
            yield "fma", {"USE_DOT": False, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
    if m > 16:
        for (bn, bk), w, st in itertools.product(MID_TILES, [4, 8], [3, 4]):
            yield "dot", {"USE_DOT": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
        return
    for (bn, bk), w, st in itertools.product(DOT_TILES, [4, 8], [3, 4]):
        yield "dot", {"USE_DOT": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}


def bench_case(
    name: str, weights: list, x: torch.Tensor, copy_bw: float, quick: bool, split_k: list[int] | None = None
) -> list[dict]:
    """Every variant for one (shape, M): rows of the results table."""
    n, k = SHAPES[name]
    m = x.shape[0]
    nbytes = n * k * 2
    expected = F.linear(x, weights[0])
    outs: list = [None] * len(weights)
    rows = []

    def record(label: str, cfg: dict | None, op) -> None:
        def run() -> None:
            for i, w in enumerate(weights):
                outs[i] = op(w)

        ms = graph_ms_per_call(run, len(weights))
        err = (outs[0].reshape(expected.shape).float() - expected.float()).abs().max().item()
        row = dict(shape=name, n=n, k=k, m=m, variant=label, **(cfg or {}), us=ms * 1e3)
        row.update(tb_s=nbytes / (ms * 1e-3) / 1e12, frac_copy=nbytes / (ms * 1e-3) / copy_bw, max_diff=err)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for reduced in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        record("cublas" if reduced else "cublas_noreduced", None, lambda w: F.linear(x, w))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    if m == 1:
        record("torch.mv", None, lambda w: torch.mv(w, x[0]))
    for label, cfg in variants(quick, m, n, k, split_k):
        try:
            record(label, cfg, lambda w, cfg=cfg: small_m_linear_triton(x, w, None, cfg))
        except Exception as exc:  # a launch shape the compiler refuses: skip it
            print(f"skip {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\nshape    m variant           config                          us   TB/s  of_copy  max_diff")
    for name in SHAPES:
        for m in sorted({r["m"] for r in rows if r["shape"] == name}):
            mine = [r for r in rows if r["shape"] == name and r["m"] == m]
            best = sorted((r for r in mine if "BLOCK_N" in r), key=lambda r: r["us"])[:3]
            for r in [r for r in mine if "BLOCK_N" not in r or r["variant"] == "default"] + best:
                cfg = ""
                if "BLOCK_N" in r:
                    cfg = f"dot={int(r['USE_DOT'])} N={r['BLOCK_N']} K={r['BLOCK_K']}"
                    cfg += f" w={r['num_warps']} s={r['num_stages']}" + (
                        f" sk={r['SPLIT_K']}" if "SPLIT_K" in r else ""
                    )
                print(
                    f"{name:8s} {m:2d} {r['variant']:17s} {cfg:31s} {r['us']:6.1f} {r['tb_s']:6.2f} "
                    f"{r['frac_copy']:8.1%} {r['max_diff']:9.2e}"
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default config only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--split-k", default=None, help="sweep only split-K tiles with these SPLIT_K (e.g. 2,3,4)")
    args = parser.parse_args()
    split_k = [int(v) for v in args.split_k.split(",")] if args.split_k else None
    launch.PDL = not args.no_pdl
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS[name])
        ]
        for m in (int(r) for r in args.rows.split(",")):
            if name != "lm_head" or m == 1 or m > 16:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                rows += bench_case(name, weights, x, copy_bw, args.quick, split_k)
        weights.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tb_s": copy_bw / 1e12, "rows": rows}, f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
