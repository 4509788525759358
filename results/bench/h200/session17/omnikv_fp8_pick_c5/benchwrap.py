"""Run the sparse-serve CLI with the fp8 logits configs from BEST_JSON patched in first."""
import json
import os
import runpy
import sys

from sparse_kernels._triton import logits_attention as la
from sparse_kernels._triton import paged_logits as pl

best = json.load(open(os.environ["BEST_JSON"]))
pl.FP8_CONFIG.update(best["paged_logits"])
la.FP8_CONFIG.update(best["logits_attention"])
print("configs:", pl.FP8_CONFIG, la.FP8_CONFIG, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
