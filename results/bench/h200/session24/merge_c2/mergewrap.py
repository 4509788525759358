"""Run the sparse-serve CLI with decode_launch.MERGE_MAX_SPLITS from $MERGE_MAX_SPLITS (0: the reduce launch)."""
import os
import runpy
import sys

from sparse_kernels._triton import decode_launch

decode_launch.MERGE_MAX_SPLITS = int(os.environ.get("MERGE_MAX_SPLITS", decode_launch.MERGE_MAX_SPLITS))
print("MERGE_MAX_SPLITS", decode_launch.MERGE_MAX_SPLITS, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
