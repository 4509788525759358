"""Run the sparse-serve CLI with cluster_logits' launch shape from $BEST_JSON patched in first."""
import json
import os
import runpy
import sys

from sparse_kernels._triton import cluster_logits as m

best = json.load(open(os.environ["BEST_JSON"]))
for k, v in best.items():
    setattr(m, k, v)
print("cluster_logits shape:", best, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
