"""MLA latent attention on the GPU at the GLM-4.7-Flash shape: Triton against the reference, and timing.

GLM-4.7-Flash (Glm4MoeLite): 20 query heads, kv_lora_rank 512, qk_rope_head_dim 64, so each cached
row is 576 bf16 channels (1152 bytes per token and layer) and the softmax scale is (192 + 64) ** -0.5.
For each case this checks ``latent_attention`` (Triton) against ``latent_attention_reference`` (max
abs error, bf16) and times the Triton call (CUDA-event median); decode reports the latent bytes read
per second against the device's copy bandwidth, prefill TFLOP/s of the absorbed form
(2 * H * (576 + 512) flops per (query, key) pair).

Usage (one H200, about a minute)::

    uv run python benchmarks/mla_probe.py --out results/mla_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/sparse-kernels/benchmarks"))
from _timing import copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels.latent_attention import latent_attention, latent_attention_reference, plan_latent  # noqa: E402

HEADS, LATENT, ROPE, BLOCK = 20, 512, 64, 16
SCALE = (192 + 64) ** -0.5


def _case(batch: int, kv_len: int, q_len: int, seed: int = 0):
    """A shuffled pool with ``batch`` requests of ``kv_len`` keys each, the last ``q_len`` of them new."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-kv_len // BLOCK)
    num_blocks = batch * pages
    cache = torch.randn(num_blocks, BLOCK, 1, LATENT + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)
    indices = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32).cpu()
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), kv_len - (pages - 1) * BLOCK, dtype=torch.int32)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, HEADS, LATENT + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)
    plan = plan_latent(
        qo_indptr, kv_indptr, indices, last, num_heads=HEADS, latent_dim=LATENT, rope_dim=ROPE,
        block_size=BLOCK, sm_scale=SCALE, device="cuda",
    )  # fmt: skip
    return q, cache, plan


def _check(q, cache, plan) -> float:
    got = latent_attention(q, cache, plan, backend="triton").float()
    want = latent_attention_reference(q, cache, plan).float()
    return float((got - want).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows (printed anyway)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for batch, kv_len in [(1, 8192), (1, 131072), (8, 32768), (32, 8192), (64, 4096)]:
        q, cache, plan = _case(batch, kv_len, 1)
        err = _check(q, cache, plan) if batch * kv_len <= 2**18 else None
        ms = median_ms(lambda q=q, cache=cache, plan=plan: latent_attention(q, cache, plan, backend="triton"))
        read = batch * kv_len * (LATENT + ROPE) * 2
        pct = 100 * read / (ms * 1e-3) / bandwidth
        rows.append(dict(kind="decode", batch=batch, kv_len=kv_len, splits=plan.num_splits, ms=ms,
                         max_abs_err=err, gb_s=read / ms / 1e6, pct_copy_bw=pct))  # fmt: skip
    for batch, kv_len, q_len in [(1, 4096, 4096), (1, 16384, 2048), (4, 8192, 512)]:
        q, cache, plan = _case(batch, kv_len, q_len)
        err = _check(q, cache, plan) if q_len * kv_len <= 2**23 else None
        run = lambda q=q, cache=cache, plan=plan: latent_attention(q, cache, plan, backend="triton")  # noqa: E731
        ms = median_ms(run, iters=5)
        pairs = batch * (q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2)  # causal
        flops = 2 * HEADS * (LATENT + ROPE + LATENT) * pairs
        rows.append(dict(kind="prefill", batch=batch, kv_len=kv_len, q_len=q_len, ms=ms, max_abs_err=err,
                         tflop_s=flops / ms / 1e9))  # fmt: skip
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"device": torch.cuda.get_device_name(), "copy_bw": bandwidth, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
