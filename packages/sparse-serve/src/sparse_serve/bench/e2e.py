"""End to end through the engine: N requests arrive at once; wall time to the last token.

Prefill is included and the engine schedules as it would serve (chunked prefill mixed with the
decodes of requests already prefilled, its own admission and preemption): the number is what a
user waits for a batch of long prompts. Times are taken when the host holds each step's tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from sparse_serve.bench.prefill import random_prompt, synchronize
from sparse_serve.bench.probes import peak_memory, reset_peak_memory
from sparse_serve.engine import LLMEngine
from sparse_serve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class E2ECase:
    """``num_requests`` prompts of ``prompt_len`` random tokens, each generating ``output_len``."""

    prompt_len: int
    output_len: int
    num_requests: int


def run_e2e_case(engine: LLMEngine, case: E2ECase, prompts: torch.Generator, *, progress: bool = True) -> dict:
    """Add every request at once on an idle engine and step until all finish; raw per-request times.

    ``ttft_s`` / ``finish_s``: seconds from the arrival to each request's first / last token.
    """
    params = SamplingParams(max_tokens=case.output_len, temperature=0.0, ignore_eos=True)
    batch = [random_prompt(engine, case.prompt_len, prompts) for _ in range(case.num_requests)]
    device = engine.runner.device
    preemptions, steps = engine.scheduler.num_preemptions, 0
    reset_peak_memory(device)
    synchronize(device)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in batch]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens = dict.fromkeys(ids, 0)
    bar = tqdm(total=case.num_requests * case.output_len, desc="e2e", leave=False, disable=not progress, unit="tok")
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter() - start
            steps += 1
            for out in outputs:
                if out.delta_token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
                    tokens[out.request_id] += len(out.delta_token_ids)
                    bar.update(len(out.delta_token_ids))
    finally:
        bar.close()
        for rid in ids:
            engine.abort_request(rid)
    if len(first) < len(ids):
        raise RuntimeError(f"{len(ids) - len(first)} of {len(ids)} requests produced no token")
    return {
        "ttft_s": [first[rid] for rid in ids],
        "finish_s": [last[rid] for rid in ids],
        "output_tokens": [tokens[rid] for rid in ids],
        "wall_seconds": max(last.values()),
        "steps": steps,
        "preemptions": engine.scheduler.num_preemptions - preemptions,
        "peak_memory_bytes": peak_memory(device),
    }


def summarize_e2e(raw: dict, prompt_len: int) -> dict:
    """Wall time, throughput and time-to-first-token statistics of one end-to-end run."""
    wall, ttft = raw["wall_seconds"], sorted(raw["ttft_s"])
    out_tokens = sum(raw["output_tokens"])
    spans = zip(raw["ttft_s"], raw["finish_s"], raw["output_tokens"], strict=True)
    decode = [(end - first) / (n - 1) for first, end, n in spans if n > 1]
    return {
        "wall_seconds": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + prompt_len * len(ttft)) / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_max_s": ttft[-1],
        "mean_itl_ms": 1e3 * statistics.fmean(decode) if decode else None,
    }
