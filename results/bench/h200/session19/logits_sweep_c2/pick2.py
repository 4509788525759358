"""From decode_bandwidth.py --logits JSON (batch 5): the fastest LOGITS_DECODE_CONFIG if > 3% faster than the default."""
import json
import sys

rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["batch"] == 5]
base = rows[0]["us"]
best = min(rows, key=lambda r: r["us"])
pick = {}
if best["us"] < 0.97 * base:
    pick = {k: best[k] for k in ("BLOCK_N", "num_warps", "num_stages")}
print("default", base, "best", best["us"], pick)
json.dump(pick, open(sys.argv[2], "w"))
