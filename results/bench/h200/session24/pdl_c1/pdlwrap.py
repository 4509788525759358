"""Run the sparse-serve CLI with the PDL variant in $PDL_SPEC ('+'-joined pfN / rel / small) patched in first."""
import os
import runpy
import sys

from sparse_kernels._triton import launch
from sparse_kernels._triton import linear as L

spec = set(os.environ.get("PDL_SPEC", "").split("+")) - {""}
for t in spec:
    if t.startswith("pf"):
        L.PREFETCH_K = int(t[2:])
L.RELEASE_EARLY = "rel" in spec
launch.EARLY_SMALL = "small" in spec
print("pdl variant:", L.PREFETCH_K, L.RELEASE_EARLY, launch.EARLY_SMALL, flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
