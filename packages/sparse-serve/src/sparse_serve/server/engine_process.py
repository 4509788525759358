"""The engine in a process of its own (as vLLM v1 runs it), so that HTTP parsing, tokenizing and SSE
never take CPU time or the interpreter lock from the step loop.

The HTTP side (``EngineProcess``) sends commands over one multiprocessing queue (add, abort, call,
stop); the engine process (``_engine_main``) runs ``step()`` while any request is unfinished and
answers over another queue with one message per loop turn: the adds it accepted or refused, the
calls it ran, the step's outputs and a snapshot of the engine's state (``engine_worker.py``). A thread of the HTTP side
reads that queue and hands everything to the event loop. ``EngineProcess`` has ``AsyncEngine``'s
interface, so the routes do not know which one they talk to.

If a step raises, the engine process reports it and exits with status 1; if the process vanishes
(killed, out of memory), the reading thread notices within a second. Either way every open request
fails with ``EngineUnavailableError`` and ``on_fatal`` stops the server, which exits non-zero.
The engine process ignores SIGINT (Ctrl-C drains the server first, then stops it) and exits when
its parent is gone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sparse_serve.config import EngineConfig
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.server.async_engine import (
    EngineInfo,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
    _settle_future,
)
from sparse_serve.server.engine_worker import POLL_S, engine_main, rebuilt
from sparse_serve.server.metrics import EngineSnapshot, ServerMetrics
from sparse_serve.tokenizer import Tokenizer

logger = logging.getLogger("uvicorn.error")


# -- the HTTP side --------------------------------------------------------------------------------
class _Open:
    """One request the HTTP side waits on."""

    __slots__ = ("accepted", "outputs", "arrival", "last_token_time")

    def __init__(self, accepted: asyncio.Future, arrival: float):
        self.accepted = accepted
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.arrival = arrival
        self.last_token_time: float | None = None


class EngineProcess:
    """Starts the engine process (and waits until it is ready); then ``start()`` on the event loop,
    ``await add(...)``, ``call(fn, *args)`` (``fn`` must be a module-level function: it is pickled),
    ``shutdown()``."""

    def __init__(self, config: EngineConfig, *, max_waiting_requests: int = 1024, start_timeout_s: float = 600.0):
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.metrics: ServerMetrics | None = None  # set by build_app through attach_metrics
        self.max_waiting_requests = max_waiting_requests
        self.on_fatal: Callable[[str], None] | None = None
        ctx = mp.get_context("spawn")  # a fork of a process with threads (and CUDA) is unsafe
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=engine_main, args=(config, self._inbox, self._outbox), daemon=True)
        self._proc.start()
        self.info, self.pid = self._wait_ready(start_timeout_s)
        self.tokenizer = (
            Tokenizer.from_pretrained(self.info.tokenizer_path, self.info.eos_token_ids)
            if self.info.has_tokenizer
            else None
        )
        self._lock = threading.Lock()  # guards _num_queued, _unavailable and the command queue
        self._num_queued = 0
        self._unavailable: str | None = None
        self._open: dict[str, _Open] = {}  # event loop only
        self._calls: dict[str, asyncio.Future] = {}
        self._snapshot = EngineSnapshot(num_kv_blocks_total=self.info.num_kv_blocks)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None

    def _wait_ready(self, timeout_s: float) -> tuple[EngineInfo, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the engine process exited with status {self._proc.exitcode}") from None
                continue
            if msg[0] == "failed":
                self._proc.join(5)
                raise ValueError(f"the engine did not start: {msg[1]}")
            return msg[1], msg[2]
        self._proc.kill()
        raise RuntimeError(f"the engine process was not ready within {timeout_s:.0f} s")

    def describe(self) -> str:
        return f"in process {self.pid}"

    # -- event loop side ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="sparse-engine-reader", daemon=True)
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return self._unavailable is None and self._proc.is_alive()

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            return replace(self._snapshot, num_waiting=self._snapshot.num_waiting + self._num_queued)

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, chain: dict | None = None):
        request_id = uuid.uuid4().hex
        entry = _Open(asyncio.get_running_loop().create_future(), time.monotonic())
        with self._lock:
            if self._unavailable is not None:
                raise EngineUnavailableError(self._unavailable)
            if self._num_queued + self._snapshot.num_waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{self.max_waiting_requests} requests are waiting already")
            self._num_queued += 1
            self._open[request_id] = entry
            self._inbox.put(("add", request_id, list(prompt_token_ids), params, dict(chain or {})))
        try:
            await entry.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._open.pop(request_id, None)
            raise
        return RequestStream(self, request_id, entry.outputs)

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        call_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._unavailable is not None:
                raise EngineUnavailableError(self._unavailable)
            self._calls[call_id] = future
            self._inbox.put(("call", call_id, fn, args))
        return await future

    def abort(self, request_id: str) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None and entry.last_token_time is not None and self.metrics is not None:
            self.metrics.on_finished("abort", time.monotonic() - entry.arrival)
        with self._lock:
            if self._unavailable is None:
                self._inbox.put(("abort", request_id))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            if self._unavailable is None:
                self._unavailable = "the server is shutting down"
                self._inbox.put(("stop",))
        await asyncio.to_thread(self._proc.join, timeout_s)
        if self._proc.is_alive():
            logger.warning("engine process did not stop within %.0f s; killing it", timeout_s)
            self._proc.kill()
        self._fail_all(EngineUnavailableError("the server is shutting down"))

    # -- reader thread --------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self._proc.is_alive():
                    self._died(f"the engine process exited with status {self._proc.exitcode}")
                    return
                continue
            except (EOFError, OSError):
                self._died("the engine process's queue closed")
                return
            if msg[0] == "died":
                self._died(msg[1])
                return
            _, acks, calls, outputs, snapshot = msg
            with self._lock:
                self._num_queued -= len(acks)
                self._snapshot = snapshot
            now = time.monotonic()
            self._call_in_loop(self._deliver, acks, calls, outputs, now)
            if self._unavailable is not None and not self._proc.is_alive():
                return

    def _died(self, message: str) -> None:
        with self._lock:
            expected = self._unavailable is not None  # a shutdown we asked for
            self._unavailable = self._unavailable or message
        if expected:
            return
        logger.error("%s", message)
        self._call_in_loop(self._fail_all, EngineUnavailableError(message))
        if self.on_fatal is not None:
            self._call_in_loop(self.on_fatal, message)

    def _deliver(self, acks, calls, outputs, now: float) -> None:  # on the event loop
        for request_id, error in acks:
            entry = self._open.get(request_id)
            if entry is not None:
                _settle_future(entry.accepted, None if error is None else rebuilt(error))
        for call_id, result, error in calls:
            future = self._calls.pop(call_id, None)
            if future is not None:
                _settle_future(future, None if error is None else rebuilt(error), result)
        for out in outputs:
            entry = self._open.get(out.request_id)
            if entry is None:
                continue
            self._count(entry, out, now)
            if out.finished:
                del self._open[out.request_id]
            entry.outputs.put_nowait(out)

    def _count(self, entry: _Open, out, now: float) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        if entry.last_token_time is None:
            metrics.on_first_token(now - entry.arrival, len(out.prompt_token_ids))
            metrics.on_tokens(len(out.delta_token_ids), None)
        else:
            metrics.on_tokens(len(out.delta_token_ids), now - entry.last_token_time)
        entry.last_token_time = now
        if out.finished:
            metrics.on_finished(out.finish_reason or "unknown", now - entry.arrival)

    def _fail_all(self, error: Exception) -> None:  # on the event loop
        for entry in self._open.values():
            _settle_future(entry.accepted, error)
            entry.outputs.put_nowait(error)
        self._open.clear()
        for future in self._calls.values():
            _settle_future(future, error)
        self._calls.clear()

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass
