"""Does decode slow down when the KV pool is large? (GPU only.)

Session 16 saw fp8 decode at batch 11 take 41.3 ms a step in the engine (~1.15 ms a layer over a ~100 GB
pool) while the probe timed the same shape at 945 us over a ~3 GB pool. One suspect is address translation:
one-warp programs put ~32 concurrent streams on every SM, each in its own part of the pool, and over 100 GB
their pages no longer fit the TLBs. This replays one layer's decode over ``--layers`` distinct layer pools
(few: a few GB, as the probes do; many: the engine's ~100 GB), with each request's blocks in order or
shuffled over the pool, for fp8 (one-warp default and the earlier four-warp launch) and bf16, and prints us
per layer and the fraction of the copy bandwidth. Rows go to ``--jsonl`` as they are measured.

    python3 packages/sparse-kernels/benchmarks/decode_pool_probe.py [--jsonl OUT] [--many 32]
"""

from __future__ import annotations

import argparse
import json

import quantized_decode_bandwidth as qb
import torch
from _timing import copy_bandwidth

from sparse_kernels._triton import quantized_decode_launch as ql

FOUR_WARPS = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}  # the fp8 launch before session 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl")
    ap.add_argument("--many", type=int, default=32, help="layer pools in the large case")
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    qb.BLOCK = args.block
    sink = open(args.jsonl, "a") if args.jsonl else None  # noqa: SIM115
    bw = copy_bandwidth()

    def emit(row):
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    emit({"copy_tb_s": round(bw / 1e12, 3)})
    base = dict(ql.QUANT_DECODE_CONFIG)
    for scheme, bits, batch, launches in (("fp8", 8, 11, ({}, FOUR_WARPS)), ("bf16", 16, 5, ({},))):
        for layers in (2, args.many):
            for shuffled in (False, True):
                pools, csr, q, layer_bytes = qb.make_step(scheme, bits, batch, num_layers=layers, shuffled=shuffled)
                pool_gb = layers * layer_bytes / 1e9
                for cfg in launches:
                    ql.QUANT_DECODE_CONFIG.clear()
                    ql.QUANT_DECODE_CONFIG.update(base, **cfg)
                    ms, _, splits = qb.time_decode(pools, csr, q)
                    emit(dict(scheme=scheme, batch=batch, layers=layers, pool_gb=round(pool_gb, 1), shuffled=shuffled,
                              cfg=cfg or "default", splits=splits, us_per_layer=round(ms * 1e3, 1),
                              frac_copy=round(layer_bytes / (ms * 1e-3) / bw, 3)))  # fmt: skip
                del pools
                torch.cuda.empty_cache()
    ql.QUANT_DECODE_CONFIG.clear()
    ql.QUANT_DECODE_CONFIG.update(base)


if __name__ == "__main__":
    main()
