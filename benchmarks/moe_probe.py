"""Fused MoE on a GPU at the Qwen3-30B-A3B shape: Triton == reference, time against the reference, bytes
read against the copy bandwidth, and CUDA-graph replay == eager (GPU only).

Shape: 128 experts, 8 per token, hidden 2048, expert width 768, bf16. ``--layers`` distinct expert stacks
(1.2 GB each, far past the L2) with their own routing are called in turn inside one CUDA graph, as a
decode step runs its layers; time per call = graph time / layers. Routing: softmax top-8 of random
logits (about uniform). Bytes per call = the distinct experts the call's routing names x 9.4 MB (what
the kernel must read; activations are negligible) -> GB/s and the fraction of the device copy bandwidth
(read + written) measured in the same run. The reference (plain torch, a loop over the routed experts
with host syncs) runs eagerly on layer 0. ``--sweep`` times other tile shapes per T as well.

Usage: ``python benchmarks/moe_probe.py [--tokens 1 8 64 2048] [--layers 8] [--sweep] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/sparse-kernels/benchmarks"))
from _timing import capture, copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels import fused_moe  # noqa: E402
from sparse_kernels.moe import fused_moe_reference, moe_config  # noqa: E402
from sparse_kernels.moe_align import align_by_expert  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16


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


def candidate_configs(num_tokens: int, sweep: bool):
    yield "default", moe_config(num_tokens * TOP_K)
    if not sweep:
        return
    block_ms = [16] if num_tokens * TOP_K <= 512 else [32, 64, 128]
    for bm, bn, bk, warps, stages in itertools.product(block_ms, [32, 64, 128], [64, 128, 256], [4, 8], [3, 4]):
        yield f"m{bm}n{bn}k{bk}w{warps}s{stages}", {
            "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
        }  # fmt: skip


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


def probe(layers, num_tokens: int, sweep: bool, copy_bps: float) -> dict:
    xs = [torch.randn(num_tokens, HIDDEN, device="cuda", dtype=DTYPE) for _ in layers]
    routes = [routing(num_tokens, seed=10 + i) for i in range(len(layers))]
    distinct = sum(int(ids.unique().numel()) for ids, _ in routes) / len(layers)
    nbytes = distinct * 3 * INTER * HIDDEN * 2
    w13, w2 = layers[0]
    expected = fused_moe_reference(xs[0], w13, w2, *routes[0])
    ref_ms = median_ms(lambda: fused_moe_reference(xs[0], w13, w2, *routes[0]), iters=3, reps=5)
    align_ms = median_ms(capture(lambda: [align_by_expert(r[0], EXPERTS, 16) for r in routes]).replay) / len(layers)
    rows = []
    for name, config in candidate_configs(num_tokens, sweep):
        try:
            got = fused_moe(xs[0], w13, w2, *routes[0], config=config)
            err = float((got.float() - expected.float()).abs().max())
            scale = float(expected.float().abs().max())

            def step(config=config):
                for x, (a, b), (ids, wts) in zip(xs, layers, routes, strict=True):
                    fused_moe(x, a, b, ids, wts, config=config)

            ms = median_ms(capture(step).replay, iters=10) / len(layers)
        except Exception as e:  # noqa: BLE001  (a config the compiler rejects: shared memory, registers)
            rows.append({"config": name, "error": str(e)[:200]})
            continue
        rows.append({
            "config": name, **config, "ms": ms, "max_abs_err": err, "ref_max_abs": scale,
            "ok": err <= 2e-2 * max(scale, 1.0), "gb_per_s": nbytes / ms / 1e6,
            "fraction_of_copy_bw": nbytes / (ms * 1e-3) / copy_bps,
        })  # fmt: skip
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return {
        "tokens": num_tokens, "distinct_experts_per_layer": distinct, "bytes_per_call": nbytes,
        "reference_ms": ref_ms, "align_ms": align_ms, "default": rows[0], "best": best,
        "speedup_vs_reference": ref_ms / rows[0]["ms"] if "ms" in rows[0] else None,
        "graph_replay_equals_eager": graph_check(layers, num_tokens), "configs": rows,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 2048])
    parser.add_argument("--layers", type=int, default=8, help="distinct 1.2 GB expert stacks per graph")
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_probe needs a CUDA device")
    copy_bps = copy_bandwidth()
    layers = make_layers(args.layers)
    results = []
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + written)")
    print("T     experts  triton ms  ref ms  speedup  GB/s   %copy  max err   graph  best config (ms)")
    for t in args.tokens:
        r = probe(layers, t, args.sweep, copy_bps)
        results.append(r)
        d, b = r["default"], r["best"] or {}
        if "ms" not in d:
            print(f"{t:<5} default config failed: {d['error']}")
            continue
        print(
            f"{t:<5} {r['distinct_experts_per_layer']:7.1f}  {d['ms']:9.3f}  {r['reference_ms']:6.2f}  "
            f"{r['speedup_vs_reference']:7.1f}  {d['gb_per_s']:5.0f}  {100 * d['fraction_of_copy_bw']:5.1f}  "
            f"{d['max_abs_err']:.1e}{'' if d['ok'] else ' BAD'}  {r['graph_replay_equals_eager']!s:5}  "
            f"{b.get('config')} ({b.get('ms', float('nan')):.3f}); align {r['align_ms']:.3f} ms"
        )
    if args.json:
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": copy_bps}
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=1))


if __name__ == "__main__":
    main()
