"""HF transformers on the same shape, batch 1, as the side-by-side baseline.

The model is built from the same config.json with random weights (bf16 on GPU, sdpa attention).
Its ``DynamicCache`` is filled with random K/V of the prompt's length instead of running prefill
("synthetic prefill": a 128K-token HF prefill would take minutes and a huge attention workspace);
then ``model(next_token, past_key_values=cache)`` decode steps are timed, greedy, as HF's own
generate loop runs them. The caller frees the memory (``free_device_memory``) before the engine
sizes its pool.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from sparse_serve.bench.probes import (
    kv_bytes_per_token,
    peak_memory,
    profile_device,
    reset_peak_memory,
    weight_bytes_per_step,
)


def _build_model(model_path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    return model.eval(), config


def _random_cache(config, prompt_len: int, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:
        cache = DynamicCache()
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
    model_path: str,
    prompt_len: int,
    *,
    steps: int,
    warmup_steps: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    profile_steps: int = 0,
) -> dict:
    """Time ``steps`` batch-1 decode steps of HF transformers after a random cache of ``prompt_len``.

    Returns the raw timings in ``decode.run_decode_case``'s layout plus the model's weight bytes.
    """
    torch.manual_seed(seed)
    model, config = _build_model(model_path, dtype, device)
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


def free_device_memory(device: torch.device) -> None:
    """Return what the baseline's model and cache held to the device (after they went out of scope)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
