"""Session 27: the bench CLI with the cascade's causal squares in the paged Triton kernel (CASCADE_SQUARES off)."""
import runpy, sys
import sparse_kernels.prefix_attention as P

P.CASCADE_SQUARES = False
sys.argv = ["sparse-serve", *sys.argv[1:]]
runpy.run_module("sparse_serve.cli", run_name="__main__")
