"""Profile one real prefill through the engine (dummy weights): wall seconds, then the top CUDA kernels.

    python benchmarks/prefill_profile.py OUT_DIR [--prompt-len 131072] [--chunk 2048] [--model DIR]

Writes OUT_DIR/prefill_profile.json: wall seconds of a 1-token generation from the prompt (prefill
dominated), and the profiler's kernels by total CUDA time for a second, profiled run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparse_serve import LLM, SamplingParams
from sparse_serve.bench.command import DEFAULT_BENCH_MODEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--model", default=str(DEFAULT_BENCH_MODEL))
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=args.prompt_len + 16,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(100, 30000, (args.prompt_len,)).tolist()
    llm.generate([prompt[:4096]], params, use_tqdm=False)  # warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    print(f"prefill {args.prompt_len} tokens, chunk {args.chunk}: {wall:.2f} s", flush=True)
    result = {"prompt_len": args.prompt_len, "chunk": args.chunk, "wall_seconds": wall, "kernels": []}
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], params, use_tqdm=False)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in events)
        for e in events[:30]:
            result["kernels"].append({"name": e.key[:120], "calls": e.count, "cuda_s": e.self_device_time_total / 1e6})
        result["cuda_total_s"] = total / 1e6
        print(f"profiled CUDA self time total {total / 1e6:.2f} s", flush=True)
        for k in result["kernels"]:
            print(f"{k['cuda_s']:8.3f} s {k['calls']:7d}  {k['name']}")
    (args.out / "prefill_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
