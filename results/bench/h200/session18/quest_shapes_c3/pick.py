"""From the probe's JSON: the fastest page-bounds (prmt, bf16) launch shape and Quest bf16 top-k variant at batch 5,
written as a JSON of CONFIG overrides (only where faster than the default by > 3%)."""
import json
import re
import sys

sys.path.insert(0, "benchmarks")
import quest_select_probe as probe  # noqa: E402

rows = json.load(open(sys.argv[1]))["batches"]["5"]
best = {"page_bounds": {}, "top_k": {}}
base = next(r["us"] for r in rows if r["kernel"] == "page_bounds int8 prmt bf16 (graph)")
cands = [(r["us"], r["kernel"]) for r in rows if r["kernel"].strip().startswith("cfg prmt bf16")]
if cands:
    us, name = min(cands)
    if us < 0.97 * base:
        bp, w, st = map(int, re.search(r"BLOCK_P=(\d+) w(\d+) s(\d+)", name).groups())
        best["page_bounds"] = {"BLOCK_P": bp, "num_warps": w, "num_stages": st}
tk = {r["kernel"]: r["us"] for r in rows if r["kernel"].startswith("quest bf16 top-k ")}
base_tk = next(us for k, us in tk.items() if "serial (default)" in k)
us, name = min((us, k) for k, us in tk.items())
if us < 0.97 * base_tk:
    variant = re.match(r"quest bf16 top-k (.*) \[", name).group(1)
    best["top_k"] = probe.TOPK_VARIANTS[variant]
print(json.dumps(best))
json.dump(best, open(sys.argv[2], "w"))
