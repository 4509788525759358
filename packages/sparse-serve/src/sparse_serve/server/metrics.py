"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

Counters and histograms are updated by the engine thread (or, with the engine in its own process,
by the thread that reads its outputs) and read by ``GET /metrics`` on the event loop, so every
update and the rendering take one lock. Gauges (running and waiting requests, KV blocks) are not
stored here: the renderer takes an ``EngineSnapshot``.

Every series is exposed as ``sparse_*`` and the common ones also under vLLM's names (``vllm:*``,
labelled ``model_name``), so Grafana dashboards built for vLLM read this server as they are.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "sparse_"

# Seconds. TTFT spans a queued CPU prefill; per-token latency a fast GPU decode step.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state after its last loop iteration (gauges and the engine's own counters)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_free: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    """Cumulative buckets plus sum and count (not thread-safe: ``ServerMetrics`` locks)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """``labels``: ``key="value"`` pairs (comma-separated) put on every series."""
        out, running = [], 0
        sep, braces = (labels + ",") if labels else "", f"{{{labels}}}" if labels else ""
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{sep}le="{_fmt(bound)}"}} {running}')
        out += [f"{name}_sum{braces} {_fmt(self.sum)}", f"{name}_count{braces} {self.count}"]
        return out


class ServerMetrics:
    """Request-level counters and latency histograms of one server."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)
            self.prompt_tokens += num_prompt_tokens

    def on_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        """``num_tokens`` new tokens of one request, ``gap_s`` after its previous ones (None: the first)."""
        with self._lock:
            self.generation_tokens += num_tokens
            if gap_s is not None:
                for _ in range(num_tokens):
                    self.itl.observe(gap_s / num_tokens)

    def on_finished(self, reason: str, e2e_s: float) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e_s)

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def render(self, snap: EngineSnapshot, model_name: str = "") -> str:
        with self._lock:
            return self._render_sparse(snap) + self._render_vllm(snap, model_name)

    def _render_sparse(self, snap: EngineSnapshot) -> str:
        used = snap.num_kv_blocks_total - snap.num_kv_blocks_free
        lines: list[str] = []
        for name, kind, help_text, value in (
            ("requests_running", "gauge", "Requests in the engine's running batch.", snap.num_running),
            ("requests_waiting", "gauge", "Requests accepted but not yet scheduled.", snap.num_waiting),
            ("kv_blocks_total", "gauge", "KV blocks in the pool.", snap.num_kv_blocks_total),
            (
                "kv_blocks_free",
                "gauge",
                "KV blocks free (evictable cached ones included).",
                snap.num_kv_blocks_free,
            ),
            ("kv_blocks_used", "gauge", "KV blocks held by requests.", used),
            ("prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up.", snap.prefix_query_tokens),
            ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found cached.", snap.prefix_hit_tokens),
            ("preemptions_total", "counter", "Requests preempted for lack of KV.", snap.num_preemptions),
            ("prompt_tokens_total", "counter", "Prompt tokens of started requests.", self.prompt_tokens),
            ("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
        ):
            lines += _header(name, kind, help_text) + [f"{PREFIX}{name} {_fmt(value)}"]
        for name, help_text, label, values in (
            ("requests_finished_total", "Finished requests by reason.", "finish_reason", self.finished),
            ("requests_rejected_total", "Requests refused before the engine.", "reason", self.rejected),
        ):
            lines += _header(name, "counter", help_text)
            lines += [f'{PREFIX}{name}{{{label}="{key}"}} {n}' for key, n in sorted(values.items())]
        for name, help_text, hist in (
            ("time_to_first_token_seconds", "Arrival to first generated token.", self.ttft),
            ("inter_token_latency_seconds", "Time between consecutive tokens of a request.", self.itl),
            ("e2e_request_latency_seconds", "Arrival to the last token (finished requests).", self.e2e),
        ):
            lines += _header(name, "histogram", help_text) + hist.lines(PREFIX + name)
        return "\n".join(lines) + "\n"

    def _render_vllm(self, snap: EngineSnapshot, model_name: str) -> str:
        """The same series under vLLM's names."""
        label = f'model_name="{_escape(model_name)}"'
        total = snap.num_kv_blocks_total
        usage = (total - snap.num_kv_blocks_free) / total if total else 0.0
        lines: list[str] = []
        for name, kind, value in (
            ("num_requests_running", "gauge", snap.num_running),
            ("num_requests_waiting", "gauge", snap.num_waiting),
            ("kv_cache_usage_perc", "gauge", usage),
            ("gpu_cache_usage_perc", "gauge", usage),  # the name before vLLM v1
            ("num_preemptions_total", "counter", snap.num_preemptions),
            ("prefix_cache_queries_total", "counter", snap.prefix_query_tokens),
            ("prefix_cache_hits_total", "counter", snap.prefix_hit_tokens),
            ("prompt_tokens_total", "counter", self.prompt_tokens),
            ("generation_tokens_total", "counter", self.generation_tokens),
        ):
            lines += [f"# TYPE vllm:{name} {kind}", f"vllm:{name}{{{label}}} {_fmt(value)}"]
        lines.append("# TYPE vllm:request_success_total counter")
        lines += [
            f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {n}'
            for reason, n in sorted(self.finished.items())
        ]
        for name, hist in (
            ("time_to_first_token_seconds", self.ttft),
            ("inter_token_latency_seconds", self.itl),
            ("time_per_output_token_seconds", self.itl),  # the name before vLLM v1
            ("e2e_request_latency_seconds", self.e2e),
        ):
            lines += [f"# TYPE vllm:{name} histogram", *hist.lines(f"vllm:{name}", label)]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
