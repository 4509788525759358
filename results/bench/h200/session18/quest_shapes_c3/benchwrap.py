"""Run the sparse-serve CLI with the page-bounds / top-k CONFIG overrides of BEST_JSON patched in first."""
import json
import os
import runpy
import sys

from sparse_kernels._triton import page_bounds as pb
from sparse_kernels._triton import top_k_ascending as tk

best = json.load(open(os.environ["BEST_JSON"]))
pb.CODES_CONFIG.update(best["page_bounds"])
tk.CONFIG.update(best["top_k"])
print("configs:", pb.CODES_CONFIG, tk.CONFIG, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
