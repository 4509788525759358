"""Host cost of cuDNN's fused attention for new vs repeated shapes (the cascade's prefix part).

    python3 benchmarks/cudnn_shape_probe.py

Times ``prefix_attention.attention_with_lse`` on the host (wall clock, device synchronized) for a
sequence of (queries, prefix) shapes as serving produces them (every call a new prefix length), once
with the raw shapes (bucketing off) and once as the cascade runs them (prefix cut to whole steps,
queries padded to a power of two). Qwen3-8B heads (32 / 8, head_dim 128), bf16.
"""

from __future__ import annotations

import json
import random
import time

import torch

from sparse_kernels import prefix_attention as pa


def run(shapes, bucketed: bool) -> list[float]:
    saved = pa.CASCADE_MIN_QUERIES
    if not bucketed:
        pa.CASCADE_MIN_QUERIES = 1
    times = []
    try:
        for t, n in shapes:
            if bucketed:
                n = n // pa.CASCADE_PREFIX_STEP * pa.CASCADE_PREFIX_STEP
            q = torch.randn(t, 32, 128, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pa.attention_with_lse(q, k, v, 0.088)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        pa.CASCADE_MIN_QUERIES = saved
    return times


def main() -> None:
    rng = random.Random(0)
    # Bucketing off: every shape is rounded only if by chance; 1 + prime-ish offsets make them distinct.
    shapes = [(rng.randint(2900, 4096), rng.randint(4096, 36000)) for _ in range(24)]
    raw = run(shapes, bucketed=False)
    rep = run(shapes[:4] * 6, bucketed=False)  # 4 shapes, each repeated
    buck = run(shapes, bucketed=True)
    res = {
        "raw_new_shapes_ms": [round(x * 1e3, 2) for x in raw],
        "raw_repeated_shapes_ms": [round(x * 1e3, 2) for x in rep],
        "bucketed_ms": [round(x * 1e3, 2) for x in buck],
        "shapes": shapes,
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
