"""Time RetroInfer's per-layer kernels at one decode step's shape on a GPU (CUDA-graph replay): the selection
by count (its torch reference, a softmax + stable sort, against the Triton radix select at several chunk sizes
and warps), the ranking logits and the estimation at several settings, from the centroids and from the ranking's
logits, and the picks (``cluster_picks``: the slots and estimated ids) in one Triton launch and in two. Prints one
table; checks the variants agree with the references.

    python benchmarks/retroinfer_kernel_probe.py [--batch 5] [--context 131072] [--part picks]

``--part picks`` runs the picks alone; with ``--device cpu`` (and ``TRITON_INTERPRET=1``) it checks them in
Triton's interpreter at a small ``--context`` and times nothing that means anything.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/sparse-kernels/benchmarks"))


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the finite entries (an empty cluster's logit is -inf in both); inf when the two
    disagree on which entries are finite."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    return float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0


def graph_ms(fn, reps: int = 36) -> float:
    """ms per call: ``reps`` calls (a step's layers) captured in one CUDA graph (``_timing.capture``), its replay
    timed by ``_timing.median_ms``."""
    from _timing import capture, median_ms

    graph = capture(lambda: [fn() for _ in range(reps)])
    return median_ms(graph.replay) / reps


def picks_inputs(n: int, context: int, device: torch.device, heads: int = 8) -> tuple[tuple, dict, str]:
    """``cluster_picks``' arguments as RetroInfer's decode makes them for ``n`` rows of a ``context``-token
    context (its default settings), with a description of the shape.

    Width as ``RetroInfer.selection_size``; the index ends an average unindexed tail (``recent + update / 2``)
    before the context's end, its clusters hold ``avg`` tokens on average (each token a random one), the row's
    budget is the width less the sink and the tail, its ordered clusters ``ordered_clusters`` of that budget;
    ``Cw`` columns as the other sections have them, ``widths`` by ``selection_widths``; ``order`` a descending
    sort of random scores, the empty columns (and those past the row's clusters) last."""
    from sparse_kernels.cluster_attention import cluster_counts
    from sparse_methods.cluster_selection import ordered_clusters, selection_widths
    from sparse_methods.methods.retroinfer import WIDTH_QUANTUM, RetroInferConfig

    c = RetroInferConfig()
    sink, avg, recent = c.retroinfer_sink_tokens, c.retroinfer_avg_cluster_size, c.retroinfer_recent_tokens
    ratios = c.retroinfer_retrieval_ratio, c.retroinfer_estimation_ratio
    kv = context
    retrieved, _ = cluster_counts((kv - 1 - recent - sink) // avg, ratios[0], 0.0)
    exact = sink + recent + c.retroinfer_update_tokens
    width = min(kv, -(-(exact + retrieved * avg) // WIDTH_QUANTUM) * WIDTH_QUANTUM)
    count = (kv - recent - c.retroinfer_update_tokens // 2 - sink) // avg  # the index's clusters
    indexed = count * avg
    end = sink + indexed
    budget = width - sink - (kv - end)
    retrieved, estimated = cluster_counts(count, *ratios)
    retrieved = ordered_clusters(retrieved, budget, avg, count)
    columns = (context + 2048) // avg
    widths = selection_widths(columns, *ratios, width - sink, avg)
    reach = min(columns * avg, max(1, width - sink))
    gen = torch.Generator(device=device).manual_seed(1)
    assign = torch.randint(0, count, (n * heads, indexed), device=device, generator=gen)
    live = torch.zeros(n * heads, count, dtype=torch.int64, device=device)
    live.scatter_add_(1, assign, torch.ones_like(assign))
    sizes = torch.zeros(n, heads, columns, dtype=torch.int32, device=device)
    sizes[..., :count] = live.view(n, heads, count).to(torch.int32)
    offsets = (sizes.cumsum(-1) - sizes).transpose(0, 1).reshape(heads, n * columns).to(torch.int32)
    perm = torch.rand(heads, n, indexed, device=device, generator=gen).argsort(-1)
    positions = (perm + sink).reshape(heads, n * indexed).to(torch.int32)
    scores = torch.rand(n, heads, columns, device=device, generator=gen).masked_fill_(sizes == 0, -1.0)
    order = scores.argsort(-1, descending=True)
    rows = [(r * indexed, r * columns, count, end, budget, retrieved, estimated) for r in range(n)]
    plan = torch.tensor(rows, dtype=torch.int64, device=device).T.contiguous()
    kv_lens = torch.full((n,), kv, dtype=torch.int64, device=device)
    kw = dict(sink=sink, width=width, reach=reach, estimate_width=sum(widths) if widths[1] > 0 else 0)
    shape = (
        f"picks: batch {n}, {heads} KV heads, context {kv}: {count} clusters, {columns} columns, width {width}, "
        f"budget {budget}, {retrieved} ordered + {estimated} estimated, estimate width {kw['estimate_width']}"
    )
    return (order, sizes, offsets, positions, plan, kv_lens), kw, shape


def picks_rows(n: int, context: int, device: torch.device, sweep: str) -> tuple[list, list]:
    """``cluster_picks`` in one launch and in two (``ONE_LAUNCH``), at the default slots a program and, with
    ``sweep`` all, at 128 and 512; each checked equal to the torch reference before it is timed. The table's
    rows and, for ``--json``, each variant's settings with its ms."""
    from sparse_kernels._triton import cluster_picks as picks_mod
    from sparse_kernels.cluster_picks import cluster_picks

    args, kw, shape = picks_inputs(n, context, device)
    print(shape, flush=True)
    want = cluster_picks(*args, **kw, backend="reference")
    defaults = picks_mod.ONE_LAUNCH, picks_mod.BLOCK_W
    block_ws = [picks_mod.BLOCK_W] + ([128, 512] if sweep == "all" else [])
    rows, settings = [], []
    for one_launch in (True, False):
        for block_w in block_ws:
            picks_mod.ONE_LAUNCH, picks_mod.BLOCK_W = one_launch, block_w
            try:
                got = cluster_picks(*args, **kw, backend="triton")
                same = torch.equal(got[0], want[0]) and (want[1] is None or torch.equal(got[1], want[1]))
                if device.type == "cuda":
                    ms = graph_ms(lambda: cluster_picks(*args, **kw, backend="triton"))
                else:  # the interpreter: one call's wall time, for nothing but a sign of life
                    start = time.perf_counter()
                    cluster_picks(*args, **kw, backend="triton")
                    ms = (time.perf_counter() - start) * 1e3
            finally:
                picks_mod.ONE_LAUNCH, picks_mod.BLOCK_W = defaults
            launches = "one launch" if one_launch else "two launches"
            rows.append((f"picks, {launches}, {block_w} slots a program ({'equal' if same else 'DIFFER'})", ms))
            print(rows[-1], flush=True)
            settings.append(("picks", dict(ONE_LAUNCH=one_launch, BLOCK_W=block_w), ms))
            if not same:
                raise SystemExit(f"cluster_picks with {launches}, BLOCK_W {block_w}, differs from the reference")
    return rows, settings


def print_table(rows: list[tuple[str, float]]) -> None:
    print("| kernel(s), one layer | us | ms per 36 layers |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms * 1e3:.1f} | {ms * 36:.3f} |")


def main() -> None:
    from sparse_kernels._triton import cluster_estimation as est_mod
    from sparse_kernels.cluster_estimation import cluster_estimation
    from sparse_kernels.cluster_logits import cluster_logits

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--json", help="also write the rows here, with each variant's settings")
    ap.add_argument(
        "--sweep", choices=("all", "estimation", "none"), default="all",
        help="estimation: a few logits shapes, the default selection and the estimation's sweep; none: defaults",
    )  # fmt: skip
    ap.add_argument("--part", choices=("all", "picks"), default="all", help="picks: the picks alone")
    ap.add_argument("--device", default="cuda", help="cpu: the picks (--part picks) in Triton's interpreter")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.part == "picks":
        print_table(picks_rows(args.batch, args.context, dev, args.sweep)[0])
        return
    gen = torch.Generator(device=dev).manual_seed(0)
    n, heads, group, dim, avg = args.batch, 8, 4, 128, 16
    columns = (args.context + 2048) // avg
    total = n * columns
    query = torch.randn(n, heads * group, dim, device=dev, generator=gen, dtype=torch.bfloat16)
    centroids = torch.randn(heads, total, dim, device=dev, generator=gen).to(torch.bfloat16)
    value_sums = torch.randn(heads, total, dim, device=dev, generator=gen)
    sizes = torch.randint(1, 2 * avg, (heads, total), device=dev, generator=gen, dtype=torch.int32)
    bases = torch.arange(n, device=dev) * columns
    counts = torch.full((n,), args.context // avg, device=dev)
    rows = []

    from sparse_kernels._triton import cluster_logits as logits_mod

    logits = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=dim**-0.5)
    logit_defaults = logits_mod.BLOCK_C, logits_mod.NUM_WARPS
    settings = []  # (kernel, module settings, ms) for --json
    logit_defaults = logit_defaults + (logits_mod.TILES_PER_PROGRAM, logits_mod.NUM_STAGES)
    logit_shapes = [logit_defaults, (128, 2, 1, 2), (64, 2, 1, 2), (64, 4, 1, 2), (128, 8, 1, 2), (256, 8, 1, 2)]
    if args.sweep == "none":
        logit_shapes = [logit_defaults]
    if args.sweep == "all":
        logit_shapes += [(bc, w, t, st) for bc in (64, 128) for w in (2, 4) for t in (2, 4, 8) for st in (2, 3)]
        logit_shapes += [(bc, 1, t, st) for bc in (32, 64) for t in (1, 2, 4) for st in (2, 3)]  # one-warp programs
    for block_c, warps, tiles, stages in logit_shapes:
        logits_mod.BLOCK_C, logits_mod.NUM_WARPS = block_c, warps
        logits_mod.TILES_PER_PROGRAM, logits_mod.NUM_STAGES = tiles, stages
        got = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=dim**-0.5)
        err = _max_diff(got.logits, logits.logits)
        ms = graph_ms(lambda: cluster_logits(query, centroids, sizes, bases, counts, columns, scale=dim**-0.5))
        name = f"ranking logits + tile statistics, {block_c} columns, warps {warps}, {tiles} tiles, {stages} stages"
        rows.append((f"{name} (max diff {err:.1e})", ms))
        print(rows[-1], flush=True)
        settings.append(
            ("logits", dict(BLOCK_C=block_c, NUM_WARPS=warps, TILES_PER_PROGRAM=tiles, NUM_STAGES=stages), ms)
        )
    logits_mod.BLOCK_C, logits_mod.NUM_WARPS, logits_mod.TILES_PER_PROGRAM, logits_mod.NUM_STAGES = logit_defaults
    from sparse_kernels._triton import cluster_select as select_mod
    from sparse_kernels.cluster_select import cluster_select

    count = args.context // avg
    retrieved = torch.full((n,), min(max(round(count * 0.018), 1), count), device=dev)
    estimated = torch.minimum(torch.full((n,), round(count * 0.232), device=dev), count - retrieved)
    widths = dict(read_width=round(columns * 0.018), estimate_width=round(columns * 0.232))
    sel_args = (logits.logits, logits.sizes, retrieved, estimated)
    sel_want = cluster_select(*sel_args, **widths, backend="reference")
    ms = graph_ms(lambda: cluster_select(*sel_args, **widths, backend="reference"))
    rows.append(("select by count: torch softmax + sum + stable sort (the reference)", ms))
    sel_defaults = select_mod.CHUNK, select_mod.NUM_WARPS
    select_shapes = (
        [(sub, w) for sub in (512, 1024, 2048) for w in (2, 4, 8)] if args.sweep == "all" else [sel_defaults]
    )
    for sub, warps in select_shapes:
        select_mod.CHUNK, select_mod.NUM_WARPS = sub, warps
        stats = dict(tile_max=logits.tile_max, tile_sum=logits.tile_sum)
        got = cluster_select(*sel_args, **widths, **stats)
        differ = int((got != sel_want).sum())
        ms = graph_ms(lambda s=stats: cluster_select(*sel_args, **widths, **s))
        name = f"select by count: chunk {sub}, warps {warps}"
        rows.append((f"{name} ({differ} of {got.numel()} places differ)", ms))
        print(rows[-1], flush=True)
    select_mod.CHUNK, select_mod.NUM_WARPS = sel_defaults

    num_est = round(columns * 0.232)
    ids = torch.stack([torch.randperm(count, device=dev)[:num_est] for _ in range(n * heads)]).view(n, heads, num_est)
    ids = ids + bases[:, None, None]
    ref = cluster_estimation(query, centroids, value_sums, sizes, ids, scale=dim**-0.5, backend="reference")
    est_defaults = est_mod.VALUE_PRECISION, est_mod.NUM_STAGES, est_mod.NUM_WARPS, est_mod.PROGRAMS_PER_SM
    est_settings = [est_defaults, ("tf32", 2, 1, 16), ("tf32", 3, 1, 16), ("tf32", 2, 2, 8), ("tf32", 2, 1, 8)]
    for precision, stages, warps, per_sm in est_settings:
        est_mod.VALUE_PRECISION, est_mod.NUM_STAGES, est_mod.NUM_WARPS, est_mod.PROGRAMS_PER_SM = (
            precision,
            stages,
            warps,
            per_sm,
        )
        out, lse = cluster_estimation(query, centroids, value_sums, sizes, ids, scale=dim**-0.5)
        err = float((out - ref[0]).abs().max())
        ms = graph_ms(lambda: cluster_estimation(query, centroids, value_sums, sizes, ids, scale=dim**-0.5))
        rows.append((f"estimation {precision} stages {stages} warps {warps} per SM {per_sm} (max err {err:.1e})", ms))
        chosen = dict(VALUE_PRECISION=precision, NUM_STAGES=stages, NUM_WARPS=warps, PROGRAMS_PER_SM=per_sm)
        settings.append(("estimation, centroids, float32 sums", chosen, ms))
    est_mod.VALUE_PRECISION, est_mod.NUM_STAGES, est_mod.NUM_WARPS, est_mod.PROGRAMS_PER_SM = est_defaults
    # The engine's way: the scores from the ranking's logits (made at dim ** -0.5; the attention's scale here
    # differs, as an engine's may), not the centroids; the reference at the attention's scale from the centroids.
    attn_scale = 0.9 * dim**-0.5
    want = cluster_estimation(query, centroids, value_sums, sizes, ids, scale=attn_scale, backend="reference")
    from_logits = dict(logits=logits.logits, bases=bases, logits_scale=dim**-0.5)
    out, lse = cluster_estimation(query, centroids, value_sums, sizes, ids, scale=attn_scale, **from_logits)
    err = max(float((out - want[0]).abs().max()), float((lse - want[1]).nan_to_num().abs().max()))
    ms = graph_ms(lambda: cluster_estimation(query, centroids, value_sums, sizes, ids, scale=attn_scale, **from_logits))
    rows.append((f"estimation from the ranking's logits, defaults (max err {err:.1e})", ms))
    half = value_sums.to(torch.bfloat16)  # the arena's value sums for a bf16 model
    want = cluster_estimation(query, centroids, half, sizes, ids, scale=attn_scale, backend="reference")
    out, lse = cluster_estimation(query, centroids, half, sizes, ids, scale=attn_scale, **from_logits)
    err = float((out - want[0]).abs().max())
    ms = graph_ms(lambda: cluster_estimation(query, centroids, half, sizes, ids, scale=attn_scale, **from_logits))
    rows.append((f"estimation from the ranking's logits, bf16 value sums (max err {err:.1e})", ms))
    print(rows[-1], flush=True)
    ms = graph_ms(lambda: cluster_estimation(query, centroids, half, sizes, ids, scale=attn_scale))
    rows.append(("estimation from the centroids, bf16 value sums", ms))
    print(rows[-1], flush=True)
    names = ("VALUE_PRECISION", "NUM_STAGES", "NUM_WARPS", "PROGRAMS_PER_SM")
    settings.append(("estimation from logits", dict(zip(names, est_defaults, strict=True)), ms))
    # The engine's way in full: bf16 value sums, scores from the logits, and each row's estimated clusters in
    # ascending column order (the selection's layout), over tile sizes, warps, stages and programs per SM (many
    # programs per SM: one tile a program).
    sorted_ids = ids.sort(-1).values
    want = cluster_estimation(query, centroids, half, sizes, sorted_ids, scale=attn_scale, backend="reference")
    shape_defaults = est_mod.BLOCK_E, est_mod.NUM_WARPS, est_mod.NUM_STAGES, est_mod.PROGRAMS_PER_SM
    shapes = (
        [shape_defaults]
        if args.sweep == "none"
        else [shape_defaults]
        + [
            (be, w, st, ps)
            for be, w in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4))
            for st in (1, 2, 3)
            for ps in (8, 16, 64)
        ]
    )
    for block_e, warps, stages, per_sm in shapes:
        est_mod.BLOCK_E, est_mod.NUM_WARPS, est_mod.NUM_STAGES, est_mod.PROGRAMS_PER_SM = block_e, warps, stages, per_sm
        try:
            out, lse = cluster_estimation(query, centroids, half, sizes, sorted_ids, scale=attn_scale, **from_logits)
            err = max(float((out - want[0]).abs().max()), float((lse - want[1]).nan_to_num().abs().max()))
            fn = lambda: cluster_estimation(query, centroids, half, sizes, sorted_ids, scale=attn_scale, **from_logits)  # noqa: E731
            ms = graph_ms(fn)
        except Exception as exc:  # a shape that does not compile (registers, shared memory)
            print("estimation shape", (block_e, warps, stages, per_sm), "failed:", repr(exc)[:200], flush=True)
            continue
        name = f"estimation, engine's way (sorted ids), {block_e} clusters a tile, warps {warps}, stages {stages}"
        rows.append((f"{name}, per SM {per_sm} (max err {err:.1e})", ms))
        print(rows[-1], flush=True)
        chosen = dict(BLOCK_E=block_e, NUM_WARPS=warps, NUM_STAGES=stages, PROGRAMS_PER_SM=per_sm)
        settings.append(("estimation", chosen, ms))
    est_mod.BLOCK_E, est_mod.NUM_WARPS, est_mod.NUM_STAGES, est_mod.PROGRAMS_PER_SM = shape_defaults
    est_bytes = n * heads * num_est * (dim * 2 + dim * 4 + 4 + 8)
    logit_bytes = n * heads * num_est * (group * 4 + dim * 4 + 4 + 8)  # the logits' sectors may hold more
    print(
        f"batch {n}, context {args.context}, {columns} columns, {num_est} estimated per row and head; "
        f"estimation bytes per layer {est_bytes / 1e6:.1f} MB from centroids, {logit_bytes / 1e6:.1f} MB from logits"
    )
    picks, chosen = picks_rows(n, args.context, dev, args.sweep)
    rows += picks
    settings += chosen
    print_table(rows)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"rows": rows, "settings": settings}, f, indent=1)


if __name__ == "__main__":
    main()
