"""Session 27: the bench CLI with its decode-time eviction rounds examined. Every engine step is synchronized and
its wall time logged (so pipelining is off in this run: attribution, not throughput). Rounds are the steps whose
runner observed requests; with a pipelined engine a round's compaction completes in the next step() call, so each
profile covers the round's step and the next: round 3 on the host (cProfile), round 4 on the device (torch.profiler
CPU + CUDA tables). Output: $PROF_OUT.steps.json, .host.txt, .dev.txt."""
import cProfile, io, json, os, pstats, runpy, sys, time
import torch
SYNC = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
import sparse_serve.engine as E
import sparse_serve.model_runner as MR

OUT = os.environ["PROF_OUT"]
orig_step, orig_run = E.LLMEngine.step, MR.ModelRunner.run
st = {"observed": False, "rounds": [], "steps": [], "prof": None}


def run(self, *a, **k):
    out = orig_run(self, *a, **k)
    st["observed"] = st["observed"] or bool(self.observed)
    return out


def round_index(k):  # the step index of round k (1-based) once two rounds are seen
    r = st["rounds"]
    return r[0] + (k - 1) * (r[1] - r[0]) if len(r) >= 2 else None


def step(self):
    i = len(st["steps"])
    SYNC()
    st["observed"] = False
    if i == round_index(3):
        st["prof"] = ("host", cProfile.Profile()); st["prof"][1].enable()
    elif i == round_index(4):
        from torch.profiler import ProfilerActivity, profile
        st["prof"] = ("dev", profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])); st["prof"][1].__enter__()
    t = time.perf_counter()
    out = orig_step(self)
    SYNC()
    ms = 1e3 * (time.perf_counter() - t)
    if st["prof"] is not None and i in (round_index(3) + 1 if round_index(3) is not None else -1,
                                        round_index(4) + 1 if round_index(4) is not None else -1):
        kind, p = st["prof"]; st["prof"] = None
        if kind == "host":
            p.disable()
            s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(80)
            s2 = io.StringIO(); pstats.Stats(p, stream=s2).sort_stats("tottime").print_stats(40)
            open(OUT + ".host.txt", "w").write(s.getvalue() + "\n\n" + s2.getvalue())
        else:
            p.__exit__(None, None, None)
            ka = p.key_averages()
            open(OUT + ".dev.txt", "w").write(ka.table(sort_by="self_cpu_time_total", row_limit=50) + "\n\n"
                                             + ka.table(sort_by="self_device_time_total", row_limit=30))
    if st["observed"]:
        st["rounds"].append(i)
    st["steps"].append(round(ms, 3))
    if st["observed"] or i % 256 == 0:
        json.dump({"rounds": st["rounds"], "steps_ms": st["steps"]}, open(OUT + ".steps.json", "w"))
    return out


E.LLMEngine.step, MR.ModelRunner.run = step, run
sys.argv = ["sparse-serve", *sys.argv[1:]]
runpy.run_module("sparse_serve.cli", run_name="__main__")
