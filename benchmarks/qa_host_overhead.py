"""Host time of a query-aware decode step (Quest, OmniKV, dense beside them), on the CPU.

The GPU bench times ``engine.step()`` after a device sync, so every millisecond the host spends
before the graph replay (scheduling, step metadata, ``attention.plan`` with the selective plan) and
after it (sampling, bookkeeping) adds to the step. This measures that host part with the model
stubbed out and the CUDA-graph path taken as on a GPU (replays are no-ops), for one
``BATCHxPROMPT_LEN`` case per method, and breaks ``attention.plan`` into the dense plan and the
selective plan (``SelectiveDecode.plan_step``).

    uv run python benchmarks/qa_host_overhead.py                      # 5x131072, dense/quest/omnikv
    uv run python benchmarks/qa_host_overhead.py --case 5x32768 --profile 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

os.environ.setdefault("SPARSE_KERNELS_BACKEND", "triton")  # the GPU's plan path (no kernel runs here)

from sparse_serve import engine as engine_module  # noqa: E402
from sparse_serve.config import EngineConfig  # noqa: E402
from sparse_serve.engine import LLMEngine  # noqa: E402
from sparse_serve.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_overhead  # noqa: E402  (the same stub engine as host_overhead.py)
from host_overhead import profile_steps, tiny_config  # noqa: E402

BUDGET = dict(sink_keep_tokens=64, decode_keep_tokens=1472, recent_keep_tokens=512)


class _AnyKey(dict):
    """A graph table that has every key (selecting graphs are 'captured' already)."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key):
        return self.value


def install_fake_graphs(engine: LLMEngine, max_batch: int) -> None:
    """host_overhead's no-op decode graphs, plus selecting graphs 'captured' for every key."""
    host_overhead.install_fake_graphs(engine, max_batch)
    graphs, cfg = engine.runner.graphs, engine.runner.model_config
    graphs.selecting_graphs = _AnyKey(host_overhead._NoopGraph())
    graphs.selecting_outputs = _AnyKey(torch.zeros(max_batch, cfg.hidden_size, device=engine.runner.device))


def _wrap(ms: dict, name: str, fn, active: list):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if active[0]:
                ms[name].append((time.perf_counter() - t0) * 1e3)

    return timed


def run_case(method: str, case: str, steps: int, warmup: int, num_layers: int, vocab: int, profile: int) -> dict:
    batch, prompt_len = (int(x) for x in case.split("x"))
    output_len = warmup + steps + profile + 2
    blocks_each = -(-(prompt_len + output_len + 16) // 16)
    extra = BUDGET if method != "dense" else {}
    config = EngineConfig(
        model=tiny_config(num_layers, vocab),
        device="cpu",
        enforce_eager=True,
        load_format="dummy",
        num_kv_blocks=batch * blocks_each + 16,
        max_num_seqs=8,  # as the GPU run (--max-num-seqs 8)
        sparse_method=method,
        **extra,
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_synthetic_request(prompt_len, params)
    install_fake_graphs(engine, 8)
    runner, att = engine.runner, engine.runner.attention
    ms: dict[str, list[float]] = defaultdict(list)
    active = [False]
    engine.scheduler.schedule = _wrap(ms, "schedule", engine.scheduler.schedule, active)
    engine_module.build_step_metadata = _wrap(ms, "step_metadata", engine_module.build_step_metadata, active)
    att.plan = _wrap(ms, "attention.plan", att.plan, active)
    att.selective.plan_step = _wrap(ms, "  selective.plan_step", att.selective.plan_step, active)
    runner.graphs.run = _wrap(ms, "graphs.run (incl. plan)", runner.graphs.run, active)
    runner.run = _wrap(ms, "runner.run", runner.run, active)
    for _ in range(warmup):
        engine.step()
    active[0] = True
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        ms["step"].append((time.perf_counter() - t0) * 1e3)
    active[0] = False
    if runner.graphs.num_replays < warmup + steps:
        raise RuntimeError("steps did not take the graph path")
    result = {
        "method": method,
        "case": case,
        "median_ms": {k: statistics.median(v) for k, v in ms.items()},
        "min_ms": {k: min(v) for k, v in ms.items()},
    }
    if profile:
        profile_steps(engine, profile, top=30)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="5x131072", help="BATCHxPROMPT_LEN")
    ap.add_argument("--method", action="append", help="dense, quest, omnikv (repeatable; default all three)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=36)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for method in args.method or ("dense", "quest", "omnikv"):
        r = run_case(method, args.case, args.steps, args.warmup, args.num_layers, args.vocab, args.profile)
        results.append(r)
        print(f"\n{method} {args.case}: ms per step (median, min over {args.steps} steps)")
        for k in r["median_ms"]:
            print(f"  {k:40s} {r['median_ms'][k]:8.3f} {r['min_ms'][k]:8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
