"""SnapKV's window scores at a decode-time eviction (issue 15): the ``window_probs`` Triton kernel
against the torch path it replaces, on the GPU.

Shape: Qwen3-8B heads (32 query, 8 KV, head_dim 128, bf16), 16-token pages in a shuffled pool, a
table of 8448 tokens per row with lengths 8192..8448, the last n = 32 queries of each row as the
window, B = 5 and 91 rows. Per batch size:

- ``torch``: what the method runs now, the gather of every row's keys into a padded copy plus
  ``sparse_methods.scoring.window_scores_batch(probability, pooling none, group mean)``;
- ``kernel``: ``window_probs`` plus the same group mean (a view and a mean);
- the device time of each of the kernel's two passes (torch profiler);
- ``cfg ...``: the kernel under other ``CONFIG`` settings (tile, warps, stages, loop steps per
  program, which set the split of each row's tokens), each checked against the default's output.

GB/s counts the keys read twice (both passes) plus the float32 output written. Checks first: the
kernel's group means against the torch path's, and its probabilities against ``window_probs``'
reference (max |diff|, and the diff relative to the largest probability).

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python3 benchmarks/window_scores_probe.py \\
        [--batches 5,91] [--no-sweep] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/sparse-kernels/benchmarks"))
from _timing import copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels import window_probs  # noqa: E402
from sparse_kernels._triton import window_scores as kernel  # noqa: E402
from sparse_methods.scoring import window_scores_batch  # noqa: E402

HQ, HKV, D, BS, N = 32, 8, 128, 16, 32
MAX_LEN = 8448
SCALE = D**-0.5
# CONFIG overrides of the Triton module (the rest at its defaults)
SWEEP = [
    {"num_warps": 4},
    {"num_stages": 3},
    {"BLOCK_T": 128},
    {"BLOCK_T": 32, "num_warps": 4},
    {"min_tiles": 1},
    {"min_tiles": 16, "max_tiles": 64},
    {"max_tiles": 132},
]


class Inputs:
    """One layer's paged keys and every row's window queries."""

    def __init__(self, batch: int, gen: torch.Generator):
        pages = MAX_LEN // BS
        num_blocks = batch * pages + 7
        self.batch = batch
        self.k_cache = torch.randn(num_blocks, BS, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen)[: batch * pages]
        self.table = perm.view(batch, pages).to(torch.int32)
        self.kv_lens = MAX_LEN - torch.randint(0, 257, (batch,), device="cuda", generator=gen)
        self.queries = torch.randn(batch, N, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)

    def padded_keys(self) -> torch.Tensor:
        """Every row's keys in slot order, ``[B, MAX_LEN, Hkv, D]`` (the torch path's gather)."""
        t = torch.arange(MAX_LEN, device="cuda")
        slots = self.table.long()[:, t // BS] * BS + t % BS
        return self.k_cache.view(-1, HKV, D)[slots]

    def nbytes(self) -> int:
        keys = int(self.kv_lens.sum()) * HKV * D * 2
        return 2 * keys + self.batch * HQ * MAX_LEN * 4


def torch_path(x: Inputs) -> torch.Tensor:
    keys = x.padded_keys()
    return window_scores_batch(x.queries, keys, x.kv_lens, SCALE, pooling="none", group_reduce="mean")


def kernel_path(x: Inputs) -> torch.Tensor:
    probs = window_probs(x.queries, x.k_cache, x.table, x.kv_lens, SCALE, backend="triton")
    return probs.view(x.batch, HKV, HQ // HKV, MAX_LEN).mean(2)


def row(name: str, ms: float, nbytes: int | None, bw: float) -> dict:
    entry = {"path": name, "ms": round(ms, 3)}
    text = f"  {name:<36} {ms:8.3f} ms"
    if nbytes is not None:
        gbs = nbytes / (ms * 1e-3) / 1e9
        entry.update(gb_per_s=round(gbs, 1), pct_copy=round(100 * gbs * 1e9 / bw, 1))
        text += f"  {gbs:7.0f} GB/s  {entry['pct_copy']:5.1f}% copy"
    print(text, flush=True)
    return entry


def pass_times_us(x: Inputs, calls: int = 5) -> dict[str, float]:
    """Device time per call of each of the kernel's passes (the torch profiler's CUDA kernel times)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            window_probs(x.queries, x.k_cache, x.table, x.kv_lens, SCALE, backend="triton")
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.key.startswith("_window_"):
            times[event.key] = event.device_time_total / calls
    return times


def check(x: Inputs) -> dict:
    ours = kernel_path(x)
    theirs = torch_path(x)
    width = MAX_LEN - N
    diff = (ours[..., :width] - theirs[..., :width]).abs().max().item()
    probs = window_probs(x.queries, x.k_cache, x.table, x.kv_lens, SCALE, backend="triton")
    ref = window_probs(x.queries, x.k_cache, x.table, x.kv_lens, SCALE, backend="reference")
    ref_diff = (probs - ref).abs().max().item()
    rel = ref_diff / ref.abs().max().item()
    print(f"  check: |kernel - torch path| {diff:.3g}, |kernel - reference| {ref_diff:.3g} ({rel:.2e} of max)")
    assert rel < 1e-2, "kernel disagrees with the reference"
    return {"max_diff_torch_path": diff, "max_diff_reference": ref_diff, "rel_diff_reference": rel}


def probe(batch: int, bw: float, sweep: bool, gen: torch.Generator) -> dict:
    print(f"B={batch} L={MAX_LEN} Hq={HQ} Hkv={HKV} D={D} n={N} block={BS}", flush=True)
    x = Inputs(batch, gen)
    result = {"batch": batch, **check(x)}
    nbytes = x.nbytes()
    iters = 3 if batch > 16 else 10
    torch_ms = median_ms(lambda: torch_path(x), iters=iters, reps=3)
    rows = [row("torch (gather + window_scores_batch)", torch_ms, None, bw)]
    rows.append(row("kernel (window_probs + group mean)", median_ms(lambda: kernel_path(x), iters=iters), nbytes, bw))
    default = kernel_path(x)
    for name, us in pass_times_us(x).items():
        print(f"    {name:<34} {us:8.1f} us", flush=True)
        result[name] = round(us, 1)
    for change in SWEEP if sweep else []:
        saved = dict(kernel.CONFIG)
        kernel.CONFIG.update(change)
        try:
            torch.testing.assert_close(kernel_path(x), default, rtol=1e-3, atol=1e-6)
            ms = median_ms(lambda: kernel_path(x), iters=iters)
            rows.append(row("  cfg " + " ".join(f"{k}={v}" for k, v in change.items()), ms, nbytes, bw))
        finally:
            kernel.CONFIG.update(saved)
    result["rows"] = rows
    result["speedup"] = round(rows[0]["ms"] / rows[1]["ms"], 2)
    print(f"  kernel speedup over the torch path: {result['speedup']}x", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="5,91")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = [probe(int(b), bw, not args.no_sweep, gen) for b in args.batches.split(",")]
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
