"""Session 31: RetroInfer's ranking logits from bf16 centroids against int8 codes + a scale each, at the engine's
shape (batch 5, 8 KV heads x 4 query heads, head_dim 128, 128K context, 16 tokens a cluster: 8192 live clusters
a row), on a GPU under CUDA-graph replay, rotating over 36 layers' arenas (3 GB of bf16 centroids: L2 holds
none). Checks the coded logits against the reference over the decoded centroids first. Also sweeps a few launch
shapes of the coded kernel. Run from the repository root with the packages importable."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "packages/sparse-kernels/benchmarks"))
from _timing import capture, copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels._triton import cluster_logits as mod  # noqa: E402
from sparse_kernels.cluster_logits import cluster_logits, decode_centroids, encode_centroids  # noqa: E402

N, HKV, G, D, CONTEXT, AVG, LAYERS = 5, 8, 4, 128, 131072, 16, 36
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
columns = (CONTEXT + 2048) // AVG  # the engine's Cw at max_pages for 2K more tokens
per_row = columns + 16
total = N * per_row
query = torch.randn(N, HKV * G, D, device=dev, generator=gen).bfloat16()
arenas = []
for _ in range(LAYERS):
    cent = torch.randn(HKV, total, D, device=dev, generator=gen).bfloat16()
    codes, scale = encode_centroids(cent)
    sizes = torch.randint(1, 2 * AVG, (HKV, total), device=dev, generator=gen, dtype=torch.int32)
    arenas.append((cent, codes, scale, sizes))
bases = torch.arange(N, device=dev) * per_row
counts = torch.full((N,), CONTEXT // AVG, device=dev)
sm = D**-0.5

cent, codes, scale, sizes = arenas[0]
want = cluster_logits(query, decode_centroids(codes, scale), sizes, bases, counts, columns, scale=sm, backend="reference")
got = cluster_logits(query, codes, sizes, bases, counts, columns, scale=sm, centroid_scale=scale)
finite = torch.isfinite(want.logits)
assert torch.equal(finite, torch.isfinite(got.logits)) and torch.equal(got.sizes, want.sizes)
err = float((got.logits[finite] - want.logits[finite]).abs().max())
print(f"coded logits against the decoded reference: max diff {err:.2e}", flush=True)
assert err < 1e-2

bw = copy_bandwidth()
print(f"copy bandwidth {bw / 1e9:.0f} GB/s")


def timed(coded: bool) -> float:
    def call():
        for cent, codes, scale, sizes in arenas:
            if coded:
                cluster_logits(query, codes, sizes, bases, counts, columns, scale=sm, centroid_scale=scale)
            else:
                cluster_logits(query, cent, sizes, bases, counts, columns, scale=sm)

    graph = capture(call)
    return median_ms(graph.replay) / LAYERS * 1e3


live = N * HKV * (CONTEXT // AVG)
for coded in (False, True):
    us = timed(coded)
    per = (D + 4 if coded else 2 * D) + 4  # centroid (+ scale) and size per live cluster
    out = N * HKV * columns * (G * 4 + 4)  # logits and sizes written
    gb = (live * per + out) / 1e9
    print(f"{'int8 codes' if coded else 'bf16      '}: {us:7.2f} us a layer, {gb * 1e3:.1f} MB, "
          f"{gb / (us * 1e-6) / (bw / 1e9) * 100:.1f}% of copy bandwidth", flush=True)
defaults = mod.BLOCK_C, mod.NUM_WARPS, mod.TILES_PER_PROGRAM, mod.NUM_STAGES
for shape in [(128, 8, 1, 2), (256, 8, 1, 2), (64, 4, 1, 2), (128, 4, 2, 2), (128, 4, 4, 3), (256, 4, 1, 2)]:
    mod.BLOCK_C, mod.NUM_WARPS, mod.TILES_PER_PROGRAM, mod.NUM_STAGES = shape
    print(f"int8 codes at BLOCK_C, warps, tiles, stages {shape}: {timed(True):7.2f} us a layer", flush=True)
mod.BLOCK_C, mod.NUM_WARPS, mod.TILES_PER_PROGRAM, mod.NUM_STAGES = defaults
