"""Run the sparse-serve CLI with the decode split target for lists that do not cover every SM set:
split_target.py PER_SM -- CLI args (sparse_kernels._decode_buffers.PROGRAMS_PER_SM, default 8)."""
import runpy, sys
import sparse_kernels._decode_buffers as buffers
buffers.PROGRAMS_PER_SM = int(sys.argv[1])
sys.argv = ["sparse-serve"] + sys.argv[2:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
