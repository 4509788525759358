"""Best fp8 launch per kernel from the probe's JSON lines: the smallest sum of times over the batches."""
import json
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
best = {}
for kernel, keys in (("paged_logits", ("block_n", "warps", "stages")), ("logits_attention", ("block_n", "warps", "stages", "per_sm"))):
    total = defaultdict(float)
    count = defaultdict(int)
    for r in rows:
        if r["kernel"] == kernel and r["fp8"] and "us" in r:
            key = tuple(r[k] for k in keys)
            total[key] += r["us"]
            count[key] += 1
    n = max(count.values())
    key = min((k for k in total if count[k] == n), key=total.get)
    names = {"block_n": "BLOCK_N", "warps": "num_warps", "stages": "num_stages", "per_sm": "programs_per_sm"}
    best[kernel] = {names[k]: v for k, v in zip(keys, key)}
    for fp8 in (False, True):
        for r in rows:
            if r["kernel"] == kernel and r["fp8"] == fp8 and "us" in r and tuple(r[k] for k in keys) in (key, (64, 4, 3) + ((8,) if len(keys) == 4 else ())):
                print(kernel, "fp8" if fp8 else "bf16", r)
json.dump(best, open(sys.argv[2], "w"))
print(json.dumps(best))
