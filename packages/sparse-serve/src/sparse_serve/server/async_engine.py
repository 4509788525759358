"""The synchronous engine on its own thread, fed by a command queue, streaming into asyncio queues.

``LLMEngine`` is single-threaded, so one thread owns it: it takes commands (add, abort, call, stop)
from a thread-safe inbox, runs ``step()`` while any request is unfinished and sleeps on the inbox when
none is, and hands each step's outputs to the event loop in one ``call_soon_threadsafe``. The
event loop never touches the engine; it reads an ``EngineSnapshot`` the thread publishes.

If a step raises, the engine's state is unknown: every open request fails, nothing more is taken,
and ``on_fatal(message)`` tells the server, which stops (a request whose own postprocessing fails
is finished by the engine with ``finish_reason="error"`` instead, and the others go on).

``add`` waits until the engine thread has accepted the request (the engine validates it), so a
bad request fails before an HTTP response starts. The waiting queue is bounded: requests sent
but not yet taken by the thread, plus those the scheduler holds waiting, are at most
``max_waiting_requests``; one more is a ``QueueFullError``. ``call(fn, *args)`` runs ``fn(engine, *args)`` on the
engine thread between two steps (chain forks, drops, info, pruning) and returns what it returns.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sparse_serve.engine import LLMEngine
from sparse_serve.outputs import RequestOutput
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.server.metrics import EngineSnapshot, ServerMetrics

logger = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the HTTP side needs to know about an engine it does not hold."""

    model: str
    tokenizer_path: str
    has_tokenizer: bool
    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(
            model=engine.config.model,
            tokenizer_path=engine.config.tokenizer or engine.config.model,
            has_tokenizer=engine.tokenizer is not None,
            eos_token_ids=frozenset(engine.eos_token_ids),
            max_model_len=engine.max_model_len,
            vocab_size=engine.runner.model_config.vocab_size,
            num_kv_blocks=engine.kv.num_blocks,
            block_size=engine.config.block_size,
        )


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` requests already."""


class EngineUnavailableError(RuntimeError):
    """The engine thread is stopping, stopped, or died of an error."""


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: asyncio.Queue
    accepted: asyncio.Future
    arrival: float
    chain: dict = field(default_factory=dict)  # chain_id / chain_append_start, when the request names a chain


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple
    done: asyncio.Future


_STOP = object()


@dataclass(eq=False, slots=True)
class _Tracked:
    """Engine-thread bookkeeping of one running request."""

    outputs: asyncio.Queue
    arrival: float
    last_token_time: float | None = None


class RequestStream:
    """The outputs of one request as the engine produces them; ``close()`` aborts it if unfinished."""

    def __init__(self, engine, request_id: str, outputs: asyncio.Queue):
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._outputs = outputs
        self._peeked = None

    def __aiter__(self) -> RequestStream:
        return self

    async def wait_first_output(self) -> None:
        """Wait until the request's first update (its prompt is computed); iterating still yields it."""
        if self._peeked is None and not self.finished:
            self._peeked = await self._outputs.get()

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
        else:
            item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request (freeing its KV) unless it finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine`` on a thread; ``await add(...)`` from the event loop, ``shutdown()`` to stop."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, *, max_waiting_requests: int):
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.tokenizer = engine.tokenizer
        self.metrics = metrics
        self.on_fatal: Callable[[str], None] | None = None
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_queued, _unavailable and what enters the inbox
        self._num_queued = 0
        self._unavailable: str | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._snapshot = self._take_snapshot()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- event loop side ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sparse-engine", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        return "on a thread of the server process"

    @property
    def is_alive(self) -> bool:
        return self._unavailable is None and self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> EngineSnapshot:
        """The engine's last published state; ``num_waiting`` includes requests not yet taken."""
        with self._lock:
            return replace(self._snapshot, num_waiting=self._snapshot.num_waiting + self._num_queued)

    async def add(
        self, prompt_token_ids: list[int], params: SamplingParams, chain: dict | None = None
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it (``chain``: ``chain_id`` /
        ``chain_append_start`` for the engine's chain cache).

        Raises QueueFullError, EngineUnavailableError, or the engine's ValueError for bad input.
        """
        loop = asyncio.get_running_loop()
        cmd = _Add(
            uuid.uuid4().hex,
            prompt_token_ids,
            params,
            asyncio.Queue(),
            loop.create_future(),
            time.monotonic(),
            dict(chain or {}),
        )
        with self._lock:
            if self._unavailable is not None:
                raise EngineUnavailableError(self._unavailable)
            if self._num_queued + self._snapshot.num_waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{self.max_waiting_requests} requests are waiting already")
            self._num_queued += 1
            self._inbox.put(cmd)
        try:
            await cmd.accepted
        except asyncio.CancelledError:
            self.abort(cmd.request_id)  # queued after the add, so the engine drops it
            raise
        return RequestStream(self, cmd.request_id, cmd.outputs)

    async def call(self, fn: Callable[..., R], *args) -> R:
        """``fn(engine, *args)``, run on the engine thread between steps; raises what ``fn`` raised, or
        EngineUnavailableError. Once queued it runs even if the caller stops waiting."""
        cmd = _Call(fn, args, asyncio.get_running_loop().create_future())
        with self._lock:
            if self._unavailable is not None:
                raise EngineUnavailableError(self._unavailable)
            self._inbox.put(cmd)
        return await cmd.done

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._unavailable is None:
                self._inbox.put(_Abort(request_id))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, abort those left, and join the engine thread."""
        with self._lock:
            if self._unavailable is None:
                self._unavailable = "the server is shutting down"
                self._inbox.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", timeout_s)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                for cmd in self._take_commands(block=not self.engine.has_unfinished_requests()):
                    if cmd is _STOP:
                        self._fail_all(EngineUnavailableError("the server is shutting down"), abort=True)
                        return
                    self._apply(cmd)
                self._snapshot = self._take_snapshot()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._snapshot = self._take_snapshot()  # before publishing: a client that saw a token sees its step
                    self._publish(outputs)
        except BaseException as e:  # the engine's state is unknown now: fail everything, take nothing more
            logger.exception("engine loop failed; the server stops serving requests")
            with self._lock:
                self._unavailable = f"the engine failed: {type(e).__name__}: {e}"
            self._fail_all(EngineUnavailableError(self._unavailable), abort=False)
            if self.on_fatal is not None:
                self._call_in_loop(self.on_fatal, self._unavailable)

    def _take_commands(self, block: bool) -> list:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            tracked = self._tracked.pop(cmd.request_id, None)
            self.engine.abort_request(cmd.request_id)
            if tracked is not None:
                self.metrics.on_finished("abort", time.monotonic() - tracked.arrival)
            return
        if isinstance(cmd, _Call):
            self._run_call(cmd)
            return
        try:
            self.engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id, **cmd.chain)
        except ValueError as e:
            error = e
        else:
            error = None
            self._tracked[cmd.request_id] = _Tracked(cmd.outputs, cmd.arrival)
        with self._lock:  # moved from the inbox to the scheduler: the waiting count stays exact
            self._num_queued -= 1
            self._snapshot = self._take_snapshot()
        self._settle(cmd.accepted, error)

    def _run_call(self, cmd: _Call) -> None:
        # Errors go back to the caller: chain operations check their input before changing anything.
        try:
            result, error = cmd.fn(self.engine, *cmd.args), None
        except Exception as e:
            result, error = None, e
        self._snapshot = self._take_snapshot()
        self._call_in_loop(_settle_future, cmd.done, error, result)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if tracked.last_token_time is None:
                self.metrics.on_first_token(now - tracked.arrival, len(out.prompt_token_ids))
                self.metrics.on_tokens(len(out.delta_token_ids), None)
            else:
                self.metrics.on_tokens(len(out.delta_token_ids), now - tracked.last_token_time)
            tracked.last_token_time = now
            if out.finished:
                del self._tracked[out.request_id]
                self.metrics.on_finished(out.finish_reason or "unknown", now - tracked.arrival)
            deliveries.append((tracked.outputs, out))
        if deliveries:
            self._call_in_loop(_deliver, deliveries)

    def _fail_all(self, error: Exception, abort: bool) -> None:
        """End every request with ``error``: those tracked and adds still in the inbox."""
        deliveries = []
        for request_id, tracked in self._tracked.items():
            if abort:
                self.engine.abort_request(request_id)
            deliveries.append((tracked.outputs, error))
        self._tracked.clear()
        with self._lock:
            for cmd in self._take_commands(block=False):
                if isinstance(cmd, _Add):
                    self._num_queued -= 1
                    self._settle(cmd.accepted, error)
                elif isinstance(cmd, _Call):
                    self._settle(cmd.done, error)
        if deliveries:
            self._call_in_loop(_deliver, deliveries)
        self._snapshot = self._take_snapshot()

    def _settle(self, future: asyncio.Future, error: Exception | None) -> None:
        self._call_in_loop(_settle_future, future, error)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _take_snapshot(self) -> EngineSnapshot:
        return snapshot_of(self.engine)


def snapshot_of(engine: LLMEngine) -> EngineSnapshot:
    """The engine's gauges and counters now (on the thread or process that owns the engine)."""
    return EngineSnapshot(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_kv_blocks_total=engine.kv.num_blocks,
        num_kv_blocks_free=engine.kv.num_free_blocks,
        prefix_query_tokens=engine.kv.prefix_query_tokens,
        prefix_hit_tokens=engine.kv.prefix_hit_tokens,
        num_preemptions=engine.scheduler.num_preemptions,
    )


def _deliver(deliveries: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for outputs, item in deliveries:
        outputs.put_nowait(item)


def _settle_future(future: asyncio.Future, error: Exception | None, result: Any = None) -> None:
    if future.done():  # the waiter was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
