"""Continuous batching with chunked prefill, mixed prefill+decode steps and recompute preemption.

Each step hands out ``{request: num_tokens}`` within the token budget: running requests first (a
decode takes one token, an unfinished prefill its next chunk), then waiting requests in arrival
order. When the pool cannot supply a running request's blocks, the most recently arrived running
request is preempted: its blocks are freed and it later recomputes its tokens from scratch.

Admission follows each request's memory plan (from its sparse method): a waiting request starts
only when the pool can hold its prefill peak on top of what the running prefills are still planned
to take, so methods that evict admit more requests and long prefills do not thrash. Requests whose
method needs the whole prompt at once (``full_prefill``) are prefilled alone in one pass.

Memory is counted in blocks through the KV manager's layout: a request holding ``n`` slots takes
``ceil(n / block_size)`` blocks shared by its layers, or, with a table per layer, the sum over its
layers of each layer's blocks (so per-layer budgets and sliding windows pack by what they hold).

Idle chains' KV counts as available memory: the KV manager reclaims it (least recently used chain
first) before an allocation fails, so it goes before any running request is preempted. A request
resuming a chain already holds the chain's retained KV while it waits and computes only the rest;
when such held KV leaves the oldest waiting request no room and nothing runs, the newest waiting
holders give theirs up and recompute, so queued chains never stall the engine.

``hold_decodes`` (benchmarks): requests whose prompt is done wait to decode until no request is
waiting or prefilling, so the decode steps that follow run with the whole batch (it holds only while
some prefill can run; a step with nothing else to do decodes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from sparse_cache import KVCacheManager
from sparse_serve.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: ``(request, num_tokens)`` pairs, decodes first, and who was preempted."""

    items: tuple[tuple[Request, int], ...]
    preempted: tuple[Request, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def _dense_prefill_peak(req: Request) -> int:
    return req.num_prompt_tokens


def _at_least(a: int | Sequence[int], b: int | Sequence[int]) -> int | list[int]:
    """The larger of two slot counts, each one count for every layer or per layer (then per layer)."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if isinstance(a, int):
        a, b = b, a
    return [max(x, y) for x, y in zip(a, [b] * len(a) if isinstance(b, int) else b, strict=True)]


class Scheduler:
    """Parameters
    ----------
    prefill_peak : slots a request's tables hold at most while its prompt is processed (memory plan): one
        count for every layer, or per layer.
    full_prefill : whether a request's prompt must be prefilled in one pass, alone (prefill policy).
    compacts : whether the method may compact a request's KV in place: then the blocks a resumed chain
        shares with a fork count as needed again (they are copied before a compaction rewrites them).
    hold_decodes : hold prefilled requests' decodes while other requests wait or prefill.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_peak: Callable[[Request], int | Sequence[int]] = _dense_prefill_peak,
        full_prefill: Callable[[Request], bool] = lambda req: False,
        compacts: bool = False,
        hold_decodes: bool = False,
    ):
        self.kv = kv
        self.compacts = compacts
        self.hold_decodes = hold_decodes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_peak = prefill_peak
        self.full_prefill = full_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, exclude: Collection[Request] = ()) -> ScheduledBatch:
        """The next step's work. ``exclude``: running requests that sit this step out (they stay
        running; a pipelined engine passes those whose in-flight token ends them by length)."""
        if self.hold_decodes and self._prefilling():
            order = {req: i for i, req in enumerate(self.running)}
            decoding = [r for r in self.running if r.num_computed_tokens >= r.prefill_len and not r.replaying]
            batch = self._schedule({*exclude, *decoding})
            self.running.sort(key=lambda r: order.get(r, len(order)))  # held ones keep their arrival order
            if batch or not decoding:
                return batch
            rest = self._schedule(exclude)  # nothing else could run: decode rather than stall
            return ScheduledBatch(rest.items, batch.preempted + rest.preempted)
        return self._schedule(exclude)

    def _prefilling(self) -> bool:
        return bool(self.waiting) or any(r.num_computed_tokens < r.prefill_len or r.replaying for r in self.running)

    def _schedule(self, exclude: Collection[Request]) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        scheduled_running: list[Request] = []
        held = [r for r in self.running if r in exclude] if exclude else []
        queue = deque(r for r in self.running if r not in exclude) if exclude else deque(self.running)
        deferred: list[Request] = []  # replay passes larger than what is left of the budget
        while queue and budget > 0:
            req = queue.popleft()
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.replaying:  # a replay pass runs whole, in one step
                n = len(req.next_replay)
                if n > budget:
                    deferred.append(req)
                    continue
            kv_tokens, write_from = self._grown(req, n)
            while self.kv.allocate(req.request_id, kv_tokens, write_from=write_from) is None:
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                items.append((req, n))
                scheduled_running.append(req)
                budget -= n
        self.running = scheduled_running + list(queue) + deferred + held
        if not preempted:
            budget = self._admit_waiting(items, budget)
        if not items and not self.running and self.waiting:
            self._unpin_waiting(items, preempted)
        items.sort(key=lambda item: item[1] > 1)  # decodes first: the runner splits the batch there
        return ScheduledBatch(tuple(items), tuple(preempted))

    def _blocks(self, num_tokens: int | Sequence[int]) -> int:
        return self.kv.num_blocks_for(num_tokens)

    def _grown(self, req: Request, n: int) -> tuple[int | list[int], int | list[int]]:
        """``(slots to hold, first slot written)`` for ``n`` more tokens of a request holding KV: one
        count for every layer (its largest; its smallest) or, with a table per layer, per layer."""
        if self.kv.per_layer:
            return [k + n for k in req.kv_lens], req.kv_lens
        return req.kv_len + n, min(req.kv_lens)

    def _held_blocks(self, req: Request) -> int:
        """Blocks a request holds towards its plan; a resumed chain's shared blocks do not count, since
        compacting them means copying them first."""
        if not self.kv.has_request(req.request_id):
            return 0
        if req.resumed and self.compacts:
            return self.kv.num_exclusive_blocks(req.request_id)
        return self.kv.num_held_blocks(req.request_id)

    def _reserved_blocks(self) -> int:
        """Blocks the running prefills are planned to take beyond what they hold now."""
        reserved = 0
        for req in self.running:
            if req.num_computed_tokens < req.prefill_len:
                reserved += max(0, self._blocks(self.prefill_peak(req)) - self._held_blocks(req))
        return reserved

    def _fits(self, blocks: int) -> bool:
        return blocks <= self.kv.num_free_blocks or blocks <= self.kv.num_available_blocks

    def _admit_waiting(self, items: list[tuple[Request, int]], budget: int) -> int:
        reserved = self._reserved_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.resumed:  # holds its chain's retained KV already
                prefix, done, held = None, req.num_computed_tokens, self._held_blocks(req)
            elif req.sampling_params.prompt_logprobs is not None:  # every prompt token's logits are wanted
                prefix, done, held = None, 0, 0
            else:
                prefix = self.kv.match_prefix(req.token_ids)
                done, held = prefix.num_tokens, len(prefix.block_ids)
            remaining = req.num_tokens - done
            full = self.full_prefill(req) and remaining > budget
            if full and any(n > 1 for _, n in items):
                break  # a whole-prompt prefill runs alone (decodes may share its step)
            n = remaining if full else min(remaining, budget)
            kv_tokens, write_from = self._grown(req, n) if req.resumed else (done + n, None)
            peak = self.kv.num_blocks_for(_at_least(self.prefill_peak(req), kv_tokens), step=n) - held
            if not self._fits(peak + reserved):
                break
            if self.kv.allocate(req.request_id, kv_tokens, prefix=prefix, write_from=write_from) is None:
                break
            self.waiting.popleft()
            req.prefill_len = req.num_tokens
            if not req.resumed:
                req.num_computed_tokens = done
                req.reset_kv(done)
                if req.num_preemptions == 0:
                    req.num_cached_prompt_tokens = done
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            items.append((req, n))
            budget -= n
            reserved += max(0, peak - self._held_blocks(req) + held)
            if full:
                return 0
        return budget

    def _unpin_waiting(self, items: list[tuple[Request, int]], preempted: list[Request]) -> None:
        """Nothing runs and nothing fits while waiting requests hold their chains' KV: give that KV
        up (they recompute, newest first) until the oldest waiting request can start."""
        for req in reversed(self.waiting):
            if not req.resumed:
                continue
            self._free_kv(req)
            req.num_reused_tokens = 0
            req.chain_status = "recreated"
            preempted.append(req)
            self._admit_waiting(items, self.max_num_batched_tokens)
            if items:
                return

    def preempt(self, req: Request) -> None:
        """Preempt a running request outside ``schedule`` (its blocks are freed; it recomputes later)."""
        self.running.remove(req)
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self._free_kv(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _free_kv(self, req: Request) -> None:
        """Free a request's blocks: it recomputes its tokens from the start when (re)admitted."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.replay_passes, req.num_replays_done = (), 0  # asked again when its prompt is recomputed
        req.resumed, req.resumed_state, req.resumed_tail = False, None, None
        req.reset_kv(0)
        req.num_preemptions += 1
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str) -> None:
        """Mark a running or waiting request finished and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv.has_request(req.request_id):
            self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
