"""The engine process's side of ``EngineProcess``: its loop, and errors in a form that crosses processes.

``engine_main`` builds the engine, reports ``("ready", EngineInfo, pid)`` (or ``("failed", why)``),
then loops: take the commands queued (add, abort, call, stop; waiting for one only when nothing
runs), apply them, run one ``step()`` while any request is unfinished, and answer with one
``("turn", acks, calls, outputs, snapshot)`` message. A step that raises is reported as
``("died", why)`` and the process exits with status 1. It ignores SIGINT (the server drains first,
then sends "stop") and returns as soon as its parent is gone.
"""

from __future__ import annotations

import logging
import os
import queue
import signal

from sparse_cache import ChainError
from sparse_serve.config import EngineConfig
from sparse_serve.prune import PruneError
from sparse_serve.server.async_engine import EngineInfo, snapshot_of

logger = logging.getLogger(__name__)
POLL_S = 0.5  # how often an idle side checks that the other is still there


def portable(error: Exception) -> tuple:
    """An engine error as plain values (exceptions with extra fields do not unpickle)."""
    if isinstance(error, PruneError):
        return ("prune", str(error), error.code, error.param)
    if isinstance(error, ChainError):
        return ("chain", type(error).__module__, type(error).__name__, str(error))
    if isinstance(error, ValueError):
        return ("value", str(error))
    return ("other", f"{type(error).__name__}: {error}")


def rebuilt(values: tuple) -> Exception:
    """The exception ``portable`` described, on the other side."""
    kind = values[0]
    if kind == "prune":
        return PruneError(values[1], values[2], values[3])
    if kind == "chain":
        import importlib

        cls = getattr(importlib.import_module(values[1]), values[2], ChainError)
        return cls(values[3])
    if kind == "value":
        return ValueError(values[1])
    return RuntimeError(values[1])


def engine_main(config: EngineConfig, inbox, outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains on Ctrl-C, then sends "stop"
    _leave_a_core_to_the_server(config)
    from sparse_serve.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:
        outbox.put(("failed", f"{type(e).__name__}: {e}"))
        return
    outbox.put(("ready", EngineInfo.of(engine), os.getpid()))
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the server is gone (killed): nobody reads what we would compute
            return
        cmds = _take(inbox, block=not engine.has_unfinished_requests())
        if cmds is None:
            continue
        acks, calls, stop = _apply(engine, cmds)
        outputs = []
        if not stop and engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except BaseException as e:
                logger.exception("engine step failed; the engine process exits")
                outbox.put(("died", f"the engine failed: {type(e).__name__}: {e}"))
                raise SystemExit(1) from None
        outbox.put(("turn", acks, calls, outputs, snapshot_of(engine)))
        if stop:
            return


def _leave_a_core_to_the_server(config: EngineConfig) -> None:
    """On CPU, run the engine's compute on all cores but one (unless OMP_NUM_THREADS says otherwise).

    The server process needs CPU time for every streamed token; when the engine's OpenMP threads take
    every core, their spinning barriers and the server's event loop keep preempting each other, and a
    2-core machine's steps became ~20x slower under 32 streams (measured, ``results/serving``).
    """
    import torch

    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


def _take(inbox, block: bool) -> list | None:
    try:
        cmds = [inbox.get(timeout=POLL_S)] if block else []
    except queue.Empty:
        return None
    while True:
        try:
            cmds.append(inbox.get_nowait())
        except queue.Empty:
            return cmds


def _apply(engine, cmds: list) -> tuple[list, list, bool]:
    acks, calls, stop = [], [], False
    for cmd in cmds:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt_ids, params, chain = cmd
            try:
                engine.add_request(prompt_ids, params, request_id, **chain)
                acks.append((request_id, None))
            except ValueError as e:
                acks.append((request_id, portable(e)))
        elif kind == "abort":
            engine.abort_request(cmd[1])
        elif kind == "call":
            _, call_id, fn, args = cmd
            try:
                calls.append((call_id, fn(engine, *args), None))
            except Exception as e:
                calls.append((call_id, None, portable(e)))
        elif kind == "stop":
            for req in (*engine.scheduler.running, *engine.scheduler.waiting):
                engine.abort_request(req.request_id)
            stop = True
    return acks, calls, stop
