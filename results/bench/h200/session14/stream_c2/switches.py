"""Run the sparse-serve CLI with the model's residual stream on or off and a decode split target:
switches.py STREAM(0/1) PER_SM -- CLI args."""
import runpy, sys
import sparse_kernels._decode_buffers as buffers
from sparse_models.models import llama
if sys.argv[1] == "0":
    llama.LlamaModel.streams = lambda self: False
buffers.PROGRAMS_PER_SM = int(sys.argv[2])
sys.argv = ["sparse-serve"] + sys.argv[3:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
