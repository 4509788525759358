"""Run the sparse-serve CLI with quantized decode configs from BEST_JSON patched in first."""
import json
import os
import runpy
import sys

from sparse_kernels._triton import quantized_decode_launch as ql

best = json.load(open(os.environ["BEST_JSON"]))
for fam, cfg in best.items():
    (ql.KIVI_DECODE_CONFIG if fam == "kivi" else ql.QUANT_DECODE_CONFIG).update(cfg)
print("configs:", ql.KIVI_DECODE_CONFIG, ql.QUANT_DECODE_CONFIG, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
