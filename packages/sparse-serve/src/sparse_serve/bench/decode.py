"""Steady-state decode through the engine: add a batch, step it, time the decode steps.

Synthetic prefill (``engine.add_synthetic_request``) makes each request hold exactly the KV its
method keeps after prefill, filled with the pool's noise, so 128K-context decode is measurable in
seconds; real prefill runs the prompts through the engine first (timed on its own, with decodes
held until the whole batch is prefilled, so the timed decode steps run with the whole batch) and
then times the decode steps that follow. Either way the bytes a step must read are counted from the requests'
KV lengths before the step, so achieved bandwidth is measured, not assumed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm.auto import tqdm

from sparse_serve.bench.prefill import random_prompt, run_prefill, synchronize
from sparse_serve.bench.probes import peak_memory, profile_device, reset_peak_memory
from sparse_serve.bench.stalls import StallProbe
from sparse_serve.engine import LLMEngine
from sparse_serve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class DecodeCase:
    """One measurement: ``batch_size`` requests of ``prompt_len`` tokens generating ``output_len``.

    batch_size : None means the largest batch that fits (``max_batch_size``).
    output_len : tokens each request generates; the memory plan (and so ``max``) is sized for all of them.
    timed_steps : decode steps timed after ``warmup_steps``; None times every remaining step.
    """

    prompt_len: int
    batch_size: int | None
    output_len: int
    prefill: Literal["synthetic", "real"] = "synthetic"
    warmup_steps: int = 3
    timed_steps: int | None = None
    profile_steps: int = 0


def blocks_per_request(engine: LLMEngine, prompt_len: int, output_len: int, prefill: str = "real") -> tuple[int, int]:
    """(decode blocks, prefill-peak blocks) one request needs, from its method's memory plan: blocks of
    its largest layer's table, or with a table per layer the sum of each layer's (a windowed layer's
    capped at its window). Head-major tables: a synthetic request holds the plan in every lane alike;
    a real one's ragged lanes may round up in each lane (the layout's bound)."""
    chunk = engine.config.max_num_batched_tokens
    plan = engine.method.memory_plan(prompt_len, output_len, chunk)
    bs, layout = engine.config.block_size, engine.kv.layout
    decode = [max(d, r + 1) for d, r in zip(plan.decode_peak_tokens, plan.resident_tokens, strict=True)]
    if prefill == "synthetic" and layout.heads > 1:
        decode = layout.per_table(decode)
    prefill = plan.prefill_peak_tokens
    return engine.kv.num_blocks_for(layout.window_peaks(decode, 1, bs)), engine.kv.num_blocks_for(
        layout.window_peaks(prefill, chunk, bs)
    )


def max_batch_size(engine: LLMEngine, prompt_len: int, output_len: int, prefill: str = "synthetic") -> int:
    """Most requests that fit the pool together for the whole decode (at most ``max_num_seqs``).

    Each holds its plan's decode peak (resident + output for methods that do not evict during
    decode); with real prefill one request at a time may also need its prefill peak.
    """
    per_req, prefill_peak = blocks_per_request(engine, prompt_len, output_len, prefill)
    extra = max(0, prefill_peak - per_req) if prefill == "real" else 0
    fit = (engine.kv.num_blocks - extra) // per_req
    if fit < 1:
        raise ValueError(f"one request of {prompt_len}+{output_len} tokens does not fit the KV pool")
    return min(fit, engine.config.max_num_seqs)


def _add_requests(engine: LLMEngine, case: DecodeCase, batch: int, prompts: torch.Generator) -> list[str]:
    """Add the batch (all or none: a request that does not fit aborts those added before it)."""
    params = SamplingParams(max_tokens=case.output_len, temperature=0.0, ignore_eos=True)
    ids: list[str] = []
    try:
        for _ in range(batch):
            if case.prefill == "synthetic":
                ids.append(engine.add_synthetic_request(case.prompt_len, params))
            else:
                ids.append(engine.add_request(random_prompt(engine, case.prompt_len, prompts), params))
    except ValueError:
        for rid in ids:
            engine.abort_request(rid)
        raise
    return ids


def _graph_replays(engine: LLMEngine) -> int:
    graphs = getattr(engine.runner, "graphs", None)  # None: eager (CPU, enforce_eager, or no graph support)
    return graphs.num_replays if graphs is not None else 0


def _step_kv_tokens(engine: LLMEngine) -> tuple[int, int]:
    """(KV slots all layers of all running requests read this step, running requests).

    A layer where the method selects what a decode query reads counts the selected pages (and,
    with block summaries, each page's min / max keys in slot-equivalents, ``_summary_slots``) instead of every slot.
    Layers that read everything (``DecodeRead.ALL``) are summed directly: this runs between timed steps,
    so it must stay cheap (``_step_kv_tokens_reference``).
    """
    running = engine.scheduler.running
    if not running:
        return 0, 0
    heads = engine.kv.layout.heads  # head-major: the lengths are per lane, a slot one head's
    method, bs = engine.method, engine.config.block_size
    summaries = _summary_slots(engine)
    layers = range(len(running[0].kv_lens))
    special = [layer for layer in layers if method.layer_plan(layer).selects_decode]
    total = 0
    for r in running:
        total += sum(r.kv_lens) + len(r.kv_lens)  # every layer reads kv_len + 1 slots ...
        for layer in special:  # ... except those that select (or count their reads themselves)
            n = r.kv_lens[layer] + 1
            read = method.decode_read_tokens(layer, n, bs)
            total += read - n + (-(-n // bs) * summaries if read < n else 0)
    return -(-total // heads), len(running)


def _summary_slots(engine: LLMEngine) -> float:
    """Slots' worth of bytes a page bound reads per block (0 without summaries; 1 for model-dtype min /
    max over a model-dtype store, about 0.51 for int8 codes with their scales; a KIVI page's key
    statistics, part of its slots' own bytes, otherwise)."""
    store = getattr(engine.runner.kv, "store", None)
    itemsize = engine.runner.dtype.itemsize
    bound = 0 if store is None else store.page_bound_bytes(itemsize)
    if not bound:
        return 0
    slot = (store.bytes_per_block(itemsize) - store.summary_bytes(itemsize)) / store.block_size
    ratio = bound / slot
    return int(ratio) if ratio == int(ratio) else ratio


def _step_kv_tokens_reference(engine: LLMEngine) -> tuple[int, int]:
    """``_step_kv_tokens`` layer by layer through the method (tests hold them equal)."""
    running = engine.scheduler.running
    method, bs = engine.method, engine.config.block_size
    summaries = _summary_slots(engine)
    heads = engine.kv.layout.heads  # head-major: per lane, each lane a layer's head
    total = 0
    for r in running:
        for lane, kv_len in enumerate(r.kv_lens):
            n = kv_len + 1
            read = method.decode_read_tokens(lane // heads, n, bs)
            total += read + (-(-n // bs) * summaries if read < n else 0)
    return -(-total // heads), len(running)


def run_decode_case(
    engine: LLMEngine,
    case: DecodeCase,
    *,
    kv_bytes_per_slot: int,
    seed: int = 0,
    prompts: torch.Generator | None = None,
    progress: bool = True,
) -> dict:
    """Measure one case on an idle engine; returns its raw timings (``summarize`` makes the metrics).

    ``kv_bytes_per_slot``: K + V bytes of one token in one layer. ``prompts``: draws the real
    prefill's prompt ids (default: seeded with ``seed``; pass one generator to every case so that no
    case's prompts share a prefix with another's in the prefix cache). Raises RuntimeError when a
    request was preempted (the batch did not really fit) and ValueError when it cannot be added. The
    engine is idle again afterwards (what is left of the batch is aborted).
    """
    device = engine.runner.device
    batch = case.batch_size or max_batch_size(engine, case.prompt_len, case.output_len, case.prefill)
    preemptions, hits = engine.scheduler.num_preemptions, engine.prefix_hit_tokens
    warm_round_steps = warm_decode_round(engine, case, batch)
    reset_peak_memory(device)
    ids = _add_requests(engine, case, batch, prompts or torch.Generator().manual_seed(seed))
    engine.scheduler.hold_decodes = case.prefill == "real"  # so that the timed steps run the whole batch
    try:
        prefill_s, prefill_steps = run_prefill(engine) if case.prefill == "real" else (None, 0)
        engine.scheduler.hold_decodes = False
        raw = _time_decode(engine, case, f"{case.prompt_len} tok x{batch}", progress)
        if case.profile_steps and device.type == "cuda":
            raw.update(profile_device(engine.step, case.profile_steps, engine.has_unfinished_requests))
        raw["peak_memory_bytes"] = peak_memory(device)
    finally:
        engine.scheduler.hold_decodes = False
        for rid in ids:
            engine.abort_request(rid)
    if engine.scheduler.num_preemptions != preemptions:
        raise RuntimeError(f"requests were preempted at batch {batch}: the batch does not fit the KV pool")
    if not raw["step_seconds"]:
        raise ValueError(f"no decode step was timed: output_len={case.output_len} <= warmup_steps={case.warmup_steps}")
    return {
        "batch_size": batch,
        "batch_size_arg": "max" if case.batch_size is None else case.batch_size,
        "gpu_kernel_ms_per_step": None,
        **raw,
        "prefill_steps": prefill_steps,
        "prefill_seconds": prefill_s,
        "warm_round_steps": warm_round_steps,
        "prefix_hit_tokens": engine.prefix_hit_tokens - hits,
        "kv_bytes_in_use": raw["kv_blocks_in_use"] * engine.runner.kv_bytes_per_pool_block,
        "kv_bytes_per_slot": kv_bytes_per_slot,
    }


def warm_decode_round(engine: LLMEngine, case: DecodeCase, batch: int) -> int:
    """Untimed: the same batch through one decode-time eviction interval (when the method evicts during
    decode and the case's prefill is synthetic), so that the timed batch's first round is not the process's
    first: that round loads and compiles its kernels (0.25-1.8 s on an H200, session 28), which a server pays once
    per process. Real prefill is not warmed (it would prefill the batch twice): its first round, if the prompt's
    own eviction did not already compile the same kernels, stays inside the timed window. Returns the steps run
    (0: none needed, also when the case's steps end before its first round)."""
    config = getattr(engine.method, "config", None)
    interval = getattr(config, "decode_eviction_interval", None)
    planned = (
        case.output_len if case.timed_steps is None else min(case.output_len, case.warmup_steps + case.timed_steps)
    )
    if case.prefill != "synthetic" or not interval or planned < interval:  # no round in the window: nothing to warm
        return 0
    warm = dataclasses.replace(case, output_len=interval + 2)
    ids = _add_requests(engine, warm, batch, torch.Generator().manual_seed(0))
    steps = 0
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    finally:
        for rid in ids:
            engine.abort_request(rid)
    return steps


def _time_decode(engine: LLMEngine, case: DecodeCase, desc: str, progress: bool) -> dict:
    """Step the running batch: ``warmup_steps`` untimed, then up to ``timed_steps`` timed ones.

    The timed steps run back to back, the device synchronized only before the first and after the
    last: ``wall_seconds`` over the steps is the step time (a pipelined engine overlaps a step's
    host work with the previous step's device work, which per-step synchronization would hide).
    ``step_seconds`` (each ``step()`` call alone, unsynchronized) and ``step_end_unix`` (wall-clock
    ends, to match against a GPU clock log) are diagnostics of how the time spreads; ``stalls``
    (``StallProbe``) counts the allocator's trips to the driver and the collections in the window.
    """
    remaining = case.output_len - (1 if case.prefill == "real" else 0)
    planned = remaining if case.timed_steps is None else min(remaining, case.warmup_steps + case.timed_steps)
    raw = {"step_seconds": [], "kv_slots_read": [], "tokens": [], "running": [], "step_end_unix": []}
    used_blocks, graph_steps = 0, 0
    device = engine.runner.device
    wall_start, pipelined = None, engine.num_pipelined_steps
    stalls = StallProbe(device)
    for i in tqdm(range(planned), desc=desc, leave=False, disable=not progress, unit="step"):
        if not engine.has_unfinished_requests():
            break
        if i == case.warmup_steps:
            synchronize(device)
            stalls.start()
            wall_start = time.perf_counter()
        kv_slots, n_running = _step_kv_tokens(engine)
        replays = _graph_replays(engine)
        start = time.perf_counter()
        outputs = engine.step()  # host ints of one step; a pipelined engine has the next one queued
        elapsed = time.perf_counter() - start
        if i < case.warmup_steps:
            continue
        graph_steps += _graph_replays(engine) > replays
        raw["step_seconds"].append(elapsed)
        raw["step_end_unix"].append(time.time())
        raw["kv_slots_read"].append(kv_slots)
        raw["running"].append(n_running)
        raw["tokens"].append(sum(len(o.delta_token_ids) for o in outputs))
        used_blocks = max(used_blocks, engine.kv.num_blocks - engine.num_free_blocks)  # (layer) blocks of the pool
    if wall_start is not None:
        synchronize(device)
        raw["wall_seconds"] = time.perf_counter() - wall_start
        raw["stalls"] = stalls.stop()  # allocator trips to the driver and collections in the timed window
    raw["async_scheduling"] = engine.async_scheduling
    raw["host_threads"] = torch.get_num_threads()  # torch's CPU threads while the steps ran (``host_threads``)
    raw["pipelined_steps"] = engine.num_pipelined_steps - pipelined  # warm-up included
    return {**raw, "kv_blocks_in_use": used_blocks, "cuda_graph_steps": graph_steps}


def summarize(raw: dict, weight_bytes: int, copy_bytes_per_s: float | None) -> dict:
    """Step-time and bandwidth metrics of one run from its raw timings."""
    times, slots = raw["step_seconds"], raw["kv_slots_read"]
    total = raw.get("wall_seconds") or sum(times)  # end to end where measured (HF: per step, synchronized)
    kv_bytes = statistics.fmean(slots) * raw["kv_bytes_per_slot"]
    step_bytes = weight_bytes + kv_bytes
    seconds = total / len(times)
    achieved = step_bytes / seconds
    out = {
        "steps_timed": len(times),
        "ms_per_step": 1e3 * seconds,
        "ms_per_step_median": 1e3 * statistics.median(times),
        "ms_per_step_p90": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))],
        "tokens_per_s": sum(raw["tokens"]) / total,
        "min_running": min(raw["running"]),  # requests resident before each timed step
        "max_running": max(raw["running"]),
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_step": kv_bytes,
        "bytes_per_step": step_bytes,
        "achieved_bytes_per_s": achieved,
    }
    if copy_bytes_per_s:
        out["fraction_of_copy_bw"] = achieved / copy_bytes_per_s
        out["bytes_bound_ms_per_step"] = 1e3 * step_bytes / copy_bytes_per_s
        out["overhead_ms_per_step"] = out["ms_per_step"] - out["bytes_bound_ms_per_step"]
    return out
