"""Run the sparse-serve CLI with LOGITS_DECODE_CONFIG from BEST_JSON patched in first."""
import json
import os
import runpy
import sys

from sparse_kernels._triton import decode_launch as dl

dl.LOGITS_DECODE_CONFIG.update(json.load(open(os.environ["BEST_JSON"])))
print("logits config:", dl.LOGITS_DECODE_CONFIG, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
