"""Prefill through the engine: time a batch's prompts, warm the kernels, profile one chunk.

The timed prefill runs from the step of the batch's first chunk to the end of the step of its last
(device synchronized at both ends), with decodes held meanwhile (``Scheduler.hold_decodes``), so it
is prefill work only. Its FLOPs are counted from the model's shape (``flops.prefill_flops``).
"""

from __future__ import annotations

import time

import torch

from sparse_methods import PrefillPolicy
from sparse_models import ModelConfig
from sparse_serve.bench.flops import prefill_flops
from sparse_serve.bench.probes import profile_events
from sparse_serve.engine import LLMEngine
from sparse_serve.sampling_params import SamplingParams


def prefill_done(engine: LLMEngine) -> bool:
    sched = engine.scheduler
    return not sched.waiting and all(r.num_computed_tokens >= r.prefill_len and not r.replaying for r in sched.running)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_prefill(engine: LLMEngine) -> tuple[float, int]:
    """Step until every added request's prompt is done; (seconds, steps), device synchronized."""
    synchronize(engine.runner.device)
    start, steps = time.perf_counter(), 0
    while not prefill_done(engine):
        engine.step()
        steps += 1
    synchronize(engine.runner.device)
    return time.perf_counter() - start, steps


def prefill_summary(cfg: ModelConfig, prompt_len: int, batch: int, seconds: float) -> dict:
    """Prefill metrics of ``batch`` prompts of ``prompt_len`` tokens done in ``seconds`` (FLOPs None
    where the model's are not counted)."""
    out = {"seconds": seconds, "tokens": batch * prompt_len, "tokens_per_s": batch * prompt_len / seconds}
    try:
        flops = prefill_flops(cfg, prompt_len)
    except NotImplementedError:
        return {**out, "flops": None, "attention_flops": None, "tflops_per_s": None}
    total = batch * flops.total
    return {**out, "flops": total, "attention_flops": batch * flops.attention, "tflops_per_s": total / seconds / 1e12}


def random_prompt(engine: LLMEngine, num_tokens: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, engine.runner.model_config.vocab_size, (num_tokens,), generator=generator).tolist()


def warm_prefill(engine: LLMEngine, prompts: torch.Generator, max_len: int) -> None:
    """Run one short request to its end (a full chunk, a full chunk after a cached prefix, a partial one,
    one decode; at most ``max_len`` prompt tokens): the kernels' first-call compilation stays out of the
    timed prefills (each of the cascade's paths: a causal square alone, a square and a prefix merged into
    the output, a prefix merged with the paged kernel's rest)."""
    chunk = engine.config.max_num_batched_tokens
    n = max(2, min(2 * chunk + chunk // 2 + 1, max_len, engine.max_model_len - 3))
    prompt = random_prompt(engine, n, prompts)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.abort_request(rid)


def profile_prefill_chunk(engine: LLMEngine, prompt_len: int, prompts: torch.Generator) -> dict:
    """Prefill one request of ``prompt_len`` tokens, its last chunk (the costliest: after the whole
    cached prefix; the whole prompt where the method prefills it in one pass) under the profiler;
    device kernels by time (CPU operators on a CPU engine).

    Needs an idle engine; the request is aborted afterwards. Empty when the profiler fails.
    """
    rid = engine.add_request(random_prompt(engine, prompt_len, prompts), SamplingParams(max_tokens=1))
    (req,) = (r for r in engine.scheduler.waiting if r.request_id == rid)
    budget = engine.config.max_num_batched_tokens
    whole = engine.method.prefill_policy is PrefillPolicy.LONG_BS1FULL_SHORT_BATCH
    try:
        while not whole and req.num_tokens - req.num_computed_tokens > budget:
            engine.step()
        prefix_len = req.num_computed_tokens
        cuda = engine.runner.device.type == "cuda"
        synchronize(engine.runner.device)
        start = time.perf_counter()
        out = profile_events(engine.step, 1, cuda=cuda)
        synchronize(engine.runner.device)
        seconds = time.perf_counter() - start
    finally:
        engine.abort_request(rid)
    if not out:
        return {}
    chunk = prompt_len - prefix_len
    return {
        "prompt_len": prompt_len,
        "chunk_tokens": chunk,
        "prefix_len": prefix_len,
        "device": "cuda" if cuda else "cpu",
        "step_ms_profiled": 1e3 * seconds,
        "busy_ms": out["busy_ms_per_step"],
        "flops": _chunk_flops(engine.runner.model_config, chunk, prefix_len),
        "top": out["top"],
    }


def _chunk_flops(cfg: ModelConfig, chunk: int, prefix_len: int) -> int | None:
    try:
        return prefill_flops(cfg, chunk, prefix_len).total
    except NotImplementedError:
        return None
