"""``rope_qk`` and ``rope_store`` at Qwen3-8B's heads with tiles of tokens and one token a program (GPU only).

The RoPE kernel launches one program per token and head for decode-sized steps and a tile of ``BLOCK_T``
tokens per program from ``TILE_MIN_TOKENS`` tokens on (``sparse_kernels._triton.rope._token_tile``, chosen
without a GPU). This times, at T = 5 (decode: every launch below is the one-token launch there, a control),
2048 (a prefill chunk) and 8192 tokens:

- ``tiled``: the default choice (8 tokens a program, 8 warps: each row laid out as the one-token launch);
- ``one-token``: one token a program at every T (the launch before tiling);
- ``vec16x4``: 16 tokens a program, 4 warps (16-byte accesses; sums the q/k norm's squares in another
  order, so its outputs may differ from the others' in a few last bits).

Qwen3-8B's 32 q heads, 8 kv heads, head_dim 128, bf16, with the q/k norm; q/k/v are strided views of one
merged projection as the model produces them. Each timing replays a CUDA graph of ``--calls`` calls cycling
over ``--sets`` distinct input sets (so long steps do not stay in the L2) and prints us per call and GB/s
counting the head bytes read and written (q, k in and out for ``rope_qk``; q, k, v in, q out and k, v into
the pool for ``rope_store``; the angle table and the metadata left out). It also counts the output elements
where each launch differs from ``one-token`` (expected: 0 for ``tiled``).

    python packages/sparse-kernels/benchmarks/rope_probe.py [--tokens 5,2048,8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import capture, copy_bandwidth, median_ms  # benchmarks/ (run as scripts)

from sparse_kernels import Rotation, rope_store
from sparse_kernels._triton import rope as rope_triton

HQ, HKV, D = 32, 8, 128
BLOCK_SIZE = 16  # the pool's tokens per block
MAX_POSITION = 131072
CHOOSE = rope_triton._token_tile


def _one_token(num_tokens: int, half: int) -> tuple[int, int]:
    return CHOOSE(0, half)


def _vec16x4(num_tokens: int, half: int) -> tuple[int, int]:
    return CHOOSE(num_tokens, half) if num_tokens < rope_triton.TILE_MIN_TOKENS else (16, 4)


LAUNCHES = {"one-token": _one_token, "tiled": CHOOSE, "vec16x4": _vec16x4}  # rope_triton._token_tile per launch


def make_sets(tokens: int, sets: int, gen: torch.Generator) -> list[dict]:
    """``sets`` independent steps of ``tokens`` tokens, each with its own merged projection and pool."""
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    angles = torch.arange(MAX_POSITION, device="cuda").float()[:, None] * inv_freq[None, :]
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    out = []
    for _ in range(sets):
        merged = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen, **bf16)
        q = merged[:, : HQ * D].view(tokens, HQ, D)
        k = merged[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)
        v = merged[:, (HQ + HKV) * D :].view(tokens, HKV, D)
        if tokens <= 32:  # decode: one token of each of T requests, anywhere in a 128K context
            positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen, device="cuda")
        else:  # a prefill chunk: consecutive positions
            start = int(torch.randint(0, MAX_POSITION - tokens, (1,), generator=gen, device="cuda"))
            positions = torch.arange(start, start + tokens, device="cuda")
        weights = [1 + 0.1 * torch.randn(D, generator=gen, **bf16) for _ in range(2)]
        rotation = Rotation(positions, table, *weights, eps=1e-6)
        num_blocks = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
        k_cache, v_cache = (torch.zeros(num_blocks, BLOCK_SIZE, HKV, D, **bf16) for _ in range(2))
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device="cuda")[:tokens].int()
        copy = {}
        if tokens <= 32:  # decode: the step's queries also go to a ring, as the engine's decode does
            ring = torch.zeros(tokens, HQ, D, **bf16)
            copy = dict(copy_into=ring, copy_index=torch.arange(tokens, device="cuda"), num_copy=tokens)
        out.append(dict(q=q, k=k, v=v, rotation=rotation, k_cache=k_cache, v_cache=v_cache, slots=slots, copy=copy))
    return out


def calls(sets: list[dict], n: int, op: str):
    def run():
        results = []
        for i in range(n):
            s = sets[i % len(sets)]
            if op == "rope_qk":
                results.append(s["rotation"].apply(s["q"], s["k"], backend="triton"))
            else:
                args = (s["q"], s["k"], s["v"], s["rotation"], s["k_cache"], s["v_cache"], s["slots"])
                results.append(rope_store(*args, **s["copy"], backend="triton"))
        return results

    return run


def head_bytes(tokens: int, op: str) -> int:
    heads = HQ + HKV if op == "rope_qk" else HQ + 2 * HKV
    return 2 * tokens * heads * D * 2  # read and written, bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="5,2048,8192")
    ap.add_argument("--calls", type=int, default=36, help="calls per graph replay (a model's layers)")
    ap.add_argument("--sets", type=int, default=4, help="distinct input sets the calls cycle over")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    try:
        for tokens in (int(t) for t in args.tokens.split(",")):
            sets = make_sets(tokens, args.sets, gen)
            for op in ("rope_qk", "rope_store"):
                outputs = {}
                for launch, choose in LAUNCHES.items():
                    rope_triton._token_tile = choose
                    block_t, num_warps = choose(tokens, D // 2)
                    fn = calls(sets, args.calls, op)
                    us = 1e3 * median_ms(capture(fn).replay, iters=10) / args.calls
                    first = calls(sets[:1], 1, op)()[0]
                    outputs[launch] = first if op == "rope_qk" else (first, sets[0]["k_cache"].clone())
                    differ = sum(
                        int((a != b).sum()) for a, b in zip(outputs[launch], outputs["one-token"], strict=True)
                    )
                    gbs = head_bytes(tokens, op) / (us * 1e-6) / 1e9
                    row = dict(op=op, tokens=tokens, launch=launch, block_t=block_t, num_warps=num_warps)
                    rows.append(dict(row, us=round(us, 2), gb_s=round(gbs), differing_elements=differ))
                    print(
                        f"{op:<10} T {tokens:>5} {launch:<9} BLOCK_T {block_t:>2} warps {num_warps:>2}"
                        f"  {us:9.2f} us  {gbs:7.0f} GB/s  {differ} elements differ from one-token"
                    )
            del sets
            torch.cuda.empty_cache()
    finally:
        rope_triton._token_tile = CHOOSE
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tb_s": round(bw / 1e12, 3), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
