"""Quest / OmniKV selection kernels on the GPU, at the issue-17 shape: Qwen3-8B heads (32 query, 8 KV,
head_dim 128, bf16), 16-token pages in a shuffled pool, 128K context (8193 pages per row, ``max_pages``
8448 as the engine plans for 2048 more tokens), Quest budget 128 pages (4 sink + 92 + 32 recent),
OmniKV 2048 tokens.

Per batch size: ``page_bounds`` (Quest, reads kmin/kmax; then over int8 codes with a scale), ``paged_logits``
(OmniKV's filter layers, reads K), ``top_k_ascending`` over Quest's bounds ([B, 8, 8448], k 128) and OmniKV's
scores ([B, 135168], k 2048) under every variant of ``TOPK_VARIANTS`` (the Triton module's ``CONFIG``: select,
bits per pass, candidate tiles, warps; each checked against a stable sort, then timed replaying a CUDA graph,
and tabled at the end), and each method's whole selection chain (bounds + top-k; logits + top-k) captured in a
CUDA graph as the engine runs it. Streaming kernels print GB/s and % of the copy bandwidth measured in the
same process; the sweep rows (``cfg ...``) try other tile / warp / stage settings. Every call rotates over
enough layers' buffers that L2 holds none of them. Checks first: bounds and logits against the plain torch
references, top-k equal to a stable sort. Both kinds of summaries are also graph-timed side by side under the
default launch and under ``heads_together`` (one program per row and chunk reading all KV heads of its pages,
at each shape of ``TOGETHER_SWEEP``), each variant checked against the reference first.

The H200 run in results/bench/h200/quest_select/ (at 848696c) also timed the kernels of 1a3af46 and a
radix-select top-k side by side (``git show 848696c:benchmarks/quest_select_probe.py``); the radix
top-k was slower (55-87 us against 34 us for Quest's rows) and was reverted; those top-k timings were
eager back-to-back calls, where a candidate stage's launch adds host time.

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python3 benchmarks/quest_select_probe.py \\
        [--batches 1,5,8] [--no-sweep] [--top-k-only | --page-bounds-only] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/sparse-kernels/benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import capture, copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels import page_bounds, paged_logits, top_k_ascending  # noqa: E402
from sparse_kernels._triton import page_bounds as new_pb  # noqa: E402
from sparse_kernels._triton import paged_logits as new_pl  # noqa: E402
from sparse_kernels._triton import top_k_ascending as new_tk  # noqa: E402
from sparse_kernels.summary_codes import encode_summary  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
KV_LEN = 131072 + 1  # the prompt plus the token being decoded
MAX_PAGES = 8448
SINK, RECENT, QUEST_K = 4, 32, 128
OMNI_K = 2048
DEVICE = "cuda"
L2_BYTES = 256 << 20  # rotate over at least this many bytes of inputs per timed call

PB_SWEEP = [(64, 4, 3), (64, 2, 4), (32, 2, 3), (128, 2, 3), (64, 1, 3), (32, 1, 3), (128, 1, 2), (256, 2, 3)]
# BLOCK_N, warps, stages
PB_GRAPH_SWEEP = [(64, 2, 3), (64, 2, 4), (64, 2, 2), (128, 2, 3), (128, 4, 3), (32, 1, 3), (64, 1, 3), (32, 2, 3),
                  (128, 4, 4), (256, 4, 3)]  # fmt: skip
# page_bounds' heads-together kernel (``heads_together``): BLOCK_P_TOGETHER (pages a step, times 8 KV heads rows),
# warps. Compiled for sm_90 (on CPU), model-dtype summaries at BLOCK_P 32 and 4 warps asked 281 KB of shared
# memory, more than an SM has (such shapes are skipped); codes at BLOCK_P 32 spilled at 2 and 4 warps, not 8.
TOGETHER_SWEEP = [(8, 2), (8, 4), (16, 2), (16, 4), (16, 8), (32, 2), (32, 4), (32, 8)]
PL_SWEEP = [(32, 1, 3), (64, 1, 3), (32, 2, 3), (64, 2, 3), (128, 2, 3), (32, 4, 3), (64, 4, 2), (128, 4, 3)]


class Inputs:
    """``layers`` copies of one decode step's selection inputs (same tables, different summaries / keys)."""

    def __init__(self, batch: int, layers: int, with_keys: bool, gen: torch.Generator):
        dev = DEVICE
        pages = -(-KV_LEN // BS)
        self.batch, self.layers = batch, layers
        num_blocks = batch * pages + 7
        self.table = torch.randperm(num_blocks, generator=gen)[: batch * pages].to(torch.int32).to(dev)
        self.start = (torch.arange(batch) * pages).to(torch.int32).to(dev)
        self.num_pages = torch.full((batch,), pages, dtype=torch.int32, device=dev)
        self.kv_lens = torch.full((batch,), KV_LEN, dtype=torch.int32, device=dev)
        self.q = [torch.randn(batch, HQ, D, device=dev).bfloat16() for _ in range(layers)]
        self.kmin, self.kmax, self.codes = [], [], []
        for _ in range(layers):
            a, b = torch.randn(2, num_blocks, HKV, D, device=dev).bfloat16()
            self.kmin.append(torch.minimum(a, b))
            self.kmax.append(torch.maximum(a, b))
            self.codes.append(encode_summary(self.kmin[-1], self.kmax[-1]))  # int8 kmin, kmax, scale
        shape = (num_blocks, BS, HKV, D)
        self.k_cache = [torch.randn(shape, device=dev).bfloat16() for _ in range(layers)] if with_keys else []
        self.bounds = torch.empty(batch, HKV, MAX_PAGES, device=dev)
        self.logits = torch.empty(batch, HQ, MAX_PAGES * BS, device=dev) if with_keys else None
        self.pages = pages

    def summary_bytes(self) -> int:
        return self.batch * HKV * self.pages * 2 * D * 2 + self.bounds.numel() * 4

    def coded_summary_bytes(self) -> int:
        return self.batch * HKV * self.pages * (2 * D + 4) + self.bounds.numel() * 4

    def key_bytes(self) -> int:
        return self.batch * HKV * KV_LEN * D * 2 + self.logits.numel() * 4


def layers_for(bytes_per_layer: int) -> int:
    return max(1, math.ceil(L2_BYTES / bytes_per_layer))


def rotate(fn, layers: int):
    """A call that runs ``fn(layer)`` for every layer (timed per layer by dividing by ``layers``)."""

    def call():
        for i in range(layers):
            fn(i)

    return call


def timed_us(fn, layers: int) -> float:
    return median_ms(rotate(fn, layers), iters=5) * 1e3 / layers


def row(name: str, us: float, nbytes: int | None, bw: float) -> dict:
    entry = {"kernel": name, "us": round(us, 2)}
    text = f"  {name:<44} {us:9.1f} us"
    if nbytes is not None:
        gbs = nbytes / (us * 1e-6) / 1e9
        entry.update(gb_per_s=round(gbs, 1), pct_copy=round(100 * gbs * 1e9 / bw, 1))
        text += f"  {gbs:7.0f} GB/s  {entry['pct_copy']:5.1f}% copy"
    print(text, flush=True)
    return entry


def bounds_args(x: Inputs, i: int):
    return (x.q[i], x.kmin[i], x.kmax[i], x.table, x.start, x.num_pages, x.bounds)


def probe_stream(name: str, x: Inputs, bw: float, nbytes: int, module, run_new, sweep, config=None) -> list[dict]:
    """The kernel (``run_new(layer)``), then under each ``(tile, warps, stages)`` of ``sweep`` set in
    ``config`` (default ``module.CONFIG``; its tile key first)."""
    config = module.CONFIG if config is None else config
    rows = [row(name, timed_us(run_new, x.layers), nbytes, bw)]
    tile_key = next(iter(config))
    for tile, warps, stages in sweep:
        saved = dict(config)
        config.update({tile_key: tile, "num_warps": warps, "num_stages": stages})
        try:
            rows.append(row(f"  cfg {tile_key}={tile} w{warps} s{stages}", timed_us(run_new, x.layers), nbytes, bw))
        finally:
            config.update(saved)
    return rows


def probe_page_bounds(x: Inputs, bw: float, sweep: bool) -> list[dict]:
    ref = torch.empty_like(x.bounds)
    page_bounds(*bounds_args(x, 0)[:-1], ref, sink=SINK, recent=RECENT, backend="reference")
    new_pb.page_bounds_triton(*bounds_args(x, 0), SINK, RECENT)
    torch.testing.assert_close(x.bounds, ref, rtol=1e-4, atol=1e-3)

    def run(i):
        new_pb.page_bounds_triton(*bounds_args(x, i), SINK, RECENT)

    def check():
        run(0)
        torch.testing.assert_close(x.bounds, ref, rtol=1e-4, atol=1e-3)

    rows = probe_stream("page_bounds", x, bw, x.summary_bytes(), new_pb, run, PB_SWEEP if sweep else [])
    return rows + probe_heads_together("page_bounds", x, bw, x.summary_bytes(), new_pb.CONFIG, run, check)


def probe_heads_together(name: str, x: Inputs, bw: float, nbytes: int, config: dict, run, check) -> list[dict]:
    """``run(layer)`` graph-timed under the default launch, then with ``heads_together`` set in ``config`` at
    each ``(BLOCK_P_TOGETHER, warps)`` of ``TOGETHER_SWEEP`` (``check()`` first: one call against the reference;
    a shape the device cannot launch is skipped)."""
    rows = []
    for block_p, warps in [(None, None), *TOGETHER_SWEEP]:
        label, update = f"{name} (graph)", {}
        if block_p is not None:
            label = f"  {name} heads together BLOCK_P={block_p} w{warps} (graph)"
            update = {"heads_together": True, "BLOCK_P_TOGETHER": block_p, "num_warps": warps}
        with config_scope(config, update):
            try:
                check()
            except OutOfResources as e:
                print(f"  {label.strip()}: skipped ({e})", flush=True)
                continue
            graph = capture(rotate(run, x.layers))
        rows.append(row(label, median_ms(graph.replay, iters=5) * 1e3 / x.layers, nbytes, bw))
    return rows


def probe_coded_page_bounds(x: Inputs, bw: float, sweep: bool, graph_sweep: bool = False) -> list[dict]:
    """``page_bounds`` over int8 summary codes with a scale per (block, KV head) (half the bytes)."""
    kmin, kmax, scale = x.codes[0]
    ref = torch.empty_like(x.bounds)
    args = (x.q[0], kmin, kmax, x.table, x.start, x.num_pages)
    page_bounds(*args, ref, sink=SINK, recent=RECENT, scale=scale, backend="reference")
    new_pb.page_bounds_triton(*args, x.bounds, SINK, RECENT, scale)
    torch.testing.assert_close(x.bounds, ref, rtol=1e-4, atol=1e-3)

    def run(i):
        c = x.codes[i]
        new_pb.page_bounds_triton(x.q[i], c[0], c[1], x.table, x.start, x.num_pages, x.bounds, SINK, RECENT, c[2])

    sweeps = PB_SWEEP if sweep else []
    rows = probe_stream("page_bounds int8", x, bw, x.coded_summary_bytes(), new_pb, run, sweeps, new_pb.CODES_CONFIG)
    # Both conversions of the codes (hardware int-to-float, or byte permutes), float32 or bfloat16 bounds,
    # replayed from a CUDA graph (an eager launch costs more host time than the kernel at batch 5).
    bf16_bounds = torch.empty_like(x.bounds, dtype=torch.bfloat16)
    for prmt in (False, True):
        for out, label in ((x.bounds, "f32"), (bf16_bounds, "bf16")):
            with codes_config(prmt=prmt):
                new_pb.page_bounds_triton(*args, out, SINK, RECENT, scale)
                torch.testing.assert_close(out.float(), ref, rtol=1e-2 if label == "bf16" else 1e-4, atol=1e-3)

                def run_codes(i, out=out):
                    c = x.codes[i]
                    tables = (x.table, x.start, x.num_pages)
                    new_pb.page_bounds_triton(x.q[i], c[0], c[1], *tables, out, SINK, RECENT, c[2])

                nbytes = x.coded_summary_bytes() - x.bounds.numel() * (4 - out.element_size())
                graph = capture(rotate(run_codes, x.layers))
                us = median_ms(graph.replay, iters=5) * 1e3 / x.layers
                rows.append(row(f"page_bounds int8 {'prmt' if prmt else 'cvt'} {label} (graph)", us, nbytes, bw))
    if sweep or graph_sweep:  # the default (byte permutes, bfloat16 bounds) under other launch shapes, graph-timed
        for block_p, warps, stages in PB_GRAPH_SWEEP:
            with codes_config(prmt=True, BLOCK_P=block_p, num_warps=warps, num_stages=stages):
                graph = capture(rotate(run_codes, x.layers))  # run_codes: the last (bfloat16) one
            us = median_ms(graph.replay, iters=5) * 1e3 / x.layers
            rows.append(row(f"  cfg prmt bf16 BLOCK_P={block_p} w{warps} s{stages} (graph)", us, nbytes, bw))

    def run_bf16(i):  # the default's (byte permutes, bfloat16 bounds), against the heads-together kernel
        c = x.codes[i]
        new_pb.page_bounds_triton(x.q[i], c[0], c[1], x.table, x.start, x.num_pages, bf16_bounds, SINK, RECENT, c[2])

    def check_bf16():
        run_bf16(0)
        torch.testing.assert_close(bf16_bounds.float(), ref, rtol=1e-2, atol=1e-3)

    nbytes = x.coded_summary_bytes() - x.bounds.numel() * 2
    return rows + probe_heads_together(
        "page_bounds int8 bf16", x, bw, nbytes, new_pb.CODES_CONFIG, run_bf16, check_bf16
    )


@contextlib.contextmanager
def config_scope(config: dict, update: dict):
    """``config`` (a Triton module's launch dict) updated with ``update`` inside the block, restored after."""
    saved = dict(config)
    config.update(update)
    try:
        yield
    finally:
        config.clear()
        config.update(saved)


def codes_config(**update):
    """The int8 page bounds' ``CODES_CONFIG`` updated inside the block."""
    return config_scope(new_pb.CODES_CONFIG, update)


def logits_args(x: Inputs, i: int):
    return (x.q[i], x.k_cache[i], x.table, x.start, x.kv_lens, x.logits)


def probe_paged_logits(x: Inputs, bw: float, sweep: bool) -> list[dict]:
    scale = D**-0.5
    ref = torch.empty_like(x.logits)
    paged_logits(*logits_args(x, 0)[:-1], ref, scale=scale, backend="reference")
    new_pl.paged_logits_triton(*logits_args(x, 0), scale)
    torch.testing.assert_close(x.logits, ref, rtol=1e-4, atol=1e-3)
    del ref
    return probe_stream(
        "paged_logits",
        x,
        bw,
        x.key_bytes(),
        new_pl,
        lambda i: new_pl.paged_logits_triton(*logits_args(x, i), scale),
        PL_SWEEP if sweep else [],
    )


# top_k_ascending variants: CONFIG overrides of the Triton module (the rest at its defaults). "t1024":
# candidate stages of 1024-column tiles from 2048 columns (at least 8 k: OmniKV's 2048 of 135168
# tokens take 16384-column tiles); "m2048": candidates over 2048 (and the tile) take another stage.
_PACKED, _T1024 = {"select": "packed"}, {"single": 2048, "tile": 1024, "tile_per_k": 8}
TOPK_VARIANTS = {
    "serial (default)": {},
    "serial t1024": _T1024,
    **{f"packed b{b}": {**_PACKED, "bits": b} for b in (1, 2, 4)},
    **{f"packed b{b} t1024": {**_PACKED, **_T1024, "bits": b} for b in (1, 2, 3, 4)},
    "packed b4 t1024 unfused": {**_PACKED, **_T1024, "bits": 4, "fused": False},
    "packed b3 t1024 w2": {**_PACKED, **_T1024, "bits": 3, "min_warps": 2},
    "packed b3 t1024 w8": {**_PACKED, **_T1024, "bits": 3, "columns_per_warp": 128},
    "packed b2 t2048": {**_PACKED, **_T1024, "bits": 2, "tile": 2048},
    "packed b2 t512": {**_PACKED, **_T1024, "bits": 2, "tile": 512, "tile_per_k": 4},
    "packed b3 t1024 m2048": {**_PACKED, **_T1024, "bits": 3, "merge": 2048},
    "packed b2 t4096 x4 w512": {**_PACKED, "bits": 2, "single": 2048, "tile": 4096, "tile_per_k": 4,
                                "columns_per_warp": 512},
    **{f"packed b2 one w{16384 // c}": {**_PACKED, "bits": 2, "single": 16384, "columns_per_warp": c}
       for c in (512, 1024, 2048)},
    "packed b2 t8192": {**_PACKED, "bits": 2, "tile": 8192},
}  # fmt: skip


def topk_variant(name: str):
    """The top-k module's ``CONFIG`` set to the variant's inside the block."""
    return config_scope(new_tk.CONFIG, TOPK_VARIANTS[name])


def graph_us(fn, calls: int = 20) -> float:
    """us per call of ``fn`` replayed ``calls`` times from one CUDA graph (no host launch cost: the
    engine's decode steps replay graphs, and a candidate stage is one more launch)."""
    graph = capture(lambda: [fn() for _ in range(calls)])
    return median_ms(graph.replay, iters=5) * 1e3 / calls


def probe_top_k(name: str, scores: torch.Tensor, k: int) -> list[dict]:
    """Every variant: equal to a stable sort (checked first), then timed from a CUDA graph."""
    flat = scores.reshape(-1, scores.shape[-1])
    expected = top_k_ascending(flat, k, backend="reference")
    out = torch.full_like(expected, -1)
    rows = []
    for variant in TOPK_VARIANTS:
        with topk_variant(variant):
            out.fill_(-1)
            new_tk.top_k_ascending_triton(flat, k, out)
            if not torch.equal(out, expected):
                raise AssertionError(f"{name} top-k ({variant}) differs from a stable sort")
            plan = "+".join(str(t) for t in new_tk.stages(flat.shape[1], k)) or "one"
            us = graph_us(lambda: new_tk.top_k_ascending_triton(flat, k, out))
        rows.append(row(f"{name} top-k {variant} [{plan}]", us, None, 0.0))
    return rows


def probe_top_ks(x_sum: Inputs, gen: torch.Generator) -> list[dict]:
    """Quest's rows (real bounds of ``x_sum``'s first layer) and OmniKV's, every variant."""
    print(f"batch {x_sum.batch}: top-k variants", flush=True)
    quest = quest_scores(x_sum)
    return (
        probe_top_k("quest", quest, QUEST_K)
        + probe_top_k("quest bf16", quest.bfloat16(), QUEST_K)
        + probe_top_k("omnikv", omni_scores(x_sum.batch, gen), OMNI_K)
    )


def top_k_table(results: dict) -> None:
    """us per call of every top-k variant (rows) per shape and batch (columns)."""
    cols = [(b, shape) for b in results["batches"] for shape in ("quest", "quest bf16", "omnikv")]
    print("\ntop_k_ascending, us per call (CUDA graph)")
    print(f"  {'variant':<28}" + "".join(f"{shape[:5]}{shape[6:7]} B{b}".rjust(12) for b, shape in cols))
    for variant in TOPK_VARIANTS:
        cells = []
        for b, shape in cols:
            hit = [r["us"] for r in results["batches"][b] if r["kernel"].startswith(f"{shape} top-k {variant} [")]
            cells.append(f"{hit[0]:12.1f}" if hit else " " * 12)
        print(f"  {variant:<28}" + "".join(cells))


def quest_scores(x: Inputs) -> torch.Tensor:
    """Real bounds with ties: a run of pages shares one summary, so many bounds equal the threshold's."""
    new_pb.page_bounds_triton(*bounds_args(x, 0), SINK, RECENT)
    scores = x.bounds.clone()
    scores[:, :, 1000:1400] = scores[:, :, 1000:1001]  # ties
    return scores


def omni_scores(batch: int, gen: torch.Generator) -> torch.Tensor:
    scores = torch.rand(batch, MAX_PAGES * BS, generator=gen).to(DEVICE)
    scores[:, :64] = float("inf")
    scores[:, KV_LEN - 512 : KV_LEN] = float("inf")
    scores[:, KV_LEN:] = float("-inf")
    scores[:, 5000:8000] = 0.999  # a run of ties at the threshold
    return scores


def probe_chains(x_sum: Inputs, x: Inputs, omni: torch.Tensor) -> list[dict]:
    """Each method's selection as the engine runs it (graph-captured)."""
    chosen = torch.empty(x_sum.batch * HKV, QUEST_K, dtype=torch.int64, device=DEVICE)
    omni_chosen = torch.empty(x.batch, OMNI_K, dtype=torch.int64, device=DEVICE)
    flat_bounds, scale = x_sum.bounds.view(-1, MAX_PAGES), D**-0.5
    bf16_bounds = torch.empty_like(x_sum.bounds, dtype=torch.bfloat16)
    flat_bf16 = bf16_bounds.view(-1, MAX_PAGES)

    def coded(i, out, prmt):
        c = x_sum.codes[i]
        with codes_config(prmt=prmt):
            new_pb.page_bounds_triton(x_sum.q[i], c[0], c[1], x_sum.table, x_sum.start, x_sum.num_pages, out, SINK,
                                      RECENT, c[2])  # fmt: skip

    chains = {  # name: (inputs, one layer's calls)
        "quest bounds+top-k": (x_sum, lambda i: (
            new_pb.page_bounds_triton(*bounds_args(x_sum, i), SINK, RECENT),
            new_tk.top_k_ascending_triton(flat_bounds, QUEST_K, chosen),
        )),
        "quest int8 cvt f32 bounds+top-k": (x_sum, lambda i: (
            coded(i, x_sum.bounds, False),
            new_tk.top_k_ascending_triton(flat_bounds, QUEST_K, chosen),
        )),
        "quest int8 cvt bf16 bounds+top-k": (x_sum, lambda i: (
            coded(i, bf16_bounds, False),
            new_tk.top_k_ascending_triton(flat_bf16, QUEST_K, chosen),
        )),
        "quest int8 prmt bf16 bounds+top-k": (x_sum, lambda i: (
            coded(i, bf16_bounds, True),
            new_tk.top_k_ascending_triton(flat_bf16, QUEST_K, chosen),
        )),
        "omnikv logits+top-k": (x, lambda i: (
            new_pl.paged_logits_triton(*logits_args(x, i), scale),
            new_tk.top_k_ascending_triton(omni, OMNI_K, omni_chosen),
        )),
    }  # fmt: skip
    rows = []
    for name, (inputs, fn) in chains.items():
        graph = capture(rotate(fn, inputs.layers))
        rows.append(row(f"{name} (graph)", median_ms(graph.replay, iters=5) * 1e3 / inputs.layers, None, 0.0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,5,8")
    ap.add_argument("--no-sweep", action="store_true", help="skip the config sweeps")
    ap.add_argument("--top-k-only", action="store_true", help="only the top-k variants")
    ap.add_argument("--page-bounds-only", action="store_true", help="only page_bounds (model dtype and int8 codes)")
    ap.add_argument("--codes-graph-sweep", action="store_true", help="sweep int8 page bounds' shapes (graph-timed)")
    ap.add_argument("--top-k-variants", help="comma-separated names of TOPK_VARIANTS to time (default all)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.top_k_variants:
        keep = args.top_k_variants.split(",")
        for name in [v for v in TOPK_VARIANTS if v not in keep]:
            del TOPK_VARIANTS[name]
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    results = {"copy_gb_per_s": round(bw / 1e9, 1), "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        torch.manual_seed(batch)
        if args.top_k_only:  # one layer's summaries, for Quest's bounds
            results["batches"][batch] = probe_top_ks(Inputs(batch, 1, with_keys=False, gen=gen), gen)
            continue
        x = Inputs(batch, layers_for(batch * HKV * KV_LEN * D * 2), with_keys=True, gen=gen)
        x_sum = x  # more copies of the summaries (only) where one layer's fit in L2
        if x.layers < layers_for(x.summary_bytes()):
            x_sum = Inputs(batch, layers_for(x.summary_bytes()), with_keys=False, gen=gen)
        print(f"batch {batch}: {x.pages} pages per row, {x_sum.layers} summary / {x.layers} key layer copies")
        rows = probe_page_bounds(x_sum, bw, not args.no_sweep)
        rows += probe_coded_page_bounds(x_sum, bw, not args.no_sweep, args.codes_graph_sweep)
        if args.page_bounds_only:
            results["batches"][batch] = rows
            continue
        rows += probe_paged_logits(x, bw, not args.no_sweep)
        rows += probe_top_ks(x_sum, gen)
        rows += probe_chains(x_sum, x, omni_scores(batch, gen))
        results["batches"][batch] = rows
        del x, x_sum
        torch.cuda.empty_cache()
    top_k_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
