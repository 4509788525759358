"""Fused MoE on a GPU at the Qwen3-30B-A3B shape: ms per layer, bytes read and % of the copy bandwidth
for the old and the new tile configs side by side, the layer's launches timed one by one, Triton ==
reference, CUDA-graph replay == eager (GPU only).

Shape: 128 experts, 8 per token, hidden 2048, expert width 768, bf16. ``--layers`` distinct expert stacks
(1.2 GB each, far past the L2) with their own routing are called in turn inside one CUDA graph, as a
decode step runs its layers; time per layer = graph time / layers. Routing: softmax top-8 of random
logits (about uniform). Bytes per layer = the distinct experts its routing names x 9.4 MB (what the
kernels must read; activations are negligible) -> GB/s and the fraction of the device copy bandwidth
(read + written, as every probe here counts it) measured in the same process.

Columns: ``old`` is the tile table before the decode-batch work (16-row tiles up to 256 entries, then the
64-row prefill tile), run with today's align kernel (the old one-program align took 4 / 24 / 57 / 127 us
at T = 1 / 8 / 64 / 2048: results/bench/h200/prefill/kernels/moe_probe.json); ``new`` is
``sparse_kernels.moe.moe_config``. For the new config, each launch alone: align, gate/up, down (each
GEMM's % of copy bandwidth over its own bytes), the top-k sum.

``--sweep`` times each GEMM alone over ``SWEEP_TILES`` at the ``--sweep-tokens`` sizes, then the layer
with the best gate/up and down tiles (and with twice the tile rows where experts average 2+ tiles), and
prints ``MOE_CONFIGS`` rows to paste into ``sparse_kernels/moe.py``. About 2-3 minutes on an H200,
most of it compiling the 24 swept kernels.

Usage: ``python benchmarks/moe_probe.py [--tokens ...] [--layers 8] [--sweep] [--sweep-tokens ...] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/sparse-kernels/benchmarks"))
from _timing import capture, copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels import fused_moe  # noqa: E402
from sparse_kernels._triton.moe import moe_gemm_triton  # noqa: E402
from sparse_kernels.moe import fused_moe_reference, gemm_config, moe_config  # noqa: E402
from sparse_kernels.moe_align import align_by_expert  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
EXPERT_BYTES = {"gate_up": 2 * INTER * HIDDEN * 2, "down": HIDDEN * INTER * 2}
TOKENS = [1, 8, 16, 32, 64, 71, 128, 256, 2048]
SWEEP_TOKENS = [16, 32, 64, 71, 128, 256]
SWEEP_TILES = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages); every one fits 227 KB for gate/up in bf16
    (16, 128, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (64, 64, 4, 4),
    (64, 128, 4, 4), (64, 128, 8, 4), (64, 256, 8, 3), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3),
]  # fmt: skip


def old_config(num_entries: int) -> dict:
    """The tile table before the decode-batch work (one flat tile for both GEMMs)."""
    if num_entries <= 256:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def tile(block_n: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps, "num_stages": num_stages}


def tile_name(t: dict) -> str:
    return f"n{t['BLOCK_N']}k{t['BLOCK_K']}w{t['num_warps']}s{t['num_stages']}"


def make_layers(num_layers: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=DTYPE, generator=gen) / HIDDEN**0.5
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=DTYPE, generator=gen) / INTER**0.5
        layers.append((w13, w2))
    return layers


def routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


class Step:
    """One step of ``num_tokens`` tokens through every layer: inputs, routing, and (for the launch-by-launch
    timings) the intermediates ``fused_moe`` makes, at tile rows ``block_m``."""

    def __init__(self, layers, num_tokens: int, block_m: int):
        self.layers, self.num_tokens, self.block_m = layers, num_tokens, block_m
        self.xs = [torch.randn(num_tokens, HIDDEN, device="cuda", dtype=DTYPE) for _ in layers]
        self.routes = [routing(num_tokens, seed=10 + i) for i in range(len(layers))]
        self.distinct = sum(int(ids.unique().numel()) for ids, _ in self.routes) / len(layers)
        self.tiles = [align_by_expert(ids, EXPERTS, block_m) for ids, _ in self.routes]
        self.flat_weights = [w.reshape(-1).float().contiguous() for _, w in self.routes]
        up = moe_config(num_tokens * TOP_K)["gate_up"]
        self.acts = [self._gate_up(i, up) for i in range(len(layers))]
        self.contribs = [torch.empty(num_tokens * TOP_K, HIDDEN, device="cuda", dtype=DTYPE) for _ in layers]

    def bytes(self, gemm: str | None = None) -> float:
        """Weight bytes a layer reads: its routed experts' (one GEMM's, or both)."""
        per_expert = EXPERT_BYTES[gemm] if gemm else sum(EXPERT_BYTES.values())
        return self.distinct * per_expert

    def _gate_up(self, i: int, t: dict) -> torch.Tensor:
        return moe_gemm_triton(
            self.xs[i], self.layers[i][0], self.tiles[i], gated=True, a_row_div=TOP_K, topk_weights=None, config=t
        )

    def _down(self, i: int, t: dict) -> torch.Tensor:
        w2 = self.layers[i][1]
        return moe_gemm_triton(
            self.acts[i], w2, self.tiles[i], gated=False, a_row_div=1, topk_weights=self.flat_weights[i], config=t
        )

    def ms(self, launch, iters: int = 10, reps: int = 7) -> float:
        """ms per layer of ``launch(i)`` for every layer ``i`` in one CUDA graph."""
        graph = capture(lambda: [launch(i) for i in range(len(self.layers))])
        return median_ms(graph.replay, iters=iters, reps=reps) / len(self.layers)

    def layer_ms(self, config: dict) -> float:
        return self.ms(lambda i: fused_moe(self.xs[i], *self.layers[i], *self.routes[i], config=config))

    def gemm_ms(self, gemm: str, t: dict, **kw) -> float:
        return self.ms(lambda i: (self._gate_up if gemm == "gate_up" else self._down)(i, t), **kw)

    def align_ms(self) -> float:
        return self.ms(lambda i: align_by_expert(self.routes[i][0], EXPERTS, self.block_m))

    def sum_ms(self) -> float:
        return self.ms(lambda i: self.contribs[i].view(self.num_tokens, TOP_K, HIDDEN).sum(1))

    def error(self, config: dict) -> tuple[float, float]:
        """Max |Triton - reference| on layer 0, and the reference's max |value|."""
        (w13, w2), (ids, wts) = self.layers[0], self.routes[0]
        expected = fused_moe_reference(self.xs[0], w13, w2, ids, wts).float()
        got = fused_moe(self.xs[0], w13, w2, ids, wts, config=config).float()
        return float((got - expected).abs().max()), float(expected.abs().max())


def graph_check(layers, num_tokens: int) -> bool:
    """Capture one call, change the routing and the input in place, replay: equal to an eager call."""
    w13, w2 = layers[0]
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=DTYPE)
    ids, weights = routing(num_tokens, seed=1)
    out = {}
    graph = capture(lambda: out.__setitem__("y", fused_moe(x, w13, w2, ids, weights)))
    new_ids, new_weights = routing(num_tokens, seed=2)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out["y"], fused_moe(x, w13, w2, ids, weights)))


def probe(layers, num_tokens: int, copy_bps: float) -> dict:
    new = moe_config(num_tokens * TOP_K)
    step = Step(layers, num_tokens, new["BLOCK_M"])
    frac = lambda nbytes, ms: nbytes / (ms * 1e-3) / copy_bps  # noqa: E731
    old_ms, new_ms = step.layer_ms(old_config(num_tokens * TOP_K)), step.layer_ms(new)
    gemms = {g: step.gemm_ms(g, gemm_config(new, g)) for g in EXPERT_BYTES}
    err, scale = step.error(new)
    return {
        "tokens": num_tokens, "distinct_experts_per_layer": step.distinct, "bytes_per_layer": step.bytes(),
        "old_config": old_config(num_tokens * TOP_K), "new_config": new,
        "old_ms": old_ms, "old_fraction_of_copy_bw": frac(step.bytes(), old_ms),
        "new_ms": new_ms, "new_gb_per_s": step.bytes() / new_ms / 1e6,
        "new_fraction_of_copy_bw": frac(step.bytes(), new_ms),
        "align_ms": step.align_ms(), "sum_ms": step.sum_ms(),
        **{f"{g}_ms": ms for g, ms in gemms.items()},
        **{f"{g}_fraction_of_copy_bw": frac(step.bytes(g), ms) for g, ms in gemms.items()},
        "max_abs_err": err, "ref_max_abs": scale, "ok": err <= 2e-2 * max(scale, 1.0),
        "graph_replay_equals_eager": graph_check(layers, num_tokens),
    }  # fmt: skip


def sweep(layers, num_tokens: int, copy_bps: float) -> dict:
    """Each GEMM alone over ``SWEEP_TILES`` at the new config's BLOCK_M, then the layer with the best pair."""
    new = moe_config(num_tokens * TOP_K)
    step = Step(layers, num_tokens, new["BLOCK_M"])
    rows, best = [], {}
    for gemm in EXPERT_BYTES:
        timed = []
        for t in (tile(*s) for s in SWEEP_TILES):
            try:
                ms = step.gemm_ms(gemm, t, iters=5, reps=5)
            except Exception as e:  # noqa: BLE001  (a tile the compiler rejects: shared memory, registers)
                rows.append({"gemm": gemm, "tile": tile_name(t), "error": str(e)[:200]})
                continue
            frac = step.bytes(gemm) / (ms * 1e-3) / copy_bps
            timed.append((ms, t))
            rows.append({"gemm": gemm, "tile": tile_name(t), "ms": ms, "fraction_of_copy_bw": frac})
        best[gemm] = min(timed, key=lambda r: r[0])[1]
    config = {"BLOCK_M": new["BLOCK_M"], **best}
    ms = step.layer_ms(config)
    if num_tokens * TOP_K >= 2 * EXPERTS * new["BLOCK_M"]:  # 2+ tiles per expert on average: try 2x rows
        wider = {**config, "BLOCK_M": 2 * new["BLOCK_M"]}
        wider_ms = step.layer_ms(wider)
        rows.append({"gemm": "layer", "tile": f"BLOCK_M {wider['BLOCK_M']}", "ms": wider_ms})
        config, ms = (wider, wider_ms) if wider_ms < ms else (config, ms)
    err, scale = step.error(config)
    return {
        "tokens": num_tokens, "best_config": config, "best_ms": ms,
        "best_fraction_of_copy_bw": step.bytes() / (ms * 1e-3) / copy_bps, "ok": err <= 2e-2 * max(scale, 1.0),
        "gemms": rows,
    }  # fmt: skip


def config_rows(swept: list[dict]) -> str:
    """``MOE_CONFIGS`` rows from the sweep: each swept size's best config up to its entries, equal
    neighbours merged (the last row's bound is kept at the table's 4096)."""
    rows: list[tuple[int, dict]] = []
    for r in sorted(swept, key=lambda r: r["tokens"]):
        if rows and rows[-1][1] == r["best_config"]:
            rows.pop()
        rows.append((r["tokens"] * TOP_K, r["best_config"]))
    rows[-1] = (max(rows[-1][0], 4096), rows[-1][1])

    def literal(c: dict) -> str:
        t = lambda g: "_tile({BLOCK_N}, {BLOCK_K}, {num_warps}, {num_stages})".format(**c[g])  # noqa: E731
        return f'{{"BLOCK_M": {c["BLOCK_M"]}, "gate_up": {t("gate_up")}, "down": {t("down")}}}'

    return "\n".join(f"    ({bound}, {literal(c)})," for bound, c in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--layers", type=int, default=8, help="distinct 1.2 GB expert stacks per graph")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP_TILES per GEMM")
    parser.add_argument("--sweep-tokens", type=int, nargs="+", default=SWEEP_TOKENS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_probe needs a CUDA device")
    copy_bps = copy_bandwidth()
    layers = make_layers(args.layers)
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + written)")
    print(
        "T     experts  MB read   old ms %copy   new ms  GB/s %copy  | new: align  gate_up ms %copy  "
        "down ms %copy  sum ms | err ok graph"
    )
    results = []
    for t in args.tokens:
        r = probe(layers, t, copy_bps)
        results.append(r)
        print(
            f"{t:<5} {r['distinct_experts_per_layer']:7.1f}  {r['bytes_per_layer'] / 1e6:7.0f}  "
            f"{r['old_ms']:7.3f} {100 * r['old_fraction_of_copy_bw']:5.1f}  "
            f"{r['new_ms']:7.3f} {r['new_gb_per_s']:5.0f} {100 * r['new_fraction_of_copy_bw']:5.1f}  |  "
            f"{r['align_ms']:8.4f}  {r['gate_up_ms']:8.3f} {100 * r['gate_up_fraction_of_copy_bw']:5.1f}  "
            f"{r['down_ms']:7.3f} {100 * r['down_fraction_of_copy_bw']:5.1f}  {r['sum_ms']:6.4f} | "
            f"{r['max_abs_err']:.0e} {'ok' if r['ok'] else 'BAD'} {r['graph_replay_equals_eager']!s}"
        )
    swept = []
    if args.sweep:
        print(f"\nsweep (each GEMM alone, % of copy bandwidth over its own bytes; {len(SWEEP_TILES)} tiles)")
        for t in args.sweep_tokens:
            s = sweep(layers, t, copy_bps)
            swept.append(s)
            for gemm in EXPERT_BYTES:
                cells = [r for r in s["gemms"] if r["gemm"] == gemm]
                text = "  ".join(
                    f"{r['tile']} {100 * r['fraction_of_copy_bw']:.0f}" if "ms" in r else f"{r['tile']} fail"
                    for r in sorted(cells, key=lambda r: r.get("ms", float("inf")))
                )
                print(f"T={t:<4} {gemm:7} {text}")
            wider = [f"{r['tile']} {r['ms']:.3f} ms" for r in s["gemms"] if r["gemm"] == "layer"]
            print(
                f"T={t:<4} best: BLOCK_M {s['best_config']['BLOCK_M']}, {s['best_ms']:.3f} ms/layer, "
                f"{100 * s['best_fraction_of_copy_bw']:.1f}% of copy {'ok' if s['ok'] else 'BAD'}"
                + (f" (tried {wider[0]})" if wider else "")
            )
        print("\nMOE_CONFIGS rows from this sweep (sparse_kernels/moe.py):\n" + config_rows(swept))
    if args.json:
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": copy_bps}
        args.json.write_text(json.dumps({"environment": env, "results": results, "sweep": swept}, indent=1))


if __name__ == "__main__":
    main()
