"""Quantized split-K decode bandwidth (fp8, KIVI, TurboQuant) against bf16 and a device copy (GPU only).

Shape: one Qwen3-8B-like attention layer (32 query heads, 8 KV heads, head_dim 128), KV length 131072
(128K) per request, batch 1, 4 and 16, blocks of 32 tokens (KIVI's page) in shuffled order, random
codes and scales. Each timing replays a CUDA graph of the decode over enough layer pools that their
bytes exceed the 60 MB L2 several times. Achieved bandwidth = compressed bytes read per layer (codes +
scales and statistics of the listed blocks; bf16: K and V) / time per layer, against the copy bandwidth
(bytes read + written by a 2 GiB ``copy_``) measured in the same run.

First the default config of every scheme and batch (the table), each checked against the reference
backend at batch 1; then, while ``--budget`` seconds last, a sweep of launch configs per scheme (each
variant's output checked against the default's). Every row is printed as JSON as it is measured and
appended to ``--jsonl`` (so a run cut short keeps what it measured).

Usage: ``python packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py [--budget S] [--jsonl PATH]``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _timing import capture, copy_bandwidth, median_ms  # benchmarks/ (run as scripts)

import sparse_kernels._decode_buffers as buffers
from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_kernels._triton import quantized_decode_launch as qlaunch
from sparse_kernels.kv_quant import allocate_quantized_kv

HQ, HKV, DIM, BLOCK, KV_LEN = 32, 8, 128, 32, 131072
SCHEMES = [("bf16", 16), ("fp8", 8), ("kivi", 4), ("kivi", 2), ("turboquant", 4), ("turboquant", 3), ("turboquant", 2)]
L2_BYTES = 60 * 2**20
DEVICE = "cuda"


def random_layer(scheme: str, bits: int, num_blocks: int, gen: torch.Generator):
    """One layer's pool with random content: bf16 ``(k, v)``, or a ``QuantizedKV``."""
    if scheme == "bf16":
        shape = (num_blocks, BLOCK, HKV, DIM)
        return tuple(torch.randn(shape, device=DEVICE, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    kv = allocate_quantized_kv(scheme, bits, num_blocks, BLOCK, HKV, DIM, torch.bfloat16, DEVICE, num_tails=16)
    for t in (kv.k, kv.v):
        if t.dtype == torch.int32:
            t.random_(-(2**31), 2**31 - 1, generator=gen)
        else:  # e4m3 codes of unit-scale data
            t.copy_((torch.randn(t.shape, device=DEVICE, generator=gen) * 32).clamp(-448, 448).to(t.dtype))
    for t in (kv.k_scale, kv.v_scale, kv.k_min, kv.v_min):
        if t is not None:
            t.copy_(torch.rand(t.shape, device=DEVICE, generator=gen).to(t.dtype) * 0.1 + 0.01)
    for t in (kv.k_min, kv.v_min):
        if t is not None:
            t.sub_(0.3)
    return kv


def bytes_per_block(layer) -> int:
    """Bytes decode reads per listed block: K and V (bf16), or codes + per-block scales/statistics."""
    if isinstance(layer, tuple):
        return 2 * layer[0][0].numel() * 2
    names = ("k", "v", "k_scale", "v_scale", "k_min", "v_min")
    tensors = [getattr(layer, n) for n in names if getattr(layer, n) is not None]
    return sum(t[0].numel() * t.element_size() for t in tensors)


def make_step(scheme: str, bits: int, batch: int, seed: int = 0, num_layers: int | None = None, shuffled: bool = True):
    """``(layer pools, CSR table, q, bytes per layer)``: ``num_layers`` pools (default: enough to exceed the L2
    several times, at most 8), each request's blocks shuffled over the pool or in order."""
    blocks_per_req = KV_LEN // BLOCK
    num_blocks = batch * blocks_per_req + 7
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    first = random_layer(scheme, bits, num_blocks, gen)
    layer_bytes = bytes_per_block(first) * batch * blocks_per_req
    if num_layers is None:
        num_layers = max(1, min(8, -(-4 * L2_BYTES // layer_bytes)))
    layers = [first] + [random_layer(scheme, bits, num_blocks, gen) for _ in range(num_layers - 1)]
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)) if shuffled else None
    perm = (torch.arange(num_blocks) if order is None else order)[: batch * blocks_per_req]
    csr = (
        torch.arange(0, batch * blocks_per_req + 1, blocks_per_req, dtype=torch.int32),
        perm.to(torch.int32),
        torch.full((batch,), BLOCK, dtype=torch.int32),
    )
    q = torch.randn(batch, HQ, DIM, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return layers, csr, q, layer_bytes


def time_decode(layers, csr, q, backend: str = "triton"):
    """(ms per layer of graph replays, the first layer's output, splits)."""
    wrapper = BatchDecodeWithPagedKVCache(DEVICE, backend=backend, max_batch_size=q.shape[0])
    wrapper.plan(*csr, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=DIM, block_size=BLOCK)
    outs = [torch.empty_like(q) for _ in layers]

    def step():
        for layer, out in zip(layers, outs, strict=True):
            if isinstance(layer, tuple):
                wrapper.run(q, *layer, out=out)
            else:
                wrapper.run_quantized(q, layer, out=out)

    if backend != "triton":
        step()
        return None, outs[0].clone(), 0
    graph = capture(step)
    ms = median_ms(graph.replay) / len(layers)
    splits = wrapper._num_splits
    if not isinstance(layers[0], tuple):  # the quantized launch's own count (KIVI's one-warp programs: more)
        config = qlaunch.decode_config(layers[0])
        per_sm = config.get("warps_per_sm", {}).get(layers[0].scheme)
        splits = wrapper._buffers.num_splits(q.shape[0], HKV, True, config["num_warps"], per_sm)
    return ms, outs[0].clone(), splits


def variants(scheme: str, bits: int) -> list[dict]:
    """Launch configs to sweep after the defaults, the likeliest first (keys absent keep the default)."""
    if scheme == "bf16":
        return []
    if scheme == "kivi":
        configs = [dict(GROUPED=False), dict(maxnreg=168), dict(maxnreg=128), dict(num_stages=2)]
        configs += [dict(maxnreg=128, per_sm=16), dict(maxnreg=96), dict(GROUPED=False, maxnreg=168)]
        configs += [dict(maxnreg=168, num_stages=2), dict(PAIRS=False), dict(SWAP_AB=False, num_stages=2)]
    else:
        configs = [dict(BLOCK_N=16), dict(maxnreg=128), dict(num_stages=2), dict(num_stages=4), dict(per_sm=48)]
        configs += [dict(SWAP_AB=False), dict(BLOCK_N=64, num_warps=2)]
        configs += [dict(BLOCK_N=128, num_warps=4)]
        if bits in (2, 4):
            configs[1:1] = [dict(UNPACK_WORDS=False)]
        configs += [dict(BLOCK_N=64, num_warps=1)]
    many = [dict(many=16), dict(many=24), dict(many=48), dict(many=64)]  # programs per SM with >= SMs lists
    return many + configs + [dict(per_sm=16), dict(per_sm=64)]  # resident warps per SM (default 32)


def apply(cfg: dict, scheme: str) -> None:
    target = qlaunch.KIVI_DECODE_CONFIG if scheme == "kivi" else qlaunch.QUANT_DECODE_CONFIG
    for key in ("BLOCK_N", "num_warps", "num_stages", "SWAP_AB", "PAIRS", "GROUPED", "maxnreg"):
        if key in cfg:
            target[key] = cfg[key]
    if "UNPACK_WORDS" in cfg:
        qlaunch.QUANT_DECODE_CONFIG["UNPACK_WORDS"] = cfg["UNPACK_WORDS"]
    if "many" in cfg:  # programs per SM once the lists alone cover every SM
        buffers.PROGRAMS_PER_SM_MANY_LISTS = cfg["many"]
    if "per_sm" in cfg:
        buffers.QUANTIZED_WARPS_PER_SM = cfg["per_sm"]  # resident warps per SM the split aims at
        target["warps_per_sm"] = {}  # (no scheme's own target over it)


def main() -> None:
    global BLOCK
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the whole run (sweep stops)")
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--schemes", default=None, help="e.g. bf16:16,kivi:4,kivi:2 (default: all)")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes: checks the script runs")
    parser.add_argument("--block-size", type=int, default=BLOCK, help="tokens a page (the engine: 16; KIVI's 32)")
    args = parser.parse_args()
    BLOCK = args.block_size
    if args.smoke:
        smoke()
    started = time.time()
    sink = open(args.jsonl, "a") if args.jsonl else None  # noqa: SIM115

    def emit(row):
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth() if DEVICE == "cuda" else 1e12
    emit({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "copy_tb_s": copy_bw / 1e12})
    launch_tables = (qlaunch.QUANT_DECODE_CONFIG, qlaunch.KIVI_DECODE_CONFIG)
    defaults = [dict(c) for c in launch_tables], buffers.QUANTIZED_WARPS_PER_SM, buffers.PROGRAMS_PER_SM_MANY_LISTS

    def restore():
        for config, default in zip(launch_tables, defaults[0], strict=True):
            config.clear()
            config.update(default)
        buffers.QUANTIZED_WARPS_PER_SM = defaults[1]
        buffers.PROGRAMS_PER_SM_MANY_LISTS = defaults[2]

    table, sweep_jobs, sweep_rows = [], [], []
    for batch in [int(b) for b in args.batches.split(",")]:
        for scheme, bits in SCHEMES:
            if args.schemes and f"{scheme}:{bits}" not in args.schemes.split(","):
                continue
            layers, csr, q, layer_bytes = make_step(scheme, bits, batch)
            restore()
            ms, out, splits = time_decode(layers, csr, q)
            row = dict(scheme=scheme, bits=bits, batch=batch, layers=len(layers), config="default", splits=splits)
            row.update(us=ms * 1e3, mb=layer_bytes / 1e6, tb_s=layer_bytes / (ms * 1e-3) / 1e12)
            row["frac_copy"] = layer_bytes / (ms * 1e-3) / copy_bw
            if batch == 1:
                _, expected, _ = time_decode(layers[:1], csr, q, backend="reference")
                row["max_diff_vs_reference"] = (out.float() - expected.float()).abs().max().item()
            emit(row)
            table.append(row)
            sweep_rows.append(dict(row, config={}))
            if batch in (1, max(int(b) for b in args.batches.split(","))):
                sweep_jobs.append((scheme, bits, batch))
            del layers
            torch.cuda.empty_cache()
    # Sweep, round-robin over the schemes so each gets its likeliest configs: batch 16 (where bandwidth,
    # not fixed cost, decides), then batch 1.
    for batch in sorted({job[2] for job in sweep_jobs}, reverse=True):
        jobs = [job for job in sweep_jobs if job[2] == batch and variants(job[0], job[1])]
        if time.time() - started > args.budget:
            break
        steps = {}
        for scheme, bits, _ in jobs:
            restore()
            layers, csr, q, layer_bytes = make_step(scheme, bits, batch)
            steps[(scheme, bits)] = (layers, csr, q, layer_bytes, time_decode(layers, csr, q)[1])
        for i in range(max(len(variants(s, b)) for s, b, _ in jobs)):
            for (scheme, bits), (layers, csr, q, layer_bytes, base) in steps.items():
                configs = variants(scheme, bits)
                if i >= len(configs) or time.time() - started > args.budget:
                    continue
                cfg = configs[i]
                restore()
                apply(cfg, scheme)
                try:
                    ms, out, splits = time_decode(layers, csr, q)
                except Exception as exc:  # a config that does not compile or fit is skipped, and said
                    emit(dict(scheme=scheme, bits=bits, batch=batch, config=cfg, error=repr(exc)[:200]))
                    continue
                row = dict(scheme=scheme, bits=bits, batch=batch, config=cfg, splits=splits, us=ms * 1e3)
                row["frac_copy"] = layer_bytes / (ms * 1e-3) / copy_bw
                row["max_diff"] = (out.float() - base.float()).abs().max().item()
                emit(row)
                sweep_rows.append(row)
        del steps
        torch.cuda.empty_cache()
    restore()
    print("\nbest of the sweep (config: changes from the default)")
    for key in sorted({(r["scheme"], r["bits"], r["batch"]) for r in sweep_rows}):
        rows = [r for r in sweep_rows if (r["scheme"], r["bits"], r["batch"]) == key]
        best = max(rows, key=lambda r: r["frac_copy"])
        print(f"{key[0]:11s} {key[1]:4d} {key[2]:5d} {best['frac_copy']:8.1%} {best['us']:8.1f} us  {best['config']}")
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; default configs, CUDA-graph replay, KV length {KV_LEN}")
    print("scheme      bits batch splits      us   MB/layer   TB/s  of_copy")
    for r in table:
        print(
            f"{r['scheme']:11s} {r['bits']:4d} {r['batch']:5d} {r['splits']:6d} {r['us']:7.1f} {r['mb']:10.1f} "
            f"{r['tb_s']:6.2f} {r['frac_copy']:8.1%}"
        )


def smoke() -> None:
    """Run every code path of the script on the CPU at a toy size (no timing meaning)."""
    global DEVICE, KV_LEN, HQ, HKV, DIM, capture, median_ms, SCHEMES

    def fake_median(fn, iters=1, reps=1):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    DEVICE, KV_LEN, HQ, HKV, DIM = "cpu", 64, 4, 2, 32
    capture, median_ms = (lambda fn: type("G", (), {"replay": staticmethod(fn)})()), fake_median
    SCHEMES = [s for s in SCHEMES if s[0] != "bf16"] + [("bf16", 16)]


if __name__ == "__main__":
    main()
