"""Print one line per run of a `sparse-serve bench` bench.json: ms/step, the median host step and the median gap
between step ends (the GPU-bound step), tok/s, GPU busy ms, GB/step, fraction of copy bandwidth, steps longer than
1.5x the median gap (index: ms) and the stall counters; then each run's top kernels per step. Run scripts call
this instead of carrying their own copy.

    python3 results/bench/engine_summary.py OUT/engine/bench.json [--kernels 16]
"""

from __future__ import annotations

import argparse
import json


def median(xs):
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json")
    ap.add_argument("--kernels", type=int, default=16, help="top kernels to print per run")
    args = ap.parse_args()
    with open(args.bench_json) as f:
        d = json.load(f)
    for inv in d["invocations"]:
        for r in inv["runs"]:
            raw, m = r["raw"], r["metrics"]
            ends = raw["step_end_unix"]
            gaps = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
            gap = median(gaps)
            long = [(i, round(x * 1e3)) for i, x in enumerate(gaps) if x > 1.5 * gap]
            print(
                r["sparse_method"], "ms/step", round(m["ms_per_step"], 3),
                "median host", round(median(raw["step_seconds"]) * 1e3, 2), "median gap", round(gap * 1e3, 2),
                "tok/s", round(m["tokens_per_s"], 1), "busy", raw.get("gpu_kernel_ms_per_step"),
                "GB", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3),
                "long gaps", long, "stalls", raw.get("stalls"),
            )  # fmt: skip
            for k in raw.get("gpu_kernels_top", [])[: args.kernels]:
                print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))


if __name__ == "__main__":
    main()
