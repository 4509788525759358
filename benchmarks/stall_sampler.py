"""Where a long decode step's time goes: runs ``sparse-serve bench`` with two recorders on every engine step.

- Host: a sampler thread takes the main thread's Python stack every ``--interval-ms`` (default 0.5 ms), so
  the frames a long step spent its time in can be counted.
- Device: a CUDA event is recorded on the current stream right before each ``step()`` call; with the
  engine's steps pipelined, consecutive events are one step of device time apart while the device is the
  bottleneck. A long step whose device interval is long while the host was waiting points at the device
  (or at something that drained it); a long host step with a normal device interval was hidden.

After the run, every step over ``--factor`` times the median (per bench run) is printed with its host
and device milliseconds and the innermost frames the sampler saw most often during it.

    python3 benchmarks/stall_sampler.py [--interval-ms 0.5] [--factor 1.6] -- bench --prompt-len ... [bench args]
"""

from __future__ import annotations

import argparse
import collections
import runpy
import statistics
import sys
import threading
import time
import traceback

import torch

from sparse_serve.engine import LLMEngine

STEPS: list[dict] = []  # per engine step: host start / end, the event recorded before it, the engine's id
SAMPLES: list[tuple[float, tuple[str, ...]]] = []


def _sampler(main_id: int, interval: float, stop: threading.Event) -> None:
    while not stop.is_set():
        frame = sys._current_frames().get(main_id)
        if frame is not None:
            stack = traceback.extract_stack(frame)[-6:]
            names = tuple(f"{f.name}@{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack)
            SAMPLES.append((time.perf_counter(), names))
        time.sleep(interval)


def _patch_step() -> None:
    real_step = LLMEngine.step

    def step(self):
        event = None
        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        start, unix = time.perf_counter(), time.time()
        out = real_step(self)
        STEPS.append({"engine": id(self), "start": start, "end": time.perf_counter(), "event": event, "unix": unix})
        return out

    LLMEngine.step = step


def _report(factor: float) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    runs = collections.defaultdict(list)
    for s in STEPS:
        runs[s["engine"]].append(s)
    for n, steps in enumerate(runs.values()):
        host = [(s["end"] - s["start"]) * 1e3 for s in steps]
        device = [
            a["event"].elapsed_time(b["event"]) if a["event"] is not None else float("nan")
            for a, b in zip(steps, steps[1:], strict=False)
        ] + [float("nan")]
        tail = host[-300:]  # the timed decode and its warm-up: the last steps of a bench run
        median = statistics.median(tail)
        print(f"\n== engine {n}: {len(steps)} steps, median host step {median:.2f} ms (last {len(tail)})")
        for i, ms in enumerate(host):
            if i < len(host) - 300 or ms <= factor * median:
                continue
            s = steps[i]
            inside = [stack for t, stack in SAMPLES if s["start"] <= t <= s["end"]]
            frames = collections.Counter(stack[-1] for stack in inside)
            deep = collections.Counter(" < ".join(stack[-3:]) for stack in inside)
            print(f"step {i} (unix {s['unix']:.3f}): host {ms:.2f} ms, device interval {device[i]:.2f} ms, "
                  f"{len(inside)} samples; neighbours' device {device[max(0, i - 2):i + 3]}")  # fmt: skip
            for frame, count in frames.most_common(4):
                print(f"    {count:4d}  {frame}")
            for frame, count in deep.most_common(2):
                print(f"    {count:4d}  {frame}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-ms", type=float, default=0.5)
    ap.add_argument("--factor", type=float, default=1.6)
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the sparse-serve CLI arguments")
    args = ap.parse_args()
    cli = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    _patch_step()
    stop = threading.Event()
    thread = threading.Thread(target=_sampler, args=(threading.main_thread().ident, args.interval_ms / 1e3, stop))
    thread.daemon = True
    thread.start()
    sys.argv = ["sparse_serve.cli", *cli]
    try:
        runpy.run_module("sparse_serve.cli", run_name="__main__")
    except SystemExit:
        pass
    finally:
        stop.set()
        _report(args.factor)


if __name__ == "__main__":
    main()
