"""GPU probe: fp8 decode launch configs at the engine's block size (16) and KIVI's (32), batch 16/11/5,
with the split count that follows each config's warps (QUANTIZED_WARPS_PER_SM)."""
import json
import os
import sys

sys.path.insert(0, "packages/sparse-kernels/benchmarks")
import quantized_decode_bandwidth as qb  # noqa: E402
import torch  # noqa: E402
from _timing import copy_bandwidth  # noqa: E402

from sparse_kernels._triton import quantized_decode_launch as ql  # noqa: E402

out_path = sys.argv[1]
sink = open(out_path, "a")  # noqa: SIM115


def emit(row):
    print(json.dumps(row), flush=True)
    sink.write(json.dumps(row) + "\n")
    sink.flush()


bw = copy_bandwidth()
emit({"copy_tb_s": bw / 1e12})
base = dict(ql.QUANT_DECODE_CONFIG)
CONFIGS = [dict(), dict(BLOCK_N=32, num_warps=1), dict(BLOCK_N=64, num_warps=1), dict(BLOCK_N=64, num_warps=2),
           dict(BLOCK_N=32, num_warps=2), dict(BLOCK_N=128, num_warps=2), dict(BLOCK_N=32, num_warps=1, num_stages=3)]
for block in (16, 32):
    qb.BLOCK = block
    for batch in (16, 11, 5):
        layers, csr, q, layer_bytes = qb.make_step("fp8", 8, batch)
        ref = None
        for cfg in CONFIGS:
            ql.QUANT_DECODE_CONFIG.clear()
            ql.QUANT_DECODE_CONFIG.update(base, **cfg)
            try:
                ms, out, splits = qb.time_decode(layers, csr, q)
            except Exception as exc:  # noqa: BLE001
                emit(dict(block=block, batch=batch, cfg=cfg, error=repr(exc)[:300]))
                continue
            row = dict(block=block, batch=batch, cfg=cfg, splits=splits, us=ms * 1e3, frac_copy=layer_bytes / (ms * 1e-3) / bw)
            if ref is None:
                ref = out
            else:
                row["max_diff_vs_default"] = (out.float() - ref.float()).abs().max().item()
            emit(row)
        del layers
        torch.cuda.empty_cache()
ql.QUANT_DECODE_CONFIG.clear()
ql.QUANT_DECODE_CONFIG.update(base)
# The best at block 16 (the engine's), by the sum over the three batches, for the engine run after this.
rows = [json.loads(line) for line in open(out_path) if '"block": 16' in line and '"us"' in line]
tot = {}
for r in rows:
    tot.setdefault(json.dumps(r["cfg"], sort_keys=True), []).append(r["us"])
best = json.loads(min((sum(v), k) for k, v in tot.items() if len(v) == 3)[1])
emit({"best_block16": best})
json.dump({"fp8": best}, open(os.path.join(os.path.dirname(out_path), "best.json"), "w"))
