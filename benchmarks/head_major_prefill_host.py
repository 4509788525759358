"""Host time of a head-major store's prefill on the CPU (KVzip by default), with a cProfile top list.

A Qwen3-8B-shaped config (36 layers, 8 KV heads) with a tiny hidden size, so that the forward costs
little and what remains is the host's work: block pool, per-lane tables, step metadata, lane keys.
The pool is sized with ``--num-kv-blocks`` (an H200 holds ~13.9 M one-head blocks at 8B).

    uv run python benchmarks/head_major_prefill_host.py --prompt-len 4096 --chunk 1024
    uv run python benchmarks/head_major_prefill_host.py --sparse-method adakv --profile 20
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import tiny_config  # noqa: E402

os.environ["SPARSE_KERNELS_BACKEND"] = "auto"  # host_overhead asks for Triton; the reference runs on the CPU

from sparse_serve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--sparse-method", default="kvzip")
    ap.add_argument("--num-kv-blocks", type=int, default=1_000_000)
    ap.add_argument("--num-layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--profile", type=int, default=25, help="cProfile top list length (0: none)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(
        tiny_config(args.num_layers, 1024, kv_heads=args.kv_heads),
        load_format="dummy",
        device="cpu",
        max_model_len=args.prompt_len + 64,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=4,
        enable_prefix_caching=False,
        num_kv_blocks=args.num_kv_blocks,
        sparse_method=args.sparse_method,
    )
    build_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(100, 1000, (args.prompt_len,)).tolist()
    llm.generate([prompt[:256]], params, use_tqdm=False)  # warm up
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    if prof:
        prof.disable()
    run_s = time.perf_counter() - t0
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(
            "step_metadata|block_pool|kv_cache_manager|_lane_keys|head_major|_slots|scheduler"
        )
    print(
        f"{args.sparse_method} {args.prompt_len} tokens, chunk {args.chunk}, {args.num_kv_blocks} blocks: "
        f"engine build {build_s:.2f} s, prefill + 2 tokens {run_s:.2f} s (profiled: {bool(prof)})"
    )


if __name__ == "__main__":
    main()
