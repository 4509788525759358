"""Run the sparse-serve CLI with the decode bench's per-step slot count (``_step_kv_tokens``, a Python loop over
requests x selecting layers between timed steps) computed every 64th step only and reused between: shows how
much of a method's wall time per step is the bench's own bookkeeping. lightbench.py -- CLI args."""
import runpy, sys
import sparse_serve.bench.decode as dec
orig = dec._step_kv_tokens
state = {"n": 0, "last": None}
def sampled(engine):
    if state["last"] is None or state["n"] % 64 == 0:
        state["last"] = orig(engine)
    state["n"] += 1
    return state["last"]
dec._step_kv_tokens = sampled
sys.argv = ["sparse-serve"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
