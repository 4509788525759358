"""Dense prefill attention on the GPU: tile configurations of the paged Triton kernel against torch SDPA.

One layer of a Qwen3-8B-shaped model (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token pages in
a shuffled pool) prefilled in chunks: the time of every chunk's attention over its cached prefix, summed
(x layers = the model's attention seconds), for each configuration; SDPA's backends on contiguous K/V
(one causal call over the whole prompt) for comparison; each configuration checked against SDPA first.
Also the projection/MLP GEMMs per chunk size. Writes JSON to the path given.

    python benchmarks/prefill_kernel_probe.py OUT.json [--prompt-len 131072] [--chunks 2048,8192]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from sparse_kernels import BatchPrefillWithPagedKVCache
from sparse_kernels._triton import prefill

HQ, HKV, D, BS, LAYERS = 32, 8, 128, 16, 36
HIDDEN, INTER = 4096, 12288

CONFIGS = {
    "m64n64w4s2": {"BLOCK_M": 64, "BLOCK_N": 64, "PACK": False, "num_warps": 4, "num_stages": 2},
    "m128n64w8s2": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": False, "num_warps": 8, "num_stages": 2},
    "m128n64w8s3": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": False, "num_warps": 8, "num_stages": 3},
    "m128n128w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "PACK": False, "num_warps": 8, "num_stages": 2},
    "m128n64w4s3": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": False, "num_warps": 4, "num_stages": 3},
    "p128n64w8s2": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 8, "num_stages": 2},
    "p128n64w8s3": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 8, "num_stages": 3},
    "p128n128w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "PACK": True, "num_warps": 8, "num_stages": 2},
    "p128n64w4s3": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 4, "num_stages": 3},
    "p64n64w4s3": {"BLOCK_M": 64, "BLOCK_N": 64, "PACK": True, "num_warps": 4, "num_stages": 3},
    "p256n64w8s2": {"BLOCK_M": 256, "BLOCK_N": 64, "PACK": True, "num_warps": 8, "num_stages": 2},
    "p128n64w4s4": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 4, "num_stages": 4},
    "p128n64w4s2": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 4, "num_stages": 2},
    "p128n32w4s3": {"BLOCK_M": 128, "BLOCK_N": 32, "PACK": True, "num_warps": 4, "num_stages": 3},
    "p128n128w4s2": {"BLOCK_M": 128, "BLOCK_N": 128, "PACK": True, "num_warps": 4, "num_stages": 2},
    "p128n128w4s3": {"BLOCK_M": 128, "BLOCK_N": 128, "PACK": True, "num_warps": 4, "num_stages": 3},
    "m128n64w4s4": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": False, "num_warps": 4, "num_stages": 4},
}


def cuda_time(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


_sdpa = F.scaled_dot_product_attention


def attention_flops(prompt_len: int) -> float:
    return 2 * 2 * D * HQ * prompt_len * (prompt_len + 1) / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--chunks", default="2048,4096,8192,16384")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.prompt_len
    torch.manual_seed(0)
    num_blocks = n // BS
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q_all = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16)
    # Contiguous K/V in sequence order (the pool's pages are the shuffled ``perm``).
    k_seq = k_cache[perm.to(dev).long()].reshape(n, HKV, D)
    v_seq = v_cache[perm.to(dev).long()].reshape(n, HKV, D)
    result: dict = {"prompt_len": n, "shape": dict(HQ=HQ, HKV=HKV, D=D, block_size=BS, layers=LAYERS), "runs": []}

    def plan_chunk(wrapper, lo: int, hi: int):
        pages = (hi + BS - 1) // BS
        wrapper.plan(
            torch.tensor([0, hi - lo], dtype=torch.int32),
            torch.tensor([0, pages], dtype=torch.int32),
            perm[:pages].clone(),
            torch.tensor([hi - (pages - 1) * BS], dtype=torch.int32),
            num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, causal=True,
        )  # fmt: skip

    # Correctness: a 2048-query chunk ending at 24K and a whole 4K prompt, against SDPA (fp32 math).
    def sdpa_ref(lo: int, hi: int) -> torch.Tensor:
        q = q_all[lo:hi].transpose(0, 1)[None].float()
        k = k_seq[:hi].transpose(0, 1)[None].float()
        v = v_seq[:hi].transpose(0, 1)[None].float()
        pos = torch.arange(lo, hi, device=dev)[:, None]
        mask = torch.arange(hi, device=dev)[None, :] <= pos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)

    checks = [(22528, 24576), (0, 4096)]
    refs = {c: sdpa_ref(*c) for c in checks}
    chunks = [int(c) for c in args.chunks.split(",")]
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        prefill.PREFILL_CONFIG = cfg
        entry = {"config": name, **cfg, "max_err": {}, "seconds_per_layer": {}}
        try:
            w = BatchPrefillWithPagedKVCache(dev, backend="triton")
            for lo, hi in checks:
                plan_chunk(w, lo, hi)
                out = w.run(q_all[lo:hi], k_cache, v_cache)
                entry["max_err"][f"{lo}-{hi}"] = float((out.float() - refs[(lo, hi)]).abs().max())
            for chunk in chunks:
                wrappers = []
                for lo in range(0, n, chunk):
                    wc = BatchPrefillWithPagedKVCache(dev, backend="triton")
                    plan_chunk(wc, lo, min(n, lo + chunk))
                    wrappers.append((wc, lo, min(n, lo + chunk)))
                outs = torch.empty(n, HQ, D, device=dev, dtype=torch.bfloat16)

                def run_all(wrappers=wrappers, outs=outs):
                    for wc, lo, hi in wrappers:
                        wc.run(q_all[lo:hi], k_cache, v_cache, out=outs[lo:hi])

                t = cuda_time(run_all, reps=2)
                entry["seconds_per_layer"][chunk] = t
                entry.setdefault("tflops", {})[chunk] = attention_flops(n) / t / 1e12
                print(name, chunk, f"{t * 1e3:.1f} ms/layer", f"{attention_flops(n) / t / 1e12:.0f} TFLOP/s",
                      f"model attention {t * LAYERS:.2f} s", flush=True)  # fmt: skip
        except Exception as e:  # a configuration the compiler rejects (shared memory) is recorded, not fatal
            entry["error"] = repr(e)[:400]
            print(name, "error", entry["error"], flush=True)
        result["runs"].append(entry)
        print(name, entry["max_err"], flush=True)

    # SDPA backends on contiguous K/V (HF's path): one causal call over the whole prompt.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q_all.transpose(0, 1)[None]
    k4 = k_seq.transpose(0, 1)[None].contiguous()
    v4 = v_seq.transpose(0, 1)[None].contiguous()
    result["sdpa"] = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in ("enable_gqa", "repeat_kv"):
            key = f"{backend.name}/{gqa}"
            try:
                if gqa == "repeat_kv":
                    kk, vv = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k4, v4))
                    kw = {}
                else:
                    kk, vv, kw = k4, v4, {"enable_gqa": True}
                with sdpa_kernel([backend]):
                    t = cuda_time(lambda k=kk, v=vv, kw=kw: _sdpa(q4, k, v, is_causal=True, **kw))
                tflops = attention_flops(n) / t / 1e12
                result["sdpa"][key] = {"seconds_per_layer": t, "tflops": tflops}
                print("sdpa", key, f"{t * 1e3:.1f} ms/layer", f"{tflops:.0f} TFLOP/s", flush=True)
            except Exception as e:
                result["sdpa"][key] = {"error": repr(e)[:300]}
                print("sdpa", key, "error", repr(e)[:200], flush=True)
            kk = vv = None
            torch.cuda.empty_cache()

    # GEMMs of one layer per chunk (qkv, o, gate_up, down), summed over the prompt.
    w_qkv = torch.randn(HIDDEN, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16)
    w_o = torch.randn(HQ * D, HIDDEN, device=dev, dtype=torch.bfloat16)
    w_gu = torch.randn(HIDDEN, 2 * INTER, device=dev, dtype=torch.bfloat16)
    w_d = torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16)
    result["gemm"] = {}
    for chunk in chunks:
        x = torch.randn(chunk, HIDDEN, device=dev, dtype=torch.bfloat16)
        a = torch.randn(chunk, INTER, device=dev, dtype=torch.bfloat16)

        def layer(x=x, a=a):
            x @ w_qkv
            x @ w_o
            x @ w_gu
            a @ w_d

        t = cuda_time(layer, reps=5) * (n // chunk)
        flops = 2 * n * (w_qkv.numel() + w_o.numel() + w_gu.numel() + w_d.numel())
        result["gemm"][chunk] = {"seconds_per_layer": t, "tflops": flops / t / 1e12}
        print("gemm", chunk, f"{t * 1e3:.1f} ms/layer", f"{flops / t / 1e12:.0f} TFLOP/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"probe took {time.time() - t0:.0f} s")
