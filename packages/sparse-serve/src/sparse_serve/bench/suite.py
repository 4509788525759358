"""One benchmark invocation: the copy-bandwidth probe, the HF baseline (first, then freed), then
for one engine config either the decode cases over prompt lengths x batch sizes (with real prefill
timed before each) or the end-to-end cases over prompt lengths x request counts; optionally one
profiled prefill chunk per prompt length."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import sparse_methods
from sparse_models import read_model_config
from sparse_serve.bench.decode import DecodeCase, max_batch_size, run_decode_case, summarize
from sparse_serve.bench.e2e import E2ECase, run_e2e_case, summarize_e2e
from sparse_serve.bench.hf_baseline import build_hf_model, free_device_memory, run_hf_decode, run_hf_prefill
from sparse_serve.bench.prefill import prefill_summary, profile_prefill_chunk, warm_prefill
from sparse_serve.bench.probes import copy_bandwidth, environment, kv_bytes_per_token, weight_bytes_per_step
from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.model_runner import resolve_device, resolve_dtype
from sparse_serve.tensor_parallel import launch_engine


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What to measure. ``batch_sizes`` entries of None mean ``max`` (the largest batch that fits).

    e2e : request counts of the end-to-end mode (replaces the decode cases when given).
    profile_prefill : profile one prefill chunk per prompt length (the last chunk of a prompt).
    """

    prompt_lens: tuple[int, ...]
    batch_sizes: tuple[int | None, ...]
    output_len: int
    prefill: str = "synthetic"
    warmup_steps: int = 3
    timed_steps: int | None = None
    profile_steps: int = 0
    hf_baseline: bool = False
    hf_steps: int = 20
    e2e: tuple[int, ...] = ()
    profile_prefill: bool = False
    seed: int = 0
    commit: str | None = None


def run_bench(config: EngineConfig, plan: BenchPlan, *, progress: bool = True) -> dict:
    """Run every case of ``plan`` on one engine built from ``config``; returns the report dict."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, read_model_config(config.model).torch_dtype)
    big = device.type == "cuda"
    report = {
        "environment": environment(device, plan.commit),
        "copy_bandwidth": copy_bandwidth(device) if big else copy_bandwidth(device, nbytes=32 << 20, iters=5),
        "runs": [],
    }
    copy_bps = report["copy_bandwidth"]["bytes_per_s"]
    if plan.hf_baseline:  # before the engine sizes its KV pool from the free memory
        report["runs"] += _hf_runs(config, plan, dtype, device, copy_bps, progress)
    engine = launch_engine(config)  # tensor_parallel_size > 1: rank 0 of that many processes
    if plan.prefill == "synthetic" and not plan.e2e:  # e2e prefills its prompts
        engine.runner.randomize_kv(plan.seed)
    prompts = torch.Generator().manual_seed(plan.seed)  # one stream: no two prompts share a cached prefix
    if plan.prefill == "real" or plan.e2e or plan.profile_prefill:
        warm_prefill(engine, prompts, max(plan.prompt_lens))
    if plan.profile_prefill:
        profiles = [profile_prefill_chunk(engine, n, prompts) for n in plan.prompt_lens]
        report["prefill_profiles"] = [{"sparse_method": config.sparse_method, **p} for p in profiles if p]
    if plan.e2e:
        report["runs"] += _e2e_runs(engine, plan, prompts, progress)
    else:
        report["runs"] += _decode_runs(engine, plan, prompts, copy_bps, progress)
    getattr(engine, "close", lambda: None)()  # stop the other tensor-parallel ranks, if any
    del engine
    gc.collect()
    return report


def _decode_runs(engine: LLMEngine, plan: BenchPlan, prompts: torch.Generator, copy_bps: float, progress: bool):
    settings = engine_settings(engine)
    cfg = engine.runner.model_config
    # Per GPU: rank 0's weight shard and its KV heads (every rank reads as much under tensor parallelism).
    # Routed experts count only the experts a step of the run's batch is expected to read.
    model = engine.runner.model
    heads = engine.runner.rank_config.num_key_value_heads
    slot_bytes = kv_bytes_per_token(1, heads, cfg.head_dim, engine.runner.dtype)
    if engine.runner.store.quantized:  # a slot read is its codes and scales (compressed bytes)
        slot_bytes = engine.runner.store.bytes_per_token(engine.runner.kv.k[0].element_size())
    elif engine.runner.store.latent:  # one row of latent + rope channels, not a K and a V
        slot_bytes = int(engine.runner.store.bytes_per_token(engine.runner.kv.latent[0].element_size()))
    runs = []
    for case, is_max in tqdm(_cases(engine, plan), desc=f"{engine.config.sparse_method} decode", disable=not progress):
        run = {**settings, "engine": "sparse-engine", "prefill": plan.prefill, **_case_fields(case)}
        try:
            raw = run_decode_case(engine, case, kv_bytes_per_slot=slot_bytes, prompts=prompts, progress=progress)
        except (ValueError, RuntimeError) as e:
            runs.append({**run, "error": str(e)})
            continue
        raw["batch_size_arg"] = "max" if is_max else case.batch_size
        run.update(batch_size=raw["batch_size"], batch_size_arg=raw["batch_size_arg"])
        if raw["prefill_seconds"] is not None:
            run["prefill_metrics"] = prefill_summary(cfg, case.prompt_len, raw["batch_size"], raw["prefill_seconds"])
        weight_bytes = weight_bytes_per_step(model, raw["batch_size"])
        runs.append({**run, "metrics": summarize(raw, weight_bytes, copy_bps), "raw": raw})
    return runs


def _e2e_runs(engine: LLMEngine, plan: BenchPlan, prompts: torch.Generator, progress: bool) -> list[dict]:
    settings = engine_settings(engine)
    runs = []
    for prompt_len in plan.prompt_lens:
        for n in plan.e2e:
            case = E2ECase(prompt_len, plan.output_len, n)
            run = {**settings, "engine": "sparse-engine", "mode": "e2e", "prefill": "real", "prompt_len": prompt_len}
            run.update(output_len=plan.output_len, batch_size=n, batch_size_arg=n, num_requests=n)
            try:
                raw = run_e2e_case(engine, case, prompts, progress=progress)
            except (ValueError, RuntimeError) as e:
                runs.append({**run, "error": str(e)})
                continue
            runs.append({**run, "metrics": summarize_e2e(raw, prompt_len), "raw": raw})
    return runs


def _cases(engine: LLMEngine, plan: BenchPlan) -> list[tuple[DecodeCase, bool]]:
    """Cases in plan order, ``max`` resolved per prompt length; a batch listed twice runs once."""
    cases = []
    for prompt_len in plan.prompt_lens:
        seen: dict[int, int] = {}
        for b in plan.batch_sizes:
            is_max = b is None
            if is_max:
                try:
                    b = max_batch_size(engine, prompt_len, plan.output_len, plan.prefill)
                except ValueError:
                    b = 1  # reported as the error the case raises
            if b in seen:
                if is_max:
                    cases[seen[b]] = (cases[seen[b]][0], True)
                continue
            seen[b] = len(cases)
            case = DecodeCase(
                prompt_len, b, plan.output_len, plan.prefill, plan.warmup_steps, plan.timed_steps, plan.profile_steps
            )
            cases.append((case, is_max))
    return cases


def _case_fields(case: DecodeCase) -> dict:
    return {
        "prompt_len": case.prompt_len,
        "output_len": case.output_len,
        "batch_size": case.batch_size,
        "warmup_steps": case.warmup_steps,
        "timed_steps_arg": case.timed_steps,
    }


def _hf_runs(config: EngineConfig, plan: BenchPlan, dtype, device, copy_bps: float, progress: bool) -> list[dict]:
    """HF transformers at batch 1 per prompt length: decode, and prefill when the engine's is real."""
    try:
        model, hf_config = build_hf_model(config.model, dtype, device, plan.seed)
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
        return [{**_hf_fields(plan, n, dtype), "error": f"{type(e).__name__}: {e}"[:500]} for n in plan.prompt_lens]
    cfg = read_model_config(config.model)
    runs = []
    for prompt_len in tqdm(plan.prompt_lens, desc="HF baseline", disable=not progress):
        run = _hf_fields(plan, prompt_len, dtype)
        if plan.prefill == "real":
            try:
                out = run_hf_prefill(model, hf_config, prompt_len, seed=plan.seed)
                run["prefill_metrics"] = {**prefill_summary(cfg, prompt_len, 1, out.pop("seconds")), **out}
            except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
                run["prefill_error"] = f"{type(e).__name__}: {e}"[:500]
            finally:
                free_device_memory(device)
        try:
            out = run_hf_decode(
                model,
                hf_config,
                prompt_len,
                steps=plan.hf_steps,
                warmup_steps=plan.warmup_steps,
                seed=plan.seed,
                profile_steps=plan.profile_steps,
            )
            runs.append({**run, "metrics": summarize(out["raw"], out["weight_bytes"], copy_bps), "raw": out["raw"]})
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
            runs.append({**run, "error": f"{type(e).__name__}: {e}"[:500]})
        finally:
            free_device_memory(device)
    del model
    free_device_memory(device)
    return runs


def _hf_fields(plan: BenchPlan, prompt_len: int, dtype) -> dict:
    return {
        "engine": "hf-transformers",
        "sparse_method": "dense",
        "prefill": "synthetic (random DynamicCache)",
        "prompt_len": prompt_len,
        "output_len": plan.hf_steps,
        "batch_size": 1,
        "batch_size_arg": 1,
        "dtype": str(dtype).removeprefix("torch."),
    }


def engine_settings(engine: LLMEngine) -> dict:
    """The settings that shape a run: model shape, method and budgets, prefill policy, pool, chunk."""
    config, cfg, runner = engine.config, engine.runner.model_config, engine.runner
    method_cls = sparse_methods.get_method_class(config.sparse_method)
    return {
        "model": _display_path(config.model),
        "model_shape": {
            "architecture": cfg.architecture,
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "load_format": config.load_format,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "tensor_parallel_size": config.tensor_parallel_size,  # > 1: bytes and bandwidth are per GPU
        "sparse_method": config.sparse_method,
        "prefill_sparse_method": config.prefill_sparse_method,
        "method_params": engine.method.config.model_dump(),
        "prefill_policy": str(method_cls.prefill_policy),
        "chunk_size": config.max_num_batched_tokens,
        "block_size": config.block_size,
        "num_kv_blocks": runner.num_blocks,
        "kv_bytes_per_block": runner.kv_bytes_per_block,
        "kv_store": runner.store.describe(),
        # cuDNN plans for the prefill's cached-prefix shapes, built at engine start (and the seconds they took).
        "cascade_plans": {"built": runner.cascade_plans, "seconds": round(runner.cascade_plans_s, 3)},
        "kv_cache_dtype": config.resolved_kv_cache_dtype(),
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "max_num_seqs": config.max_num_seqs,
        "enforce_eager": getattr(config, "enforce_eager", None),  # None: this engine has no CUDA graphs yet
        "async_scheduling": getattr(engine, "async_scheduling", False),  # pipelined decode steps
        "engine_config": config.model_dump(exclude_defaults=True) | {"model": _display_path(config.model)},
    }


def _display_path(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(path)
