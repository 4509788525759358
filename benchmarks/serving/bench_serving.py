"""Serving benchmark: Poisson arrivals against the OpenAI-compatible server, latency percentiles.

Each request is a streamed ``/v1/completions`` call whose prompt is ``prompt_len`` random token ids
(no shared prefixes) and which generates exactly ``output_len`` tokens (``ignore_eos``), both drawn
uniformly from ``--prompt-lens`` and ``--output-lens``. Arrivals are a Poisson process of rate
``--request-rate`` (``inf``: all at once). Reported per rate: throughput (requests/s, output and
total tokens/s) and TTFT, inter-token latency (ITL, every gap between streamed tokens), time per
output token (TPOT, per request) and end-to-end latency at p50/p90/p99.

Without ``--url`` the script starts ``sparse-serve serve`` in a subprocess (so client and server do
not share an interpreter; the server runs its engine in a process of its own) with every argument
it does not know itself, e.g.

    uv run python benchmarks/serving/bench_serving.py --num-requests 32 --request-rates 4,inf \\
        --prompt-lens 32,128 --output-lens 16,64 --out results/serving/cpu-tiny \\
        --device cpu --max-model-len 512

and writes ``bench.json`` (settings, per-run summary, per-request records) and ``bench.md``.
Prompt token ids are drawn from ``[100, --max-token-id)``, valid for any tokenizer of at least
4,000 entries (the embedded tiny model has 4,096).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_workload(n: int, prompt_lens: list[int], output_lens: list[int], rate: float, max_token_id: int, seed: int):
    """``n`` requests: (arrival offset s, prompt token ids, output length), Poisson arrivals at ``rate``/s."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        prompt = [rng.randrange(100, max_token_id) for _ in range(rng.choice(prompt_lens))]
        out.append((t, prompt, rng.choice(output_lens)))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


async def _one(client: httpx.AsyncClient, url: str, model: str, start: float, prompt: list[int], n_out: int) -> dict:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n_out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    token_times, usage, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                    elif chunk["choices"]:
                        token_times.append(time.perf_counter())  # one chunk per engine step per request
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    done = time.perf_counter()
    return {
        "prompt_len": len(prompt),
        "output_len": n_out,
        "completion_tokens": usage["completion_tokens"] if usage else len(token_times),
        "sent": sent,
        "ttft": token_times[0] - sent if token_times else None,
        "itls": [b - a for a, b in zip(token_times, token_times[1:], strict=False)],
        "e2e": done - sent,
        "error": error,
    }


async def run_rate(url: str, model: str, workload: list, warmup: list = ()) -> tuple[list[dict], float]:
    """Send ``warmup`` one by one (unmeasured), then ``workload`` at its arrival times.

    Returns the per-request records of ``workload`` and the run's duration in seconds.
    """
    limits = httpx.Limits(max_connections=len(workload) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        for _, prompt, n_out in warmup:
            await _one(client, url, model, 0.0, prompt, n_out)
        t0 = time.perf_counter()
        tasks = [_one(client, url, model, t0 + start, prompt, n_out) for start, prompt, n_out in workload]
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    for r in records:  # seconds from the run's start, microsecond resolution
        r["sent"] = round(r["sent"] - t0, 6)
        r["itls"] = [round(x, 6) for x in r["itls"]]
    return records, duration


def summarize(records: list[dict], duration: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itls"]]
    tpot = [sum(r["itls"]) / len(r["itls"]) for r in ok if r["itls"]]
    e2e = [r["e2e"] for r in ok]

    def pct(xs):  # milliseconds
        return {f"p{q}": (None if (v := percentile(xs, q)) is None else round(v * 1e3, 2)) for q in (50, 90, 99)} | {
            "mean": round(sum(xs) / len(xs) * 1e3, 2) if xs else None
        }

    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 1),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 1),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": pct(ttft),
        "itl_ms": pct(itl),
        "tpot_ms": pct(tpot),
        "e2e_ms": pct(e2e),
    }


def markdown(runs: list[dict]) -> str:
    head = (
        "| rate (req/s) | requests | done | duration s | req/s | out tok/s | total tok/s "
        "| TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def three(d):
        return " / ".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))

    rows = []
    for run in runs:
        s = run["summary"]
        rows.append(
            f"| {run['request_rate']} | {s['num_requests']} | {s['completed']} | {s['duration_s']:.1f} "
            f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.0f} | {s['total_token_throughput']:.0f} "
            f"| {three(s['ttft_ms'])} | {three(s['itl_ms'])} | {three(s['tpot_ms'])} |"
        )
    return head + "\n".join(rows) + "\n"


def server_metrics(url: str) -> dict[str, float]:
    """Counters and gauges of the server's /metrics (histograms left out)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {k: float(v) for k, v in pairs if not any(s in k for s in ("_bucket", "_sum", "_count"))}


# -- server process -------------------------------------------------------------------------------
def start_server(serve_args: list[str], port: int, timeout_s: float, log: Path) -> tuple[subprocess.Popen, str]:
    """``sparse-serve serve`` in a subprocess logging to ``log``; returns once /health answers."""
    cmd = [sys.executable, "-m", "sparse_serve.cli", "serve", "--port", str(port), *serve_args]
    print("starting:", " ".join(cmd), f"(log: {log})", file=sys.stderr)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:]
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, force: bool = False) -> None:
    """Ctrl-C the server (a second one when ``force``: no drain of open requests); kill it if it hangs."""
    proc.send_signal(signal.SIGINT)
    if force:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20 if force else 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _environment(url: str, serve_args: list[str], commit: str | None) -> dict:
    env = {"server": url, "serve_args": serve_args, "python": platform.python_version(), "host": platform.node()}
    env["commit"] = commit or _git_commit()
    try:
        import torch

        env["torch"] = torch.__version__
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return env


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other arguments go to `sparse-serve serve`."
    )
    p.add_argument("--url", help="a running server (default: start one with the other arguments)")
    p.add_argument("--served-model-name", help="model name to request (default: the server's only model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rates", default="inf", help="comma-separated requests/s per run; inf = all at once")
    p.add_argument("--prompt-lens", type=_ints, default=[128, 512], help="prompt lengths (tokens) drawn uniformly")
    p.add_argument("--output-lens", type=_ints, default=[64, 128], help="output lengths (tokens) drawn uniformly")
    p.add_argument("--max-token-id", type=int, default=4000, help="prompt ids are drawn from [100, this)")
    p.add_argument("--num-warmup", type=int, default=2, help="unmeasured requests before each run")
    p.add_argument("--seed", type=int, default=0, help="workload seed; run i uses seed + i (no prefix reuse)")
    p.add_argument("--port", type=int, default=8100, help="port of the started server")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--out", type=Path, default=Path("results/serving/latest"), help="folder for bench.json / bench.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args, serve_args = build_parser().parse_known_args(argv)
    rates = [float(r) for r in args.request_rates.split(",")]
    if args.url:
        proc, url = None, args.url.rstrip("/")
    else:
        proc, url = start_server(serve_args, args.port, args.startup_timeout_s, args.out / "server.log")
    try:
        model = args.served_model_name or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        result = {
            "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "model": model},
            "environment": _environment(url, serve_args, args.commit),
            "runs": [],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        for i, rate in enumerate(rates):
            lens = (args.prompt_lens, args.output_lens)
            workload = make_workload(args.num_requests, *lens, rate, args.max_token_id, args.seed + i)
            # Far from every run's seed (random.Random(-n) equals Random(n), so negatives collide).
            warmup_seed = 1_000_003 + args.seed + i
            warmup = make_workload(args.num_warmup, *lens, math.inf, args.max_token_id, warmup_seed)
            asyncio.run(run_rate(url, model, [], warmup))
            before = server_metrics(url)
            records, duration = asyncio.run(run_rate(url, model, workload))
            after = server_metrics(url)
            summary = summarize(records, duration)
            counters = ("sparse_preemptions_total", "sparse_prefix_cache_hit_tokens_total")
            server = {k: after.get(k, 0) - before.get(k, 0) for k in counters} | {
                "sparse_kv_blocks_total": after.get("sparse_kv_blocks_total")
            }
            result["runs"].append({"request_rate": rate, "summary": summary, "server": server, "requests": records})
            _write(args.out, result)  # after every run: a later failure keeps the earlier numbers
            print(markdown(result["runs"][-1:]), file=sys.stderr)
    except KeyboardInterrupt:  # out of time (run_h200_long.sh's timeout): keep the finished rates
        print("interrupted; the finished rates are written", file=sys.stderr)
        if proc is not None:
            stop_server(proc, force=True)
        return 130
    finally:
        if proc is not None and proc.poll() is None:
            stop_server(proc)
    print(markdown(result["runs"]))
    return 0


def _write(out: Path, result: dict) -> None:
    (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    env, s = result["environment"], result["settings"]
    lines = [
        f"# Serving benchmark: {s['model']}",
        "",
        f"commit `{env.get('commit')}`, GPU {env.get('gpu') or 'none (CPU)'}, torch {env.get('torch')}, "
        f"server args `{' '.join(env['serve_args']) or '(external server)'}`",
        "",
        f"{s['num_requests']} requests per rate, prompt lengths {s['prompt_lens']}, output lengths "
        f"{s['output_lens']} (uniform, ignore_eos, greedy, streamed), {s['num_warmup']} warmup requests.",
        "",
        markdown(result["runs"]),
    ]
    (out / "bench.md").write_text("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
