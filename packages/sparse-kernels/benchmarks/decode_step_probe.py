"""One whole decode step of a Qwen3-8B-shaped model from the package's kernels, under CUDA-graph replay (GPU only).

Per layer, as the engine runs it: fused add + RMSNorm, qkv (small-M linear), q/k norm + RoPE, KV store,
split-K paged decode + reduce, o, fused add + RMSNorm, gate/up, SiLU*mul, down; then the final norm and the
LM head. Distinct weights per layer (15.1 GB, far past the L2), ``--batch`` requests of ``--kv-len`` tokens
each in shuffled 16-token pages. Variants: the decode split targets of ``--per-sm``
(``_decode_buffers.PROGRAMS_PER_SM``), PDL off once for scale, and with ``--fused`` the layers on
``linear_epilogue``'s projections (residual add, RMSNorm and SiLU*mul in their epilogues, as the engine's
decode batches run them since session 23); logits are compared with the first
variant's (max |diff|: another split count sums the attention in another order). Reported: ms per step and
the fraction of the copy bandwidth for the bytes a step must read (weights once, every KV slot once). A
change to the step's kernels is timed here in one process before an engine run; what was tried this way is
in ``NOTES.md`` (session 14).

Usage: ``python packages/sparse-kernels/benchmarks/decode_step_probe.py [--batch 5] [--kv-len 8192,131072]
[--per-sm 8,4] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import capture, copy_bandwidth, median_ms  # benchmarks/ (run as scripts)

import sparse_kernels._decode_buffers as buffers
from sparse_kernels import (
    BatchDecodeWithPagedKVCache,
    fused_add_rms_norm,
    linear,
    rms_norm,
    rope_qk,
    silu_and_mul,
    store_kv,
)
from sparse_kernels._triton import launch
from sparse_kernels.linear_epilogue import add_norm_inputs, linear_add_norm, linear_normed

LAYERS, HIDDEN, HQ, HKV, DIM, INTER, VOCAB, PAGE = 36, 4096, 32, 8, 128, 12288, 151936, 16


def make_model(gen: torch.Generator) -> dict:
    def w(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02).contiguous()

    layers = [
        {
            "in_norm": 1 + w(HIDDEN),
            "qkv": w((HQ + 2 * HKV) * DIM, HIDDEN),
            "q_norm": 1 + w(DIM),
            "k_norm": 1 + w(DIM),
            "o": w(HIDDEN, HQ * DIM),
            "post_norm": 1 + w(HIDDEN),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
        }
        for _ in range(LAYERS)
    ]
    return {"layers": layers, "norm": 1 + w(HIDDEN), "lm_head": w(VOCAB, HIDDEN)}


def make_kv(batch: int, kv_len: int, gen: torch.Generator):
    pages = batch * (kv_len // PAGE + 1)  # room for the step's new token in a fresh page
    caches = [
        (
            torch.randn(pages + 1, PAGE, HKV, DIM, device="cuda", generator=gen, dtype=torch.bfloat16),
            torch.randn(pages + 1, PAGE, HKV, DIM, device="cuda", generator=gen, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    per = kv_len // PAGE + 1
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    indptr = torch.arange(0, batch * per + 1, per, dtype=torch.int32)
    last_len = torch.ones(batch, dtype=torch.int32)  # kv_len full pages, then the new token
    slots = (order.view(batch, per)[:, -1].to(torch.int64) * PAGE).to(torch.int32).cuda()
    return caches, (indptr, order, last_len), slots


def build_step(model: dict, caches, csr, slots: torch.Tensor, batch: int, kv_len: int, fused: bool = False):
    wrapper = BatchDecodeWithPagedKVCache("cuda", backend="triton", max_batch_size=batch)
    wrapper.plan(*csr, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=DIM, block_size=PAGE)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(batch, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    positions = torch.full((batch,), kv_len, dtype=torch.int64, device="cuda")
    angles = (
        torch.arange(kv_len + 1, dtype=torch.float32)[:, None]
        * (1e6 ** (-torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))[None, :]
    )
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).cuda()
    attn_out = torch.empty(batch, HQ, DIM, device="cuda", dtype=torch.bfloat16)
    logits = torch.empty(batch, VOCAB, device="cuda", dtype=torch.bfloat16)

    def attend(layer, qkv, kc, vc):
        q, k, v = qkv.split([HQ * DIM, HKV * DIM, HKV * DIM], dim=-1)
        q, k = rope_qk(
            q.view(batch, HQ, DIM),
            k.view(batch, HKV, DIM),
            positions,
            cos_sin,
            q_weight=layer["q_norm"],
            k_weight=layer["k_norm"],
            eps=1e-6,
        )
        store_kv(k, v.view(batch, HKV, DIM), kc, vc, slots)
        wrapper.run(q, kc, vc, out=attn_out)
        return attn_out.view(batch, HQ * DIM)

    def step():
        x, res = x0, None
        for layer, (kc, vc) in zip(model["layers"], caches, strict=True):
            if res is None:
                h, res = rms_norm(x, layer["in_norm"], 1e-6), x
            else:
                h, res = fused_add_rms_norm(x, res, layer["in_norm"], 1e-6)
            o = linear(attend(layer, linear(h, layer["qkv"]), kc, vc), layer["o"])
            h, res = fused_add_rms_norm(o, res, layer["post_norm"], 1e-6)
            x = linear(silu_and_mul(linear(h, layer["gate_up"])), layer["down"])
        h, _ = fused_add_rms_norm(x, res, model["norm"], 1e-6)
        logits.copy_(linear(h, model["lm_head"]))

    def fused_step():
        layers = model["layers"]
        h = add_norm_inputs(x0.clone(), layers[0]["in_norm"], 1e-6)
        for i, (layer, (kc, vc)) in enumerate(zip(layers, caches, strict=True)):
            nxt = layers[i + 1]["in_norm"] if i + 1 < LAYERS else model["norm"]
            o = attend(layer, linear_normed(h, layer["qkv"]), kc, vc)
            h = linear_add_norm(o, layer["o"], None, h.hidden, layer["post_norm"], 1e-6)
            act = linear_normed(h, layer["gate_up"], gated=True)
            h = linear_add_norm(act, layer["down"], None, h.hidden, nxt, 1e-6)
        logits.copy_(linear(rms_norm(h.hidden, model["norm"], 1e-6), model["lm_head"]))

    return (fused_step if fused else step), logits


def step_bytes(batch: int, kv_len: int) -> int:
    per_layer = ((HQ + 2 * HKV) * DIM * HIDDEN + HIDDEN * HQ * DIM + 3 * INTER * HIDDEN) * 2
    kv = batch * (kv_len + 1) * HKV * DIM * 2 * 2
    return LAYERS * (per_layer + kv) + VOCAB * HIDDEN * 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--kv-len", default="8192,131072", help="comma-separated KV lengths per request")
    parser.add_argument("--per-sm", default="8,4", help="decode split targets (programs per SM) to sweep")
    parser.add_argument("--fused", action="store_true", help="also time each split target with fused epilogues")
    parser.add_argument("--no-pdl-off", action="store_true", help="skip the PDL-off variant")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = make_model(gen)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + written)")
    per_sm = [int(v) for v in args.per_sm.split(",")]
    variants = [] if args.no_pdl_off else [(f"pdl off, {per_sm[0]}/SM", False, per_sm[0], False)]
    variants += [(f"{t}/SM", True, t, False) for t in per_sm]
    variants += [(f"{t}/SM fused", True, t, True) for t in per_sm] if args.fused else []
    rows = []
    for kv_len in (int(v) for v in args.kv_len.split(",")):
        caches, csr, slots = make_kv(args.batch, kv_len, gen)
        nbytes = step_bytes(args.batch, kv_len)
        reference = None
        for name, pdl, target, fused in variants:
            launch.PDL, buffers.PROGRAMS_PER_SM = pdl, target
            step, logits = build_step(model, caches, csr, slots, args.batch, kv_len, fused)
            graph = capture(step)
            ms = median_ms(graph.replay, iters=10, reps=7)
            out = logits.float().clone()
            reference = out if reference is None else reference
            diff = (out - reference).abs().max().item()
            frac = nbytes / (ms * 1e-3) / copy_bw
            row = {"batch": args.batch, "kv_len": kv_len, "variant": name, "ms": ms, "of_copy": frac, "max_diff": diff}
            rows.append(row)
            print(f"b{args.batch} kv {kv_len:>6} {name:<20} {ms:8.3f} ms  {100 * frac:5.1f}% of copy  diff {diff:.1e}")
            del graph
        del caches
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": copy_bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
