"""Session 28: the bench CLI with every engine step synchronized and timed (pipelining effectively off: attribution,
not throughput); steps PROF_LO..PROF_HI (the first decode-time eviction round and its neighbours) under cProfile.
Output: $PROF_OUT.steps.json (rounds = steps whose runner observed requests), $PROF_OUT.host.txt."""
import cProfile, io, json, os, pstats, runpy, sys, time
import torch
import sparse_serve.engine as E
import sparse_serve.model_runner as MR

OUT, LO, HI = os.environ["PROF_OUT"], int(os.environ["PROF_LO"]), int(os.environ["PROF_HI"])
orig_step, orig_run = E.LLMEngine.step, MR.ModelRunner.run
st = {"observed": False, "rounds": [], "steps": []}
prof = cProfile.Profile()


def run(self, *a, **k):
    out = orig_run(self, *a, **k)
    st["observed"] = st["observed"] or bool(getattr(self, "observed", None))
    return out


def step(self):
    i = len(st["steps"])
    torch.cuda.synchronize()
    st["observed"] = False
    if LO <= i <= HI:
        prof.enable()
    t = time.perf_counter()
    out = orig_step(self)
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t)
    if LO <= i <= HI:
        prof.disable()
    if i == HI:
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(70)
        s2 = io.StringIO(); pstats.Stats(prof, stream=s2).sort_stats("tottime").print_stats(40)
        open(OUT + ".host.txt", "w").write(s.getvalue() + "\n\n" + s2.getvalue())
    if st["observed"]:
        st["rounds"].append(i)
    st["steps"].append(round(ms, 3))
    if st["observed"] or i % 128 == 0:
        json.dump({"rounds": st["rounds"], "steps_ms": st["steps"]}, open(OUT + ".steps.json", "w"))
    return out


E.LLMEngine.step, MR.ModelRunner.run = step, run
sys.argv = ["sparse-serve", *sys.argv[1:]]
runpy.run_module("sparse_serve.cli", run_name="__main__")
