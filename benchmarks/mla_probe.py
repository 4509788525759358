"""MLA latent attention on the GPU at the GLM-4.7-Flash shape: kernel bandwidth, old vs new launch, and
the engine's decode step eager vs CUDA graphs.

GLM-4.7-Flash (Glm4MoeLite): 20 query heads, kv_lora_rank 512, qk_rope_head_dim 64, so each cached
row is 576 bf16 channels (1152 bytes per token and layer) and the softmax scale is (192 + 64) ** -0.5.

1. Decode kernel, contexts 32K and 128K at batch 1 / 8 / 32, each timed inside a CUDA graph (as the
   engine replays it), two launches side by side: ``old`` (the first kernel's launch settings:
   ``FIRST_TILES`` with its context-dependent split count, every split used; today's kernel code,
   so the page-id prefetch and the column-parallel merge are in both: the first kernel's own times
   for batch 1 x 128K and batch 8 x 32K are in results/bench/h200/prefill/kernels/mla_probe.json)
   and ``new`` (``BatchLatentDecode`` as the engine runs it: CSR in fixed buffers,
   ``LATENT_TILES["decode"]``, splits from the batch size with each request using those its length
   fills). Reported: ms, GB/s of latent rows read and % of the
   device's copy bandwidth (a 2 GiB device-to-device copy, read + write bytes), and the max error
   against the reference where the case is small enough to check. ``--sweep`` also times every
   launch setting of ``SWEEP`` on the new path and prints the one with the best geometric mean.
2. Prefill over a cached prefix: TFLOP/s of the absorbed form (2 * H * (576 + 512) flops per pair).
3. Engine decode steps on a few-layer GLM-4.7-Flash-shaped model (dummy bf16 weights, synthetic
   prefill): ms per step with ``enforce_eager`` and with CUDA graphs, batch 1 and 8 at 32K
   (``--skip-engine`` leaves this out).

Usage (one H200; a few minutes, more with the sweep)::

    uv run python benchmarks/mla_probe.py --sweep --out results/mla_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/sparse-kernels/benchmarks"))
from _timing import capture, copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels.latent_attention import (  # noqa: E402
    LATENT_TILES,
    latent_attention,
    latent_attention_reference,
    plan_latent,
)
from sparse_kernels.latent_decode import BatchLatentDecode  # noqa: E402

HEADS, LATENT, ROPE, BLOCK = 20, 512, 64, 16
ROW_BYTES = (LATENT + ROPE) * 2
SCALE = (192 + 64) ** -0.5
FIRST_TILES = {"block_n": 32, "num_warps": 8, "num_stages": 3}  # the first kernel, measured at 6-28% of copy BW
DECODE_CASES = [(batch, kv_len) for kv_len in (32768, 131072) for batch in (1, 8, 32)]
SWEEP = [  # 24 compiled variants (block_m: 64 pads the 20 heads further but lets Hopper's wgmma run)
    dict(block_m=m, block_n=n, num_warps=w, num_stages=st, programs_per_sm=p)
    for m in (32, 64)
    for n in (16, 32, 64)
    for w in (4, 8)
    for st in (2, 3)
    for p in (2, 4, 8)
]


def _case(batch: int, kv_len: int, q_len: int, seed: int = 0):
    """A shuffled pool with ``batch`` requests of ``kv_len`` keys each, the last ``q_len`` of them new:
    ``(q, cache, (qo_indptr, kv_indptr, kv_indices, kv_last_len))`` with host int32 CSR."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-kv_len // BLOCK)
    num_blocks = batch * pages
    cache = torch.randn(num_blocks, BLOCK, 1, LATENT + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)
    indices = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32).cpu()
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), kv_len - (pages - 1) * BLOCK, dtype=torch.int32)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, HEADS, LATENT + ROPE, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, cache, (qo_indptr, kv_indptr, indices, last)


def _plan(csr, **kwargs):
    shape = dict(num_heads=HEADS, latent_dim=LATENT, rope_dim=ROPE, block_size=BLOCK, sm_scale=SCALE)
    return plan_latent(*csr, device="cuda", **shape, **kwargs)


def _old_plan(csr, batch: int, kv_len: int):
    """The first kernel's launch: its tiles, and splits from the context (~2 programs per SM, none
    under 256 keys), every one of them used."""
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    splits = max(1, min(-(-2 * sms // batch), -(-kv_len // 256)))
    return _plan(csr, tiles={**FIRST_TILES, "min_split_keys": 1}, num_splits=splits)


def _new_plan(csr, batch: int, tiles=None):
    """The engine's launch: ``BatchLatentDecode`` over fixed buffers (``tiles`` overriding the defaults)."""
    wrapper = BatchLatentDecode(
        "cuda", num_heads=HEADS, latent_dim=LATENT, rope_dim=ROPE, block_size=BLOCK,
        max_batch_size=batch, max_num_pages=int(csr[1][-1]),
    )  # fmt: skip
    return wrapper.plan(*csr[1:], sm_scale=SCALE, tiles=tiles)


def _graph_ms(q, cache, plan) -> float:
    out = q.new_empty(q.shape[0], HEADS, LATENT)
    graph = capture(lambda: latent_attention(q, cache, plan, out=out))
    return median_ms(graph.replay)


def _bandwidth(batch: int, kv_len: int, ms: float, copy_bw: float) -> dict:
    gbs = batch * kv_len * ROW_BYTES / (ms * 1e-3) / 1e9
    return {"ms": ms, "gb_s": gbs, "pct_copy_bw": 100 * gbs * 1e9 / copy_bw}


def _max_err(q, cache, plan) -> float:
    got = latent_attention(q, cache, plan, backend="triton").float()
    return float((got - latent_attention_reference(q, cache, plan).float()).abs().max())


def decode_rows(copy_bw: float, sweep: bool) -> list[dict]:
    rows = []
    for batch, kv_len in DECODE_CASES:
        q, cache, csr = _case(batch, kv_len, 1)
        old, new = _old_plan(csr, batch, kv_len), _new_plan(csr, batch)
        row = dict(kind="decode", batch=batch, kv_len=kv_len, old_splits=old.num_splits, new_splits=new.num_splits,
                   new_tiles=LATENT_TILES["decode"],
                   max_abs_err=_max_err(q, cache, new) if batch * kv_len <= 2**18 else None,
                   old=_bandwidth(batch, kv_len, _graph_ms(q, cache, old), copy_bw),
                   new=_bandwidth(batch, kv_len, _graph_ms(q, cache, new), copy_bw))  # fmt: skip
        row["speedup"] = row["old"]["ms"] / row["new"]["ms"]
        if sweep:
            row["sweep"] = _sweep(q, cache, csr, batch, kv_len, copy_bw)
        print(
            f"decode B={batch:>2} L={kv_len:>6}: old {row['old']['gb_s']:7.0f} GB/s ({row['old']['pct_copy_bw']:4.1f}%)"
            f"  new {row['new']['gb_s']:7.0f} GB/s ({row['new']['pct_copy_bw']:4.1f}%)  x{row['speedup']:.2f}"
        )
        rows.append(row)
        del q, cache
    return rows


def _sweep(q, cache, csr, batch: int, kv_len: int, copy_bw: float) -> list[dict]:
    results = []
    for tiles in SWEEP:
        try:
            ms = _graph_ms(q, cache, _new_plan(csr, batch, tiles))
        except Exception as e:  # a shape that does not fit (shared memory, registers) is a result too
            results.append(dict(tiles=tiles, error=str(e).splitlines()[0][:120]))
            continue
        results.append(dict(tiles=tiles, **_bandwidth(batch, kv_len, ms, copy_bw)))
    return results


def best_tiles(rows: list[dict]) -> dict:
    """The launch setting with the lowest geometric-mean time over the decode cases."""
    scores: dict[str, list[float]] = {}
    for row in rows:
        for r in row["sweep"]:
            scores.setdefault(json.dumps(r["tiles"]), []).append(math.log(r["ms"]) if "ms" in r else math.inf)
    key = min(scores, key=lambda k: sum(scores[k]))
    return {**json.loads(key), "geomean_ms": math.exp(sum(scores[key]) / len(scores[key]))}


def prefill_rows() -> list[dict]:
    rows = []
    for batch, kv_len, q_len in [(1, 4096, 4096), (1, 16384, 2048), (4, 8192, 512)]:
        q, cache, csr = _case(batch, kv_len, q_len)
        plan = _plan(csr)
        err = _max_err(q, cache, plan) if q_len * kv_len <= 2**23 else None
        ms = median_ms(lambda q=q, cache=cache, plan=plan: latent_attention(q, cache, plan, backend="triton"), iters=5)
        pairs = batch * (q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2)  # causal
        flops = 2 * HEADS * (LATENT + ROPE + LATENT) * pairs
        rows.append(dict(kind="prefill", batch=batch, kv_len=kv_len, q_len=q_len, ms=ms, max_abs_err=err,
                         tflop_s=flops / ms / 1e9))  # fmt: skip
        print(json.dumps(rows[-1]))
    return rows


def _glm_folder(num_layers: int) -> str:
    """GLM-4.7-Flash's config cut to ``num_layers`` layers (layer 0 dense, the rest routed experts)."""
    src = ROOT / "packages/sparse-serve/src/sparse_serve/bench/configs/glm-4.7-flash/config.json"
    cfg = {**json.loads(src.read_text()), "num_hidden_layers": num_layers}
    folder = Path(tempfile.mkdtemp(prefix="mla_probe_"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def engine_step_ms(
    folder: str, batch: int, kv_len: int, eager: bool, steps: int = 30, warmup: int = 5, device: str = "cuda"
) -> dict:
    """ms per decode step of ``batch`` synthetic requests of ``kv_len`` tokens, steps back to back
    (``device="cpu"``: a smoke run of the same path)."""
    from sparse_serve.config import EngineConfig
    from sparse_serve.engine import LLMEngine
    from sparse_serve.sampling_params import SamplingParams

    max_len = kv_len + steps + warmup + 16
    config = EngineConfig(
        model=folder, load_format="dummy", device=device, dtype="bfloat16", block_size=BLOCK, enforce_eager=eager,
        max_num_seqs=batch, max_cuda_graph_batch_size=batch, max_model_len=max_len,
        num_kv_blocks=batch * -(-max_len // BLOCK) + 8,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.runner.randomize_kv()
    params = SamplingParams(max_tokens=steps + warmup + 4, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_synthetic_request(kv_len, params)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    for _ in range(warmup):
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms = (time.perf_counter() - start) / steps * 1e3
    graphs = engine.runner.graphs
    replays = 0 if graphs is None else graphs.num_replays
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"ms_per_step": ms, "graph_replays": replays}


def engine_rows(num_layers: int) -> list[dict]:
    folder, rows = _glm_folder(num_layers), []
    for batch in (1, 8):
        eager = engine_step_ms(folder, batch, 32768, eager=True)
        graphs = engine_step_ms(folder, batch, 32768, eager=False)
        row = dict(kind="engine_decode", layers=num_layers, batch=batch, kv_len=32768, eager=eager, graphs=graphs,
                   speedup=eager["ms_per_step"] / graphs["ms_per_step"])  # fmt: skip
        print(
            f"engine {num_layers} layers B={batch} L=32768: eager {eager['ms_per_step']:.2f} ms/step, "
            f"graphs {graphs['ms_per_step']:.2f} ms/step ({graphs['graph_replays']} replays), x{row['speedup']:.2f}"
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows (printed anyway)")
    parser.add_argument("--sweep", action="store_true", help="time every decode launch setting of SWEEP")
    parser.add_argument("--skip-engine", action="store_true", help="leave out the engine's decode steps")
    parser.add_argument("--engine-layers", type=int, default=4, help="layers of the GLM-shaped engine model")
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rows = decode_rows(copy_bw, args.sweep)
    report = {"device": torch.cuda.get_device_name(), "copy_bw": copy_bw, "first_tiles": FIRST_TILES}
    if args.sweep:
        report["best_decode_tiles"] = best_tiles(rows)
        print("best decode launch (geometric mean of ms over the cases):", json.dumps(report["best_decode_tiles"]))
    rows += prefill_rows()
    if not args.skip_engine:
        rows += engine_rows(args.engine_layers)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**report, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
