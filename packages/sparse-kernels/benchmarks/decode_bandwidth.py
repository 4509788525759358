"""Triton split-K decode bandwidth against a device-to-device copy, measured side by side (GPU only).

Shape: one Qwen3-8B-like attention layer (32 query heads, 8 KV heads, head_dim 128, bf16 KV, block
size 16), batch 1 and 32 at KV length 32768, random K/V in shuffled blocks. Each timing replays a CUDA
graph of the decode (as the engine runs it); batch 1 cycles over 8 layer pools (1 GiB) so the 60 MB L2
cannot serve repeats. Achieved bandwidth = KV bytes read per layer / time per layer; copy bandwidth =
(bytes read + bytes written) / time of a 2 GiB ``copy_``. Sweeps tile size, warps, pipeline stages and
split target, checks every variant's output against the default one, and prints a table last.

Usage: ``python packages/sparse-kernels/benchmarks/decode_bandwidth.py [--quick] [--json PATH]``;
``--kv-len 8192 --cases 5x16,76x1 --per-sm 1,2,4,8,16`` sweeps only the split target at other shapes
(an evicting method's 8K contexts; ``BxL``: batch B cycling over L layer pools); ``--configs
32:1:3:16,64:2:3:8`` times only the listed ``BLOCK_N:warps:stages:programs_per_sm`` besides the default;
``--logits`` sweeps the variant that also writes every token's logits (``LOGITS_DECODE_CONFIG``).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from _timing import capture, copy_bandwidth, median_ms  # benchmarks/ (run as scripts)

import sparse_kernels._decode_buffers as buffers
from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_kernels._triton import decode_launch, launch

HQ, HKV, DIM, BLOCK, KV_LEN = 32, 8, 128, 16, 32768


def make_step(batch: int, num_layers: int, seed: int = 0, kv_len: int = KV_LEN):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_req = kv_len // BLOCK
    num_blocks = batch * blocks_per_req + 7
    pools = [
        (
            torch.randn(num_blocks, BLOCK, HKV, DIM, device="cuda", generator=gen, dtype=torch.bfloat16),
            torch.randn(num_blocks, BLOCK, HKV, DIM, device="cuda", generator=gen, dtype=torch.bfloat16),
        )
        for _ in range(num_layers)
    ]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: batch * blocks_per_req]
    csr = (
        torch.arange(0, batch * blocks_per_req + 1, blocks_per_req, dtype=torch.int32),
        perm.to(torch.int32),
        torch.full((batch,), BLOCK, dtype=torch.int32),
    )
    q = torch.randn(batch, HQ, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    return pools, csr, q


def time_decode(batch, pools, csr, q, with_scores=False, with_logits=False):
    """ms per layer for the current module-level config, and the first layer's output. ``with_logits``: the
    decode also writes every token's logits and the log-sum-exps (an observing layer's one pass)."""
    wrapper = BatchDecodeWithPagedKVCache("cuda", backend="triton", max_batch_size=batch)
    wrapper.plan(*csr, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=DIM, block_size=BLOCK)
    outs = [torch.empty_like(q) for _ in pools]
    scores = torch.empty(HKV, int(csr[0][-1]) * BLOCK, device="cuda") if with_scores else None
    width = (int(csr[0][1]) - int(csr[0][0])) * BLOCK
    extra = {}
    if with_logits:
        extra = {
            "logits_out": torch.empty(batch, HQ, width, device="cuda"),
            "lse_out": torch.empty(batch, HQ, device="cuda"),
        }

    def step():
        for (k, v), out in zip(pools, outs, strict=True):
            wrapper.run(q, k, v, out=out, scores_out=scores, **extra)

    graph = capture(step)
    ms = median_ms(graph.replay) / len(pools)
    return ms, outs[0].clone(), wrapper._num_splits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default config only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--kv-len", type=int, default=KV_LEN)
    parser.add_argument("--cases", default="1x8,32x1", help="BxL: batch B over L layer pools")
    parser.add_argument("--per-sm", default=None, help="sweep only these split targets (programs per SM)")
    parser.add_argument("--configs", default=None, help="only BLOCK_N:warps:stages:per_sm,...")
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--logits", action="store_true", help="sweep the decode that also writes logits_out")
    parser.add_argument("--warps", default="4,8", help="warps swept without --configs")
    args = parser.parse_args()
    config = decode_launch.LOGITS_DECODE_CONFIG if args.logits else decode_launch.DECODE_CONFIG
    launch.PDL = not args.no_pdl
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    default = (dict(config), buffers.PROGRAMS_PER_SM)
    grid = [default]
    if args.configs:
        for spec in args.configs.split(","):
            block_n, warps, stages, per_sm = (int(x) for x in spec.split(":"))
            grid.append(({"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}, per_sm))
    elif args.per_sm:
        grid += [(default[0], int(x)) for x in args.per_sm.split(",") if int(x) != default[1]]
    elif not args.quick:
        warps_swept = [int(w) for w in args.warps.split(",")]
        for block_n, warps, stages, per_sm in itertools.product([32, 64, 128], warps_swept, [2, 3], [2, 4, 8]):
            cfg = ({"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}, per_sm)
            if cfg != default:
                grid.append(cfg)
    rows = []
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    for batch, layers in cases:
        pools, csr, q = make_step(batch, layers, kv_len=args.kv_len)
        kv_bytes = batch * args.kv_len * HKV * DIM * 2 * 2  # K and V, bf16
        baseline = None
        for cfg, per_sm in grid:
            config.update(cfg)
            buffers.PROGRAMS_PER_SM = per_sm
            ms, out, splits = time_decode(batch, pools, csr, q, with_logits=args.logits)
            baseline = out if baseline is None else baseline
            err = (out.float() - baseline.float()).abs().max().item()
            row = dict(batch=batch, **cfg, programs_per_sm=per_sm, num_splits=splits, us=ms * 1e3)
            row.update(tb_s=kv_bytes / (ms * 1e-3) / 1e12, frac_copy=kv_bytes / (ms * 1e-3) / copy_bw, max_diff=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
        config.update(default[0])
        buffers.PROGRAMS_PER_SM = default[1]
        ms_scores, _, _ = time_decode(batch, pools, csr, q, with_scores=True)
        print(f"batch {batch}: default config with scores_out: {ms_scores * 1e3:.1f} us/layer")
        ms_plain, _, _ = time_decode(batch, pools, csr, q)
        ms_logits, _, _ = time_decode(batch, pools, csr, q, with_logits=True)
        us = f"plain {ms_plain * 1e3:.1f}, with logits_out {ms_logits * 1e3:.1f} us/layer"
        print(f"batch {batch}: default configs: {us}")
        if batch == 1:  # the default config against the reference backend on layer 0
            reference = BatchDecodeWithPagedKVCache("cuda", backend="reference")
            reference.plan(*csr, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=DIM, block_size=BLOCK)
            expected = reference.run(q, *pools[0])
            print(f"batch 1: default vs reference max |diff| {(baseline.float() - expected.float()).abs().max():.2e}")
        del pools
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tb_s": copy_bw / 1e12, "rows": rows}, f, indent=1)
    print("\nbatch BLOCK_N warps stages per_sm splits     us   TB/s  of_copy  max_diff")
    for batch, _ in cases:
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["us"])
        for r in [r for r in rows if r["batch"] == batch][:1] + mine[:6]:
            print(
                f"{r['batch']:5d} {r['BLOCK_N']:7d} {r['num_warps']:5d} {r['num_stages']:6d} {r['programs_per_sm']:6d} "
                f"{r['num_splits']:6d} {r['us']:6.1f} {r['tb_s']:6.2f} {r['frac_copy']:8.1%} {r['max_diff']:9.2e}"
            )


if __name__ == "__main__":
    main()
