"""Run the sparse-serve CLI with RetroInfer's ranking-logits and estimation settings set to the fastest rows of
a retroinfer_kernel_probe.py --json file (PROBE_JSON)."""
import json
import os
import runpy
import sys

from sparse_kernels._triton import cluster_estimation, cluster_logits

rows = json.load(open(os.environ["PROBE_JSON"]))["settings"]
for kernel, module in (("logits", cluster_logits), ("estimation", cluster_estimation)):
    best = min((r for r in rows if r[0] == kernel), key=lambda r: r[2])
    for key, value in best[1].items():
        setattr(module, key, value)
    print(kernel, "settings:", best[1], round(best[2] * 1e3, 1), "us", flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
