"""Session 26: the bench CLI with its third timed prefill under the profiler (busy time against wall time)."""
import json, os, runpy, sys, time
import sparse_serve.bench.decode as D
from sparse_serve.bench.prefill import prefill_done, synchronize
from sparse_serve.bench.probes import profile_events

orig = D.run_prefill
calls = {"n": 0}


def run_prefill(engine):
    calls["n"] += 1
    if calls["n"] != int(os.environ.get("PROF_CALL", "3")):
        return orig(engine)
    synchronize(engine.runner.device)
    t = time.perf_counter()
    out = profile_events(engine.step, 10**6, lambda: not prefill_done(engine), cuda=True, top=30)
    synchronize(engine.runner.device)
    wall = time.perf_counter() - t
    steps = out.get("profiled_steps", 0)
    rep = {"wall_s_profiled": wall, "steps": steps, "busy_s": out.get("busy_ms_per_step", 0) * steps / 1e3,
           "top": [{**r, "ms_total": r["ms_per_step"] * steps} for r in out.get("top", [])]}
    with open(os.environ["PROF_OUT"], "w") as f:
        json.dump(rep, f, indent=1)
    print("PROFILED prefill: wall %.2f s, busy %.2f s, %d steps" % (wall, rep["busy_s"], steps), flush=True)
    return wall, steps


D.run_prefill = run_prefill
sys.argv = ["sparse-serve", *sys.argv[1:]]
runpy.run_module("sparse_serve.cli", run_name="__main__")
