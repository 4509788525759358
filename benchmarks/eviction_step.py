"""Host time of a decode-time eviction step on the CPU: many requests evicting at the same step.

Builds an engine on a Qwen3-shaped config with 36 layers but a tiny hidden size and dummy weights,
adds synthetic requests that all start decoding together (so all of them evict at the same step,
every ``--interval`` tokens, as in the GPU bench), and times steps with and without an eviction.
The KV is tiny (a short budget), so the time is the per-(request, layer) host work of observing,
scoring, top-k and compacting, which on a GPU the device waits for.

    uv run python benchmarks/eviction_step.py                    # 91 requests, SnapKV
    uv run python benchmarks/eviction_step.py --method pyramidkv --profile 1
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault(
    "SPARSE_KERNELS_BACKEND", "auto"
)  # the reference kernels on CPU (host_overhead picks Triton's plans)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import tiny_config  # noqa: E402

from sparse_serve.config import EngineConfig  # noqa: E402
from sparse_serve.engine import LLMEngine  # noqa: E402
from sparse_serve.sampling_params import SamplingParams  # noqa: E402


def build(method: str, batch: int, prompt_len: int, interval: int, rounds: int, num_layers: int, args) -> LLMEngine:
    output_len = interval * rounds + 2
    sink, middle, recent = args.budget
    held = min(prompt_len, sink + middle + recent) if args.model else prompt_len
    blocks_each = -(-(held + output_len + 16) // 16)
    # One prompt is held whole until its prefill compacts (prefilled one at a time): at a small batch the
    # pool must still fit it, and max_model_len must not shrink to the pool of the compacted requests.
    prefill_peak = -(-(prompt_len + 16) // 16) - blocks_each
    config = EngineConfig(
        model=args.model or tiny_config(num_layers, 512),
        device=args.device,
        enforce_eager=args.device == "cpu",
        load_format="dummy",
        num_kv_blocks=batch * blocks_each + max(0, prefill_peak) + 16,
        max_model_len=prompt_len + output_len,
        max_num_seqs=max(batch, 8),
        sparse_method=method,
        sink_keep_tokens=sink,
        decode_keep_tokens=middle,
        recent_keep_tokens=recent,
        observation_window_size=args.window,
        decode_eviction_interval=interval,
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_synthetic_request(prompt_len, params)
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="snapkv")
    p.add_argument("--batch", type=int, default=91)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--interval", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="cProfile one eviction step (top 30)")
    p.add_argument("--profile-sort", default="cumulative", help="pstats sort key of --profile (tottime: own time)")
    p.add_argument("--model", default=None, help="a model folder (default: the tiny 36-layer config)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget", default="4,40,16", help="sink,middle,recent tokens kept")
    p.add_argument("--window", type=int, default=8, help="observation_window_size")
    p.add_argument("--torch-profile", action="store_true", help="torch.profiler on one eviction step (CUDA)")
    args = p.parse_args()
    args.budget = tuple(int(x) for x in args.budget.split(","))
    torch.set_num_threads(1)
    rounds = args.rounds + args.profile + args.torch_profile
    engine = build(args.method, args.batch, args.prompt_len, args.interval, rounds, args.layers, args)
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    wall, cpu = [], []  # per step: wall ms, and this process's CPU ms (steadier on a shared host)
    for _ in range(args.interval * args.rounds + 1):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        sync()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    # The eviction steps, found by timing: the slowest step (after the first, which decodes the last
    # prompt token) and every interval-th step from it.
    phase = max(range(1, len(wall)), key=wall.__getitem__) % args.interval
    evicting = [i for i in range(1, len(wall)) if i % args.interval == phase]
    to_next = (phase - len(wall)) % args.interval  # steps before the next eviction step
    for _ in range(to_next if args.profile or args.torch_profile else 0):
        engine.step()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        engine.step()
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats(args.profile_sort).print_stats(30)
        for _ in range(args.interval - 1 if args.torch_profile else 0):
            engine.step()
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            engine.step()
            sync()
        top = [e for e in tprof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
        print(f"torch ops launched by the host in the profiled eviction step: {len(top)}")
        table = tprof.key_averages().table
        if cuda:
            print(table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))
        print(table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for name, times in (("wall", wall), ("cpu", cpu)):
        plain = statistics.median(t for i, t in enumerate(times[3:], 3) if i not in evicting)
        compact = [times[i] for i in evicting]
        print(
            f"{args.method}: {args.batch} requests x {args.layers} layers ({name} time): step without eviction "
            f"{plain:.1f} ms (median), eviction steps {', '.join(f'{t:.0f}' for t in compact)} ms "
            f"(steps {evicting}); eviction cost {statistics.median(compact) - plain:.0f} ms"
        )


if __name__ == "__main__":
    main()
