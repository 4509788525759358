"""Run the sparse-serve CLI with every garbage collection of generation 1 or 2 logged (wall time, generation, ms)."""
import gc, json, os, runpy, sys, time
events, start = [], {}
def cb(phase, info):
    if info["generation"] < 1:
        return
    if phase == "start":
        start["t"] = time.perf_counter()
    else:
        events.append((time.time(), info["generation"], (time.perf_counter() - start["t"]) * 1e3))
gc.callbacks.append(cb)
out = sys.argv[1]
sys.argv = ["sparse-serve"] + sys.argv[2:]
try:
    runpy.run_module("sparse_serve.cli", run_name="__main__")
finally:
    json.dump(events, open(out, "w"))
