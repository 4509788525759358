"""Run the sparse-serve CLI with the kernels' overlap switches set: switches.py EARLY(0/1) PREFETCH_MIB -- CLI args.
(The switches, launch.EARLY_RELEASE and linear.L2_PREFETCH_BYTES, existed only in the uncommitted tree this call ran;
they were measured slower and not kept: benchmarks/NOTES.md, session 14.)"""
import runpy, sys
from sparse_kernels._triton import launch
from sparse_kernels._triton import linear
launch.EARLY_RELEASE = sys.argv[1] == "1"
linear.L2_PREFETCH_BYTES = int(sys.argv[2]) << 20
sys.argv = ["sparse-serve"] + sys.argv[3:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
