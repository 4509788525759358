"""Host time of a decode step, part by part, on the CPU (the model forward is stubbed out).

Builds an engine on a Qwen3-shaped config with many layers (36) but a tiny hidden size, adds
synthetic requests (their KV is never touched, so the lazily mapped CPU pool stays small) and
times each part of ``LLMEngine.step()`` that is not the forward: scheduler, step metadata, the
method's prepare/finish hooks, the graph path's input staging, ``attention.plan`` (the Triton decode
plan: validation and buffer loads) and the sampler; ``postprocess`` is what remains of the step
(per-request bookkeeping, ``cache_blocks``, outputs).

The step takes the CUDA-graph path as on a GPU: a ``DecodeGraphs`` without capture whose replay
is a no-op, the decode wrapper on its Triton backend (its plan only copies into buffers), and
``Tensor.pin_memory`` as the identity (there is no CUDA here). So the numbers are the host work
that the GPU waits for, serially, before each replay.

    uv run python benchmarks/host_overhead.py                   # the default shapes
    uv run python benchmarks/host_overhead.py --case 23x32768 --profile 10   # plus a cProfile top list
    uv run python benchmarks/host_overhead.py --sliding-window 1024   # Gemma 3's 5 local : 1 global layers
                                                                       # (a block table per layer)
    uv run python benchmarks/host_overhead.py --sparse-method pyramidkv --case 83x131072   # a table per layer
    uv run python benchmarks/host_overhead.py --sparse-method adakv --case 76x131072   # a table per lane

With ``--sparse-method``, requests hold what the method keeps after prefill (``--budget`` tokens per
layer on average: 64 sink + the middle + 512 recent), and the pool is sized for it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

os.environ.setdefault("SPARSE_KERNELS_BACKEND", "triton")  # the GPU's plan path (no kernel runs here)

from sparse_serve import cuda_graphs  # noqa: E402
from sparse_serve import engine as engine_module  # noqa: E402
from sparse_serve.config import EngineConfig  # noqa: E402
from sparse_serve.engine import LLMEngine  # noqa: E402
from sparse_serve.sampling_params import SamplingParams  # noqa: E402

DEFAULT_CASES = ("1x32768", "23x32768", "5x131072", "76x10240")
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=8)


def tiny_config(num_layers: int, vocab: int, sliding_window: int | None = None, kv_heads: int = 2) -> str:
    """A Qwen3-8B-shaped config with a tiny hidden size, written to a temporary folder; with
    ``sliding_window``, five of every six layers slide over it (Gemma 3's pattern)."""
    src = Path(__file__).resolve().parents[1] / "packages/sparse-serve/src/sparse_serve/bench/configs/qwen3-8b"
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(
        TINY, num_key_value_heads=kv_heads, num_hidden_layers=num_layers, max_window_layers=num_layers, vocab_size=vocab
    )
    cfg.update(torch_dtype="float32", bos_token_id=0, eos_token_id=1)
    if sliding_window is not None:
        kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(num_layers)]
        cfg.update(use_sliding_window=True, sliding_window=sliding_window, layer_types=kinds)
    folder = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


class StubModel:
    """Stands in for the model: zeros of the right shapes, no compute."""

    def __init__(self, hidden: int, vocab: int, device: torch.device):
        self.hidden, self.vocab, self.device = hidden, vocab, device

    def __call__(self, input_ids, positions, attention):
        return torch.zeros(input_ids.numel(), self.hidden, device=self.device)

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.vocab, device=self.device)
        logits[:, 7] = 1.0  # greedy picks token 7 (not EOS)
        return logits


class _NoopGraph:
    def replay(self) -> None:
        pass


def install_fake_graphs(engine: LLMEngine, max_batch: int) -> None:
    """Route decode steps through ``DecodeGraphs.run`` with no-op replays (the GPU's host path)."""
    runner = engine.runner
    cfg = runner.model_config
    runner.model = StubModel(cfg.hidden_size, cfg.vocab_size, runner.device)
    layer_group = tuple(range(cfg.num_hidden_layers)) if engine.kv.per_layer else None  # a table per layer
    heads = engine.kv.layout.heads  # a head-major store's rows per request
    graphs = cuda_graphs.DecodeGraphs(
        runner.model, runner.attention, cfg.num_hidden_layers, max_batch, runner.device, layer_group, heads
    )
    for bs in graphs.sizes:
        graphs.graphs[bs] = _NoopGraph()
        graphs.outputs[bs] = torch.zeros(bs, cfg.hidden_size, device=runner.device)
    runner.graphs = graphs
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # no CUDA: staging copies stay plain


class Timers:
    """Accumulates wall time per part by wrapping callables."""

    def __init__(self):
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.active = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.ms[name].append((time.perf_counter() - t0) * 1e3)

        return timed


def instrument(engine: LLMEngine, timers: Timers) -> None:
    runner = engine.runner
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine_module.build_step_metadata = timers.wrap("step_metadata", engine_module.build_step_metadata)
    runner.method.prepare_step = timers.wrap("method.prepare_step", runner.method.prepare_step)
    engine.method.finish_step = timers.wrap("method.finish_step", engine.method.finish_step)
    runner.attention.plan = timers.wrap("attention.plan", runner.attention.plan)
    sampler = runner.sampler
    if hasattr(sampler, "sample"):  # sample(): queued on the device; tolist() is timed as the fetch
        sampler.sample = timers.wrap("sampler", sampler.sample)
    else:
        runner.sampler = timers.wrap("sampler", sampler)
    runner.graphs.run = timers.wrap("graphs.run (incl. plan)", runner.graphs.run)
    runner.run = timers.wrap("runner.run", runner.run)


SINK, RECENT = 64, 512  # the methods' default sink and recent tokens


def method_fields(method: str, budget: int) -> dict:
    """Engine fields of ``method`` keeping ``budget`` tokens per layer on average."""
    if method == "dense":
        return {}
    if budget <= SINK + RECENT:
        raise ValueError(f"budget must exceed {SINK + RECENT}")
    return dict(
        sparse_method=method,
        sink_keep_tokens=SINK,
        decode_keep_tokens=budget - SINK - RECENT,
        recent_keep_tokens=RECENT,
    )


def build(
    batch: int,
    prompt_len: int,
    output_len: int,
    num_layers: int,
    vocab: int,
    device: str = "cpu",
    window=None,
    method: str = "dense",
    budget: int = 8192,
    kv_heads: int = 2,
) -> LLMEngine:
    kept = prompt_len if method == "dense" else min(prompt_len, budget)
    # Per table (layer, lane); a per-layer method's layers differ around the average: twice for room.
    blocks_each = -(-(kept + output_len + 16) // 16) * (1 if method == "dense" else 2)
    config = EngineConfig(
        model=tiny_config(num_layers, vocab, window, kv_heads),
        device=device,
        enforce_eager=True,  # no capture: the fake graphs below replay nothing
        load_format="dummy",
        num_kv_blocks=batch * blocks_each + 16,
        max_num_seqs=256,  # as the GPU bench: sizes the decode buffers' capacities
        **method_fields(method, budget),
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_synthetic_request(prompt_len, params)
    install_fake_graphs(engine, 256)
    return engine


def run_case(
    case: str,
    steps: int,
    warmup: int,
    num_layers: int,
    vocab: int,
    profile: int,
    device: str,
    window=None,
    method: str = "dense",
    budget: int = 8192,
    kv_heads: int = 2,
) -> dict:
    batch, prompt_len = (int(x) for x in case.split("x"))
    output_len = warmup + steps + profile + 2
    engine = build(batch, prompt_len, output_len, num_layers, vocab, device, window, method, budget, kv_heads)
    timers = Timers()
    instrument(engine, timers)
    for _ in range(warmup):
        engine.step()
    timers.active = True
    replays = engine.runner.graphs.num_replays  # a method's first decode step may observe (eager)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        timers.ms["step"].append((time.perf_counter() - t0) * 1e3)
    timers.active = False
    if engine.runner.graphs.num_replays - replays < steps:
        raise RuntimeError("steps did not take the graph path")
    stats = {"median_ms": statistics.median, "min_ms": min}  # min: robust on a shared, loaded host
    result_stats = {}
    for stat, fn in stats.items():
        med = {k: fn(v) for k, v in timers.ms.items()}
        parts = ("schedule", "step_metadata", "method.finish_step", "runner.run")
        med["graph inputs + pad (graphs.run - plan)"] = med["graphs.run (incl. plan)"] - med["attention.plan"]
        med["runner other (run - graphs.run - sampler - prepare)"] = (
            med["runner.run"] - med["graphs.run (incl. plan)"] - med["sampler"] - med["method.prepare_step"]
        )
        med["postprocess (step - the rest)"] = med["step"] - sum(med[p] for p in parts)
        result_stats[stat] = med
    tables = range(engine.kv.layout.num_tables)
    blocks = sum(len(engine.kv.table(r.request_id, t).block_ids) for r in engine.scheduler.running for t in tables)
    result = {
        "case": case,
        "method": method,
        "batch": batch,
        "prompt_len": prompt_len,
        "blocks_listed": blocks,
        **result_stats,
    }
    if profile:
        profile_steps(engine, profile, top=25)
    return result


def profile_steps(engine, steps: int, top: int) -> None:
    """Print a cProfile of ``steps`` engine steps, ``top`` entries by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--case", action="append", help="BATCHxPROMPT_LEN (repeatable); default: " + ", ".join(DEFAULT_CASES)
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=36)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--profile", type=int, default=0, help="also cProfile this many steps per case")
    ap.add_argument("--device", default="cpu", help="cuda: real pinned copies and syncs (the stub model still)")
    ap.add_argument("--sliding-window", type=int, help="5 of 6 layers slide over this window (a table per layer)")
    ap.add_argument("--sparse-method", default="dense", help="e.g. snapkv, pyramidkv, adakv")
    ap.add_argument("--budget", type=int, default=8192, help="tokens a method keeps per layer (average)")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads (Qwen3-8B: 8; a head-major lane each)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    order = (
        "step",
        "schedule",
        "step_metadata",
        "attention.plan",
        "graph inputs + pad (graphs.run - plan)",
        "sampler",
        "method.prepare_step",
        "method.finish_step",
        "runner other (run - graphs.run - sampler - prepare)",
        "postprocess (step - the rest)",
    )
    for case in args.case or DEFAULT_CASES:
        r = run_case(
            case,
            args.steps,
            args.warmup,
            args.num_layers,
            args.vocab,
            args.profile,
            args.device,
            args.sliding_window,
            args.sparse_method,
            args.budget,
            args.kv_heads,
        )
        results.append(r)
        print(
            f"\n{args.sparse_method} {case}: {r['blocks_listed']} blocks listed; "
            f"ms per step: median, min over {args.steps} steps"
        )
        for k in order:
            print(f"  {k:55s} {r['median_ms'][k]:8.3f} {r['min_ms'][k]:8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
