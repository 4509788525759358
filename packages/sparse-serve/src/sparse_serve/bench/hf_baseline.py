"""HF transformers on the same shape, batch 1, as the side-by-side baseline.

The model is built from the same config.json with random weights (bf16 on GPU, sdpa attention).
Decode: its ``DynamicCache`` is filled with random K/V of the prompt's length instead of running
prefill ("synthetic prefill"); then ``model(next_token, past_key_values=cache)`` decode steps are
timed, greedy, as HF's own generate loop runs them. Prefill: one forward of the whole random prompt
into a fresh ``DynamicCache`` with ``logits_to_keep=1`` (HF computes the last row's logits only, as
generate does), device synchronized around it, after one warm-up forward of a short prompt. The
caller frees the memory (``free_device_memory``) before the engine sizes its pool.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from sparse_serve.bench.prefill import synchronize
from sparse_serve.bench.probes import (
    kv_bytes_per_token,
    peak_memory,
    profile_device,
    reset_peak_memory,
    weight_bytes_per_step,
)


def build_hf_model(model_path: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(model, HF config) with random weights, in eval mode, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_path)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    return model.eval(), config


def _new_cache(config):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()


def _random_cache(config, prompt_len: int, dtype: torch.dtype, device: torch.device, seed: int):
    cache = _new_cache(config)
    g = torch.Generator(device).manual_seed(seed)
    shape = (1, config.num_key_value_heads, prompt_len, _head_dim(config))
    for layer in range(config.num_hidden_layers):
        k = torch.randn(shape, generator=g, dtype=dtype, device=device)
        v = torch.randn(shape, generator=g, dtype=dtype, device=device)
        cache.update(k, v, layer)
    return cache


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@torch.inference_mode()
def run_hf_decode(
    model,
    config,
    prompt_len: int,
    *,
    steps: int,
    warmup_steps: int,
    seed: int = 0,
    profile_steps: int = 0,
) -> dict:
    """Time ``steps`` batch-1 decode steps of HF ``model`` (``build_hf_model``) after a random cache
    of ``prompt_len``.

    Returns the raw timings in ``decode.run_decode_case``'s layout plus the model's weight bytes.
    """
    dtype, device = model.dtype, model.device
    weight_bytes = weight_bytes_per_step(model)
    slot_bytes = kv_bytes_per_token(1, config.num_key_value_heads, _head_dim(config), dtype)
    reset_peak_memory(device)
    cache = _random_cache(config, prompt_len, dtype, device, seed)
    state = {"token": torch.randint(0, config.vocab_size, (1, 1), device=device)}

    def step() -> None:  # HF's generate loop, greedy: forward one token, pick the next
        logits = model(input_ids=state["token"], past_key_values=cache, use_cache=True).logits
        state["token"] = logits[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, slots = [], []
    for i in range(warmup_steps + steps):
        kv_len = cache.get_seq_length()
        start = time.perf_counter()
        step()
        if i >= warmup_steps:
            times.append(time.perf_counter() - start)
            slots.append((kv_len + 1) * config.num_hidden_layers)
    profiled = profile_device(step, profile_steps) if profile_steps and device.type == "cuda" else {}
    peak = peak_memory(device)
    import transformers

    raw = {
        "batch_size": 1,
        "batch_size_arg": 1,
        "step_seconds": times,
        "kv_slots_read": slots,
        "tokens": [1] * len(times),
        "running": [1] * len(times),
        "prefill_steps": 0,
        "prefill_seconds": None,
        "kv_bytes_per_slot": slot_bytes,
        "peak_memory_bytes": peak,
        "gpu_kernel_ms_per_step": None,
        **profiled,
        "hf": {
            "transformers": transformers.__version__,
            "attn_implementation": model.config._attn_implementation,
            "cache": type(cache).__name__,
            "median_step_ms": 1e3 * statistics.median(times),
        },
    }
    return {"raw": raw, "weight_bytes": weight_bytes}


@torch.inference_mode()
def run_hf_prefill(model, config, prompt_len: int, *, seed: int = 0, warmup_len: int = 512) -> dict:
    """Time one batch-1 prefill of a random ``prompt_len``-token prompt through HF ``model``.

    Returns ``{"seconds", "peak_memory_bytes", "warmup_len"}``; the warm-up forward (``warmup_len``
    tokens) is not timed.
    """
    device = model.device
    g = torch.Generator().manual_seed(seed)

    def prefill(n: int) -> float:
        ids = torch.randint(0, config.vocab_size, (1, n), generator=g).to(device)
        cache = _new_cache(config)
        synchronize(device)
        start = time.perf_counter()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        synchronize(device)
        seconds = time.perf_counter() - start
        if logits.shape[1] != 1:
            raise RuntimeError(f"HF computed {logits.shape[1]} rows of logits, not the last one only")
        return seconds

    warmup = min(warmup_len, prompt_len)
    prefill(warmup)
    reset_peak_memory(device)
    seconds = prefill(prompt_len)
    return {"seconds": seconds, "peak_memory_bytes": peak_memory(device), "warmup_len": warmup}


def free_device_memory(device: torch.device) -> None:
    """Return what the baseline's model and cache held to the device (after they went out of scope)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
