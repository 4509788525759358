"""Session 15 probe: Quest page bounds over summaries stored as bf16 min/max (today), int8 codes with a
scale per (page, KV head), or fp8 e4m3 codes with a scale; dots in bf16 or fp16, or FMA (no tensor cores).
Qwen3-8B heads, 128K context, 16-token pages, batch 5 and 8; CUDA-graph replays over enough layers to
defeat L2. Prints us per call and % of copy bandwidth (bytes of the summaries read + bounds written)."""
import math, sys
import torch, triton, triton.language as tl
sys.path.insert(0, "packages/sparse-kernels/benchmarks")
from _timing import capture, copy_bandwidth, median_ms

HQ, HKV, D, BS = 32, 8, 128, 16
KV_LEN = 131073
MAX_PAGES = 8448

@triton.jit
def kern(q_ptr, kmin_ptr, kmax_ptr, scale_ptr, table_ptr, start_ptr, num_pages_ptr, out_ptr, max_pages, chunk,
         NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
         BLOCK_P: tl.constexpr, DOT_DTYPE: tl.constexpr, CODES: tl.constexpr, FMA: tl.constexpr, MAGIC: tl.constexpr = False, FP8: tl.constexpr = False):
    b = tl.program_id(0); h = tl.program_id(1)
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, max_pages)
    start = tl.load(start_ptr + b).to(tl.int64)
    num_pages = tl.load(num_pages_ptr + b)
    offs_g = tl.arange(0, BLOCK_G); offs_d = tl.arange(0, HEAD_DIM)
    heads = h * GROUP + offs_g
    out_row = out_ptr + (b.to(tl.int64) * NUM_KV_HEADS + h) * max_pages
    if FMA:
        q = tl.load(q_ptr + b.to(tl.int64) * GROUP * NUM_KV_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_g[:, None] < GROUP, other=0.0).to(tl.float32)  # [G, D]
        q_pos = tl.maximum(q, 0.0); q_neg = tl.minimum(q, 0.0)
        for p0 in range(lo, hi, BLOCK_P):
            pages = p0 + tl.arange(0, BLOCK_P)
            valid = pages < num_pages
            ids = tl.load(table_ptr + start + pages, mask=valid, other=0).to(tl.int64)
            rows = (ids * NUM_KV_HEADS + h) * HEAD_DIM
            top = tl.load(kmax_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0).to(tl.float32)
            low = tl.load(kmin_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0).to(tl.float32)
            s = tl.sum(top[:, None, :] * q_pos[None, :, :] + low[:, None, :] * q_neg[None, :, :], axis=2)  # [P, G]
            if CODES:
                s = s * tl.load(scale_ptr + ids * NUM_KV_HEADS + h, mask=valid, other=0.0)[:, None]
            best = tl.max(tl.where(offs_g[None, :] < GROUP, s, float("-inf")), axis=1)
            best = tl.where(valid, best, float("-inf"))
            tl.store(out_row + pages, best, mask=pages < hi)
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * GROUP * NUM_KV_HEADS * HEAD_DIM + heads[None, :] * HEAD_DIM + offs_d[:, None],
                    mask=offs_g[None, :] < GROUP, other=0.0).to(tl.float32)  # [D, G]
        q_pos = tl.maximum(q, 0.0).to(DOT_DTYPE); q_neg = tl.minimum(q, 0.0).to(DOT_DTYPE)
        for p0 in range(lo, hi, BLOCK_P):
            pages = p0 + tl.arange(0, BLOCK_P)
            valid = pages < num_pages
            ids = tl.load(table_ptr + start + pages, mask=valid, other=0).to(tl.int64)
            rows = (ids * NUM_KV_HEADS + h) * HEAD_DIM
            if MAGIC:
                tu = tl.load(kmax_ptr.to(tl.pointer_type(tl.uint8)) + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=128)
                lu = tl.load(kmin_ptr.to(tl.pointer_type(tl.uint8)) + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=128)
                tf = ((tu ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
                lf = ((lu ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
                s = tl.dot(tf.to(DOT_DTYPE), q_pos)
                s = tl.dot(lf.to(DOT_DTYPE), q_neg, acc=s)
            elif FP8:
                top = tl.load(kmax_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None])
                low = tl.load(kmin_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None])
                s = tl.dot(top.to(DOT_DTYPE), q_pos)
                s = tl.dot(low.to(DOT_DTYPE), q_neg, acc=s)
            else:
                top = tl.load(kmax_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
                low = tl.load(kmin_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
                s = tl.dot(top.to(DOT_DTYPE), q_pos)
                s = tl.dot(low.to(DOT_DTYPE), q_neg, acc=s)
            if CODES:
                s = s * tl.load(scale_ptr + ids * NUM_KV_HEADS + h, mask=valid, other=0.0)[:, None]
            best = tl.max(tl.where(offs_g[None, :] < GROUP, s, float("-inf")), axis=1)
            best = tl.where(valid, best, float("-inf"))
            tl.store(out_row + pages, best, mask=pages < hi)

def main():
    bw = copy_bandwidth()
    print(f"copy {bw/1e9:.0f} GB/s")
    pages = -(-KV_LEN // BS)
    for batch in (5, 8):
        num_blocks = batch * pages + 7
        gen = torch.Generator().manual_seed(batch)
        table = torch.randperm(num_blocks, generator=gen)[: batch * pages].to(torch.int32).cuda()
        start = (torch.arange(batch) * pages).to(torch.int32).cuda()
        npages = torch.full((batch,), pages, dtype=torch.int32, device="cuda")
        out = torch.empty(batch, HKV, MAX_PAGES, device="cuda")
        nlayers = max(2, math.ceil((256 << 20) / (num_blocks * HKV * D * 2)))
        qs = [torch.randn(batch, HQ, D, device="cuda").bfloat16() for _ in range(nlayers)]
        q16 = [q.half() for q in qs]
        layers = []
        for _ in range(nlayers):
            a, b2 = torch.randn(2, num_blocks, HKV, D, device="cuda").bfloat16()
            lo_, hi_ = torch.minimum(a, b2), torch.maximum(a, b2)
            amax = torch.maximum(lo_.abs(), hi_.abs()).float().amax(-1)
            sc = amax / 127
            i8 = (torch.floor(lo_.float() / sc[..., None]).to(torch.int8), torch.ceil(hi_.float() / sc[..., None]).to(torch.int8), sc)
            sc8 = amax / 448
            f8 = ((lo_.float() / sc8[..., None]).to(torch.float8_e4m3fn), (hi_.float() / sc8[..., None]).to(torch.float8_e4m3fn), sc8)
            layers.append({"bf16": (lo_, hi_, sc), "int8": i8, "fp8": f8})
        ref = None
        variants = [("bf16", "bf16", 0), ("int8", "bf16", 0), ("int8", "fp16", "magic"), ("fp8", "fp16", "fp8"), ("fp8", "bf16", "fp8")]
        for kind, dot, mode in variants:
            fma = False
            for bp, warps, stages in [(64, 2, 3), (64, 1, 3), (128, 2, 3), (64, 4, 3), (32, 2, 3), (128, 1, 2)]:
                chunk = max(bp, -(-pages // max(1, (132 * 8) // (batch * HKV))))
                chunk = -(-chunk // bp) * bp
                grid = (batch, HKV, triton.cdiv(MAX_PAGES, chunk))
                dd = {"bf16": tl.bfloat16, "fp16": tl.float16, None: tl.float32}[dot]
                qd = torch.float16 if dot == "fp16" else torch.bfloat16
                def run(i, kind=kind, dd=dd, fma=fma, bp=bp, warps=warps, stages=stages, chunk=chunk, grid=grid, qd=qd, mode=mode):
                    lo_, hi_, sc = layers[i][kind]
                    kern[grid](q16[i] if qd == torch.float16 else qs[i], lo_, hi_, sc, table, start, npages, out, MAX_PAGES, chunk,
                               NUM_KV_HEADS=HKV, GROUP=HQ // HKV, HEAD_DIM=D, BLOCK_G=16 if not fma else 4, BLOCK_P=bp,
                               DOT_DTYPE=dd, CODES=kind != "bf16", FMA=fma, MAGIC=mode == "magic", FP8=mode == "fp8", num_warps=warps, num_stages=stages)
                try:
                    run(0)
                    torch.cuda.synchronize()
                    got = out.clone()
                    if ref is None and kind == "bf16":
                        ref = got
                    err = (got[..., :pages] - ref[..., :pages]).abs().max().item() / ref[..., :pages].abs().max().item()
                    def all_layers(run=run):
                        for i in range(nlayers):
                            run(i)
                    g = capture(all_layers)
                    us = median_ms(g.replay, iters=5) * 1e3 / nlayers
                    elem = 1 if kind != "bf16" else 2
                    nbytes = batch * HKV * pages * (2 * D * elem + (4 if kind != "bf16" else 0)) + out.numel() * 4
                    print(f"b{batch} {kind:5} dot={str(dot):5} {str(mode):5} P{bp:<3} w{warps} s{stages}: {us:7.1f} us  {nbytes/(us*1e-6)/bw*100:5.1f}% copy  relerr {err:.3g}", flush=True)
                except Exception as e:
                    print(f"b{batch} {kind} {dot} fma={fma} P{bp} w{warps} s{stages}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        del layers, qs
        torch.cuda.empty_cache()

main()
