"""Run the sparse-serve CLI with decode configs from BEST_JSON (the probe's pick) patched in first."""
import json, os, runpy, sys
import sparse_kernels._decode_buffers as buffers
from sparse_kernels._triton import quantized_decode_launch as ql
best = json.load(open(os.environ["BEST_JSON"]))
for fam, cfg in best.items():
    for key, val in cfg.items():
        if key == "per_sm":
            if fam == "kivi":
                continue  # one knob for every quantized store: kept at the fp8 pick only
            buffers.QUANTIZED_PROGRAMS_PER_SM = val
        elif fam == "kivi":
            ql.KIVI_DECODE_CONFIG[key] = val
        else:
            ql.QUANT_DECODE_CONFIG[key] = val
print("configs:", ql.KIVI_DECODE_CONFIG, ql.QUANT_DECODE_CONFIG, buffers.QUANTIZED_PROGRAMS_PER_SM, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
