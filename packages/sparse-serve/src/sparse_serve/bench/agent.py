"""Agent workload: concurrent multi-turn sessions in a closed loop, timed end to end.

Each of ``num_sessions`` sessions starts with a system prompt (the same for every session of a run,
so a radix cache shares it) plus a task of its own, then for ``num_turns - 1`` more turns appends a
tool output of random tokens to its whole history (prompts and generated tokens) and generates
``output_tokens`` more (``ignore_eos``). A session's next turn is submitted as soon as its previous
turn finishes, so ``num_sessions`` requests are always in the engine.

How a turn reaches the engine depends on the method's prefix-cache mode:

- ``radix`` (dense, token-exact KV): the prompt is the whole history as token ids; the prefix cache
  serves what it still holds (``num_cached_tokens``) and the rest is prefilled again.
- ``chain`` (SnapKV, H2O, ...: evicted KV): the turn names the session's ``chain_id`` and sends only
  the new tokens (``chain_append_start`` = the history's length); the chain's retained KV is
  resumed (``reused_tokens``) and only the tool output (plus the last sampled token, whose KV the
  previous turn never computed) is prefilled. Chains are dropped when their session ends.

Token ids are random with a per-run seed, so runs on one engine share no prefix.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from sparse_methods import PrefixCacheMode
from sparse_serve.engine import LLMEngine
from sparse_serve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """The shape of one run.

    tool_tokens : (min, max) tokens of each later turn's tool output, drawn uniformly per turn.
    seed : seeds every token id of the run (system prompt, tasks, tool outputs).
    """

    num_sessions: int
    num_turns: int
    system_tokens: int
    task_tokens: int
    tool_tokens: tuple[int, int]
    output_tokens: int
    seed: int = 0

    def __post_init__(self):
        if self.num_sessions < 1 or self.num_turns < 1 or self.output_tokens < 1:
            raise ValueError("num_sessions, num_turns and output_tokens must be >= 1")
        if self.system_tokens + self.task_tokens < 1 or not 1 <= self.tool_tokens[0] <= self.tool_tokens[1]:
            raise ValueError("need a non-empty first prompt and 1 <= tool_tokens min <= max")

    @property
    def max_session_tokens(self) -> int:
        """Longest history a session can reach (prompt + output of its last turn)."""
        first = self.system_tokens + self.task_tokens
        return first + (self.num_turns - 1) * self.tool_tokens[1] + self.num_turns * self.output_tokens


@dataclass(slots=True)
class _Session:
    index: int
    chain_id: str | None
    turns: list[list[int]]  # the new tokens of each turn: system + task, then tool outputs
    history: list[int] = field(default_factory=list)  # every prompt and output token so far
    turn: int = 0


@dataclass(slots=True)
class _Turn:
    """One request of a session, with its times (seconds since the run started)."""

    session: int
    turn: int
    request_id: str
    prompt_tokens: int  # the whole logical prompt (history + new tokens)
    new_tokens: int  # what the driver sent beyond the history
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # radix prefix-cache hits
    reused_tokens: int = 0  # chain KV resumed
    chain_status: str | None = None
    prefilled_tokens: int = 0  # prompt rows the model computed (recomputes after preemption included)


def make_sessions(workload: AgentWorkload, vocab_size: int, chains: bool) -> list[_Session]:
    """Every session's turns as random token ids (deterministic in ``workload.seed``)."""
    rng = random.Random(workload.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    system = tokens(workload.system_tokens)
    sessions = []
    for i in range(workload.num_sessions):
        turns = [system + tokens(workload.task_tokens)]
        turns += [tokens(rng.randint(*workload.tool_tokens)) for _ in range(workload.num_turns - 1)]
        sessions.append(_Session(i, f"agent-{workload.seed}-{i}" if chains else None, turns))
    return sessions


class _PrefillCounter:
    """Wraps ``engine.runner.run`` for the run: prompt rows computed per request, step counts, and time
    by step kind.

    ``run`` only queues a step on a GPU (its sampled tokens are read later), so on CUDA the time of a
    step is taken between two events recorded around the call, read once when the run is over
    (``device_seconds``): the device's time from the step's first queued work to its last, compaction
    and block copies between steps excluded. ``host_seconds`` is the time spent inside the call.
    """

    def __init__(self, engine: LLMEngine):
        self.engine, self.run = engine, engine.runner.run
        self.prefill: Counter = Counter()
        self.steps: Counter = Counter()
        self.host_seconds: Counter = Counter()
        self._cuda = engine.runner.device.type == "cuda"
        self._events: list[tuple[str, object, object]] = []

    def __call__(self, meta, *args, **kwargs):
        prefill = [s for s in meta.steps if not s.is_decode]
        for s in prefill:
            self.prefill[s.request_id] += s.num_new_tokens
        kind = "mixed" if prefill and meta.num_decode_tokens else "prefill" if prefill else "decode"
        if self._cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        sampled = self.run(meta, *args, **kwargs)
        self.host_seconds[kind] += time.perf_counter() - start
        if self._cuda:
            end.record()
            self._events.append((kind, begin, end))
        self.steps[kind] += 1
        return sampled

    def device_seconds(self) -> dict[str, float]:
        """Seconds by step kind on the device (CUDA events; on CPU the host time, which is the work)."""
        if not self._cuda:
            return dict(self.host_seconds)
        torch.cuda.synchronize(self.engine.runner.device)
        out: Counter = Counter()
        for kind, begin, end in self._events:
            out[kind] += begin.elapsed_time(end) / 1000
        return dict(out)

    def __enter__(self):
        self.engine.runner.run = self
        return self

    def __exit__(self, *exc):
        del self.engine.runner.run  # the instance attribute goes; the class's method is back


def run_agent_workload(engine: LLMEngine, workload: AgentWorkload) -> dict:
    """Drive ``workload`` to completion on an idle engine; returns the run's settings, summary and turns."""
    chains = engine.method.prefix_cache_mode is PrefixCacheMode.CHAIN
    sessions = make_sessions(workload, engine.runner.model_config.vocab_size, chains)
    params = SamplingParams(max_tokens=workload.output_tokens, temperature=0.0, ignore_eos=True)
    kv, sched = engine.kv, engine.scheduler
    before = (sched.num_preemptions, kv.pool.num_evictions, kv.prefix_hit_tokens)
    live: dict[str, tuple[_Session, _Turn]] = {}
    turns: list[_Turn] = []
    peak_blocks, num_steps = 0, 0
    t0 = time.perf_counter()

    def submit(s: _Session) -> None:
        new = s.turns[s.turn]
        if chains and s.turn:
            rid = engine.add_request(new, params, chain_id=s.chain_id, chain_append_start=len(s.history))
        else:
            rid = engine.add_request(s.history + new, params, chain_id=s.chain_id)
        turn = _Turn(s.index, s.turn, rid, len(s.history) + len(new), len(new), time.perf_counter() - t0)
        live[rid] = (s, turn)
        turns.append(turn)

    with _PrefillCounter(engine) as counter:
        for s in sessions:
            submit(s)
        while live:
            outputs = engine.step()
            num_steps += 1
            now = time.perf_counter() - t0
            peak_blocks = max(peak_blocks, kv.pool.num_used_blocks)
            for out in outputs:
                s, turn = live[out.request_id]
                if turn.first_token is None:
                    turn.first_token = now
                if not out.finished:
                    continue
                del live[out.request_id]
                turn.finished, turn.output_tokens = now, len(out.token_ids)
                turn.cached_tokens, turn.reused_tokens = out.num_cached_tokens, out.reused_tokens
                turn.chain_status = out.chain_status
                turn.prefilled_tokens = counter.prefill.pop(out.request_id, 0)
                s.history = [*out.prompt_token_ids, *out.token_ids]
                s.turn += 1
                if s.turn < workload.num_turns:
                    submit(s)
                elif chains:
                    engine.drop_chain(s.chain_id)
        wall = time.perf_counter() - t0
    engine_counts = {
        "steps": num_steps,
        "steps_by_kind": dict(counter.steps),
        "run_seconds_by_kind": counter.device_seconds(),  # forward + sampling, by step kind (see _PrefillCounter)
        "run_host_seconds_by_kind": dict(counter.host_seconds),  # inside runner.run on the host
        "preemptions": sched.num_preemptions - before[0],
        "prefix_cache_evicted_blocks": kv.pool.num_evictions - before[1],
        "prefix_hit_tokens_engine": kv.prefix_hit_tokens - before[2],
        "peak_kv_blocks_in_use": peak_blocks,
        "peak_kv_bytes_in_use": peak_blocks * engine.runner.kv_bytes_per_pool_block,
        "num_kv_blocks": engine.runner.num_blocks,
        "chains_left": len(kv.chains),  # every session's chain was dropped: 0
        "kv_blocks_in_use_after": kv.pool.num_used_blocks,
    }
    return {
        "system": f"{engine.config.sparse_method} + {'chain' if chains else 'radix'}",
        "prefix_cache_mode": "chain" if chains else "radix",
        "workload": asdict(workload),
        "summary": summarize(turns, wall) | engine_counts,
        "turns": [asdict(t) for t in turns],
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(turns: list[_Turn], wall: float) -> dict:
    """Totals, throughputs and latency percentiles of a finished run's turns."""
    latency = [t.finished - t.submitted for t in turns]
    ttft = [t.first_token - t.submitted for t in turns]
    out_tokens = sum(t.output_tokens for t in turns)
    later = [t for t in turns if t.turn > 0]
    return {
        "wall_seconds": wall,
        "num_turns_done": len(turns),
        "turns_per_s": len(turns) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "new_tokens": sum(t.new_tokens for t in turns),
        "prefilled_tokens": sum(t.prefilled_tokens for t in turns),
        "prefilled_tokens_later_turns": sum(t.prefilled_tokens for t in later),
        "cached_tokens": sum(t.cached_tokens for t in turns),
        "reused_tokens": sum(t.reused_tokens for t in turns),
        "chain_status": dict(Counter(t.chain_status for t in turns if t.chain_status)),
        "max_prompt_tokens": max(t.prompt_tokens for t in turns),
        "turn_latency_s": _stats(latency),
        "ttft_s": _stats(ttft),
    }


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9)}
