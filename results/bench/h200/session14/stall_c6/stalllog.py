"""Run the sparse-serve CLI logging what may stall the host: selecting-graph captures, eager (ungraphed) decode
forwards, Triton compiles (cache misses of a kernel's specializations), wrapper plans and GC. stalllog.py OUT.json -- CLI args."""
import gc, json, runpy, sys, time
events = []
def log(kind, name, t0):
    events.append((time.time(), kind, name, (time.perf_counter() - t0) * 1e3))
from sparse_serve import cuda_graphs
orig_cap = cuda_graphs.DecodeGraphs._capture_selecting
def cap(self, key, bs):
    t0 = time.perf_counter(); r = orig_cap(self, key, bs); log("capture", str(key[:4]), t0); return r
cuda_graphs.DecodeGraphs._capture_selecting = cap
orig_run = cuda_graphs.DecodeGraphs.run
def run(self, meta, feed=None):
    t0 = time.perf_counter(); before = self.num_replays
    r = orig_run(self, meta, feed)
    if self.num_replays == before:
        log("eager", str(meta.num_tokens), t0)
    return r
cuda_graphs.DecodeGraphs.run = run
from triton.runtime import jit
orig_do = jit.JITFunction._do_compile
def do(self, *a, **k):
    t0 = time.perf_counter(); r = orig_do(self, *a, **k); log("triton", getattr(self, "__name__", "?"), t0); return r
jit.JITFunction._do_compile = do
from sparse_kernels import paged_decode
orig_plan = paged_decode.BatchDecodeWithPagedKVCache.plan
def plan(self, *a, **k):
    t0 = time.perf_counter(); r = orig_plan(self, *a, **k)
    if (time.perf_counter() - t0) > 0.002:
        log("plan>2ms", str(k.get("head_sparse")), t0)
    return r
paged_decode.BatchDecodeWithPagedKVCache.plan = plan
start = {}
def cb(phase, info):
    if phase == "start":
        start["t"] = time.perf_counter()
    elif info["generation"] >= 1:
        log("gc", str(info["generation"]), start["t"])
gc.callbacks.append(cb)
out = sys.argv[1]
sys.argv = ["sparse-serve"] + sys.argv[2:]
try:
    runpy.run_module("sparse_serve.cli", run_name="__main__")
finally:
    json.dump(events, open(out, "w"))
