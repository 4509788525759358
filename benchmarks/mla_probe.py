"""MLA latent attention on the GPU at the GLM-4.7-Flash shape: Triton against the reference, and timing.

GLM-4.7-Flash (Glm4MoeLite): 20 query heads, kv_lora_rank 512, qk_rope_head_dim 64, so each cached
row is 576 bf16 channels (1152 bytes per token and layer) and the softmax scale is (192 + 64) ** -0.5.
For each case this checks ``latent_attention`` (Triton) against ``latent_attention_reference`` (max
abs error, bf16) and times the Triton call (CUDA-event median); decode reports the latent bytes read
per second against the device's copy bandwidth, prefill TFLOP/s of the absorbed form
(2 * H * (576 + 512) flops per (query, key) pair).

Decode is timed inside a CUDA graph (as the engine replays it), three ways side by side: ``before``
(the first kernel's tiles, merged by the plain torch ``merge_splits``: ~6 launches), ``after`` (the
current ``LATENT_TILES`` and the one-launch Triton merge), and with ``--sweep`` every tile shape of
``SWEEP`` and a doubled split count, to pick ``LATENT_TILES["decode"]`` from (the best is printed).

Usage (one H200, under two minutes with the sweep)::

    uv run python benchmarks/mla_probe.py --sweep --out results/mla_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/sparse-kernels/benchmarks"))
from _timing import capture, copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels._triton.latent_attention import run_latent_attention  # noqa: E402
from sparse_kernels.latent_attention import (  # noqa: E402
    LATENT_TILES,
    latent_attention,
    latent_attention_reference,
    merge_splits,
    plan_latent,
)

HEADS, LATENT, ROPE, BLOCK = 20, 512, 64, 16
SCALE = (192 + 64) ** -0.5
FIRST_TILES = {"block_n": 32, "num_warps": 8, "num_stages": 3}  # the kernel as measured before this probe's sweep
SWEEP = [dict(block_n=n, num_warps=w, num_stages=st) for n in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3)]


def _case(batch: int, kv_len: int, q_len: int, seed: int = 0):
    """A shuffled pool with ``batch`` requests of ``kv_len`` keys each, the last ``q_len`` of them new;
    ``(q, cache, plan_for)`` where ``plan_for(tiles=None, num_splits=None)`` plans the step."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-kv_len // BLOCK)
    num_blocks = batch * pages
    cache = torch.randn(num_blocks, BLOCK, 1, LATENT + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)
    indices = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32).cpu()
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), kv_len - (pages - 1) * BLOCK, dtype=torch.int32)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, HEADS, LATENT + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)

    def plan_for(tiles=None, num_splits=None):
        return plan_latent(
            qo_indptr, kv_indptr, indices, last, num_heads=HEADS, latent_dim=LATENT, rope_dim=ROPE,
            block_size=BLOCK, sm_scale=SCALE, device="cuda", tiles=tiles, num_splits=num_splits,
        )  # fmt: skip

    return q, cache, plan_for


def _before(q, cache, plan):
    """The first decode path: the split kernel, then the plain torch merge and a copy into the output."""
    rows = q.shape[0] * q.shape[1]
    out = q.new_empty(q.shape[0], HEADS, LATENT)
    o_part = torch.empty(rows, plan.num_splits, LATENT, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(rows, plan.num_splits, dtype=torch.float32, device=q.device)

    def run():
        run_latent_attention(q, cache, plan, out, o_part, lse_part, merge=False)
        if plan.num_splits > 1:
            out.copy_(merge_splits(o_part, lse_part).view_as(out))

    return run


def _graph_ms(fn) -> float:
    graph = capture(fn)
    return median_ms(graph.replay)


def _pct(batch: int, kv_len: int, ms: float, bandwidth: float) -> float:
    return 100 * batch * kv_len * (LATENT + ROPE) * 2 / (ms * 1e-3) / bandwidth


def _check(q, cache, plan) -> float:
    got = latent_attention(q, cache, plan, backend="triton").float()
    want = latent_attention_reference(q, cache, plan).float()
    return float((got - want).abs().max())


def _sweep(q, cache, plan_for, splits: int, batch: int, kv_len: int, bandwidth: float) -> list[dict]:
    out = q.new_empty(q.shape[0], HEADS, LATENT)
    results = []
    for tiles in SWEEP:
        for num_splits in (splits, 2 * splits):
            plan = plan_for(tiles, num_splits)
            try:
                ms = _graph_ms(lambda plan=plan: latent_attention(q, cache, plan, out=out))
            except Exception as e:  # a shape that does not fit (shared memory, registers) is a result too
                results.append(dict(tiles=tiles, splits=num_splits, error=str(e).splitlines()[0][:120]))
                continue
            results.append(dict(tiles=tiles, splits=num_splits, ms=ms, pct_copy_bw=_pct(batch, kv_len, ms, bandwidth)))
    return results


def _best(rows: list[dict]) -> dict:
    """The (tiles, split factor) with the lowest geometric-mean time over the decode cases."""
    scores: dict[str, list[float]] = {}
    for row in rows:
        for r in row["sweep"]:
            key = json.dumps({**r["tiles"], "split_factor": r["splits"] // row["splits"]})
            scores.setdefault(key, []).append(math.log(r["ms"]) if "ms" in r else math.inf)
    key = min(scores, key=lambda k: sum(scores[k]))
    return {**json.loads(key), "geomean_ms": math.exp(sum(scores[key]) / len(scores[key]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows (printed anyway)")
    parser.add_argument("--sweep", action="store_true", help="time every decode tile shape of SWEEP, x1 and x2 splits")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for batch, kv_len in [(1, 8192), (1, 131072), (8, 32768), (32, 8192), (64, 4096)]:
        q, cache, plan_for = _case(batch, kv_len, 1)
        plan = plan_for()
        err = _check(q, cache, plan) if batch * kv_len <= 2**18 else None
        out = q.new_empty(q.shape[0], HEADS, LATENT)
        after = lambda q=q, cache=cache, plan=plan, out=out: latent_attention(q, cache, plan, out=out)  # noqa: E731
        before_ms, after_ms = _graph_ms(_before(q, cache, plan_for(FIRST_TILES))), _graph_ms(after)
        row = dict(kind="decode", batch=batch, kv_len=kv_len, splits=plan.num_splits, tiles=LATENT_TILES["decode"],
                   max_abs_err=err, before_ms=before_ms, after_ms=after_ms, eager_ms=median_ms(after),
                   before_pct_copy_bw=_pct(batch, kv_len, before_ms, bandwidth),
                   after_pct_copy_bw=_pct(batch, kv_len, after_ms, bandwidth))  # fmt: skip
        if args.sweep:
            row["sweep"] = _sweep(q, cache, plan_for, plan.num_splits, batch, kv_len, bandwidth)
        print(json.dumps(row))
        rows.append(row)
    if args.sweep:
        print("best decode tiles (geometric mean of ms over the cases):", json.dumps(_best(rows)))
    for batch, kv_len, q_len in [(1, 4096, 4096), (1, 16384, 2048), (4, 8192, 512)]:
        q, cache, plan_for = _case(batch, kv_len, q_len)
        plan = plan_for()
        err = _check(q, cache, plan) if q_len * kv_len <= 2**23 else None
        run = lambda q=q, cache=cache, plan=plan: latent_attention(q, cache, plan, backend="triton")  # noqa: E731
        ms = median_ms(run, iters=5)
        pairs = batch * (q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2)  # causal
        flops = 2 * HEADS * (LATENT + ROPE + LATENT) * pairs
        rows.append(dict(kind="prefill", batch=batch, kv_len=kv_len, q_len=q_len, ms=ms, max_abs_err=err,
                         tflop_s=flops / ms / 1e9))  # fmt: skip
        print(json.dumps(rows[-1]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"device": torch.cuda.get_device_name(), "copy_bw": bandwidth, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
