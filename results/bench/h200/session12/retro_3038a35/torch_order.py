"""Run `sparse-serve` with RetroInfer's ranking order on torch's path (softmax + stable sort) instead of Triton's."""
import runpy
import sys

import sparse_kernels.cluster_order as co

_orig = co.cluster_order


def _torch_order(logits, sizes, top, *, tile_max=None, tile_sum=None, backend="auto"):
    return _orig(logits, sizes, top, backend="reference")


co.cluster_order = _torch_order
sys.argv = ["sparse-serve", *sys.argv[1:]]
runpy.run_module("sparse_serve.cli", run_name="__main__")
