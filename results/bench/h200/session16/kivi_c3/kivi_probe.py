"""GPU probe: KIVI decode variants (pages per step, warps, stages, split target) and the slice kernel."""
import json, sys, time, os
sys.path.insert(0, "packages/sparse-kernels/benchmarks"); sys.path.insert(0, os.path.dirname(__file__))
import torch, triton
import quantized_decode_bandwidth as qb
from _timing import capture, copy_bandwidth, median_ms
import sparse_kernels._decode_buffers as buffers
from sparse_kernels._triton import quantized_decode_launch as ql

out_path = sys.argv[1]
sink = open(out_path, "a")
def emit(row):
    print(json.dumps(row), flush=True); sink.write(json.dumps(row) + "\n"); sink.flush()

bw = copy_bandwidth()
emit({"copy_tb_s": bw / 1e12, "device": torch.cuda.get_device_name()})
base_cfg = dict(ql.KIVI_DECODE_CONFIG); base_q = dict(ql.QUANT_DECODE_CONFIG); base_sm = buffers.QUANTIZED_PROGRAMS_PER_SM
def restore():
    ql.KIVI_DECODE_CONFIG.clear(); ql.KIVI_DECODE_CONFIG.update(base_cfg)
    ql.QUANT_DECODE_CONFIG.clear(); ql.QUANT_DECODE_CONFIG.update(base_q)
    buffers.QUANTIZED_PROGRAMS_PER_SM = base_sm

KIVI = [dict(), dict(num_warps=2), dict(num_warps=1), dict(num_warps=1, num_stages=3), dict(num_warps=1, num_stages=1),
        dict(num_warps=2, num_stages=3), dict(num_warps=1, per_sm=16), dict(num_warps=1, per_sm=32), dict(num_warps=2, per_sm=16)]
FP8 = [dict(), dict(num_warps=2), dict(BLOCK_N=64, num_warps=2), dict(BLOCK_N=64, num_warps=1), dict(BLOCK_N=32, num_warps=1),
       dict(num_warps=2, num_stages=3), dict(BLOCK_N=64, num_warps=2, per_sm=16), dict(num_warps=2, per_sm=16)]
t0 = time.time()
for batch in (16, 4):
    for scheme, bits, cfgs in (("kivi", 4, KIVI), ("kivi", 2, KIVI), ("fp8", 8, FP8)):
        restore()
        layers, csr, q, layer_bytes = qb.make_step(scheme, bits, batch)
        base = None
        for cfg in cfgs:
            restore()
            for key, val in cfg.items():
                if key == "per_sm":
                    buffers.QUANTIZED_PROGRAMS_PER_SM = val
                elif scheme == "kivi":
                    ql.KIVI_DECODE_CONFIG[key] = val
                else:
                    ql.QUANT_DECODE_CONFIG[key] = val
            try:
                ms, out, splits = qb.time_decode(layers, csr, q)
            except Exception as exc:
                emit(dict(scheme=scheme, bits=bits, batch=batch, cfg=cfg, error=repr(exc)[:300])); continue
            row = dict(scheme=scheme, bits=bits, batch=batch, cfg=cfg, splits=splits, us=ms * 1e3,
                       frac_copy=layer_bytes / (ms * 1e-3) / bw, mb=layer_bytes / 1e6)
            if base is None:
                base = out
            else:
                row["max_diff_vs_default"] = (out.float() - base.float()).abs().max().item()
            emit(row)
        del layers; torch.cuda.empty_cache()
emit({"done_s": time.time() - t0})
# The best config per family (sum of its batch-16 and batch-4 times) for the engine run after this.
rows = [json.loads(l) for l in open(out_path)]
best = {}
for fam, schemes in (("kivi", ("kivi",)), ("fp8", ("fp8",))):
    tot = {}
    for r in rows:
        if r.get("scheme") in schemes and "us" in r and r["bits"] in (4, 8):
            tot.setdefault(json.dumps(r["cfg"], sort_keys=True), []).append(r["us"])
    best[fam] = json.loads(min((sum(v), k) for k, v in tot.items() if len(v) == 2)[1])
emit({"best": best})
json.dump(best, open(os.path.join(os.path.dirname(out_path), "best.json"), "w"))
# The slice kernel over half-word-interleaved codes (random codes: timing only), batch 16 and 4.
import kivi_v2
for batch in (16, 4):
    for bits in (4, 2):
        restore()
        layers, csr, q, layer_bytes = qb.make_step("kivi", bits, batch)
        indptr, indices, last = (t.cuda() for t in csr)
        splits = 8 * 132 // (batch * 8) if batch * 8 < 8 * 132 else 1
        splits = max(1, splits)
        o_part = torch.empty(batch * 32 * splits, 128, device="cuda"); lse = torch.empty(batch * 32 * splits, device="cuda")
        cph = 16 // bits
        for nw, ns in ((4, 2), (2, 2), (1, 2)):
            def step():
                for kv in layers:
                    kivi_v2.kivi_v2_kernel[(batch, 8, splits)](
                        q, kv.k.view(torch.int16), kv.v.view(torch.int16), kv.k_scale, kv.k_min, kv.v_scale, kv.v_min,
                        indptr, indices, last, o_part, lse, q.stride(0), q.stride(1), 0.088, splits,
                        BITS=bits, NH=128 // cph, CPH=cph, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, PAGE=32, VGROUP=32,
                        BLOCK_G=16, KFMA=False, num_warps=nw, num_stages=ns)
            try:
                g = capture(step); ms = median_ms(g.replay) / len(layers)
                emit(dict(kernel="slices", bits=bits, batch=batch, nw=nw, ns=ns, splits=splits, us=ms * 1e3,
                          frac_copy=layer_bytes / (ms * 1e-3) / bw))
            except Exception as exc:
                emit(dict(kernel="slices", bits=bits, batch=batch, nw=nw, ns=ns, error=repr(exc)[:300]))
        del layers; torch.cuda.empty_cache()
