"""Run a command-line module (stall_sampler.py or the sparse-serve CLI) with RetroInfer's WIDTH_QUANTUM from $WQ."""
import os
import runpy
import sys

from sparse_methods.methods import retroinfer

retroinfer.WIDTH_QUANTUM = int(os.environ.get("WQ", retroinfer.WIDTH_QUANTUM))
print("WIDTH_QUANTUM", retroinfer.WIDTH_QUANTUM, flush=True)
target = sys.argv[1]
sys.argv = sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__")
