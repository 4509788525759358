"""Tensor parallelism: one engine process per rank, driven by rank 0.

Rank 0 is the caller's process (``LLM``, the bench, the server): it owns the API. Each other rank is a
spawned process holding an ``LLMEngine`` over its share of the weights and KV heads. The engine is
deterministic given its inputs, so rather than shipping each step's metadata, rank 0 broadcasts the
calls that change engine state (``add_request``, ``step``, ``abort_request``, chains, ...) and every
rank makes the same call: each rank's scheduler, KV manager, sparse method and sampler then go
through the same states, and each step's metadata is the same on every rank by construction (the
logits are gathered whole on every rank, so the sampled tokens agree too). This keeps everything a
step touches besides the model (compactions, chain copies, method state) in lockstep without a
second code path. Calls that only read state run on rank 0 alone.

NCCL on GPU (rank r on ``cuda:r``), gloo on CPU.
"""

from __future__ import annotations

import atexit
import logging
import operator
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from sparse_models.distributed import broadcast_object, init_tensor_parallel, shutdown_tensor_parallel
from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine, check_before_start
from sparse_serve.model_runner import resolve_device

logger = logging.getLogger(__name__)

# Engine calls that change state: made on every rank. Nested names reach the runner and scheduler.
MIRRORED_CALLS = frozenset(
    {
        "add_request",
        "add_synthetic_request",
        "abort_request",
        "step",
        "drain",
        "fork_chain",
        "drop_chain",
        "prune",
        "runner.randomize_kv",
    }
)
MIRRORED_SETS = frozenset({"scheduler.hold_decodes"})
_STOP = None


def launch_engine(config: EngineConfig) -> LLMEngine | MirroredEngine:
    """An ``LLMEngine`` for ``tensor_parallel_size`` 1; otherwise start the other ranks and return rank
    0's engine wrapped so that state-changing calls reach every rank."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config)
    return MirroredEngine(config)


def _init_rank(rank: int, config: EngineConfig, rendezvous: str) -> None:
    # The backend follows the engine's device, not the host: a CPU engine on a CUDA host talks gloo (NCCL
    # would put every rank's collectives on cuda:0 and cannot reduce the CPU model's tensors).
    on_cuda = resolve_device(config.device).type == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    init_tensor_parallel(rank, config.tensor_parallel_size, f"file://{rendezvous}", "nccl" if on_cuda else "gloo")


def _worker(rank: int, config: EngineConfig, rendezvous: str) -> None:
    """Rank ``rank``: build the engine, then make every call rank 0 broadcasts until it says stop."""
    _init_rank(rank, config, rendezvous)
    try:
        engine = LLMEngine(config)
        while (message := broadcast_object()) is not _STOP:
            kind, name, args, kwargs = message
            try:
                if kind == "set":
                    owner, attr = name.rsplit(".", 1)
                    setattr(operator.attrgetter(owner)(engine), attr, args)
                else:
                    operator.attrgetter(name)(engine)(*args, **kwargs)
            except Exception:  # rank 0 raised the same error to its caller; the engines stay in step
                pass
    finally:
        shutdown_tensor_parallel()


class MirroredEngine:
    """Rank 0's ``LLMEngine`` plus the other ranks: ``MIRRORED_CALLS`` and ``MIRRORED_SETS`` are
    broadcast before rank 0 makes them; everything else is rank 0's engine's attribute."""

    def __init__(self, config: EngineConfig):
        check_before_start(config)  # bad input: a clear error before the ranks start (seconds each)
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="sparse-tp-")
        rendezvous = str(Path(self._dir.name) / "rendezvous")
        self._workers = [
            ctx.Process(target=_worker, args=(rank, config, rendezvous), daemon=True)
            for rank in range(1, config.tensor_parallel_size)
        ]
        for proc in self._workers:
            proc.start()
        try:
            _init_rank(0, config, rendezvous)
            self._engine = LLMEngine(config)
        except BaseException:
            codes = [proc.exitcode for proc in self._workers]
            logger.error("tensor-parallel ranks 1..: exit codes %s", codes)
            self._kill()
            shutdown_tensor_parallel()
            raise
        self._closed = False
        atexit.register(self.close)

    def _call(self, name: str, *args, **kwargs):
        broadcast_object(("call", name, args, kwargs))
        return operator.attrgetter(name)(self._engine)(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not set (yet): no engine to ask
            raise AttributeError(name)
        if name in MIRRORED_CALLS:
            return lambda *args, **kwargs: self._call(name, *args, **kwargs)
        if any(full.startswith(name + ".") for full in MIRRORED_CALLS | MIRRORED_SETS):
            return _MirroredPart(self, name)
        return getattr(self._engine, name)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            broadcast_object(_STOP)
        finally:
            for proc in self._workers:
                proc.join(timeout=30)
            self._kill()
            shutdown_tensor_parallel()
            self._dir.cleanup()

    def _kill(self) -> None:
        for proc in self._workers:
            if proc.is_alive():
                proc.terminate()


class _MirroredPart:
    """``engine.runner`` / ``engine.scheduler`` of a ``MirroredEngine``: the mirrored members go to every
    rank, the rest is rank 0's object."""

    def __init__(self, owner: MirroredEngine, prefix: str):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        full = f"{self._prefix}.{name}"
        if full in MIRRORED_CALLS:
            return lambda *args, **kwargs: self._owner._call(full, *args, **kwargs)
        return getattr(getattr(self._owner._engine, self._prefix), name)

    def __setattr__(self, name: str, value) -> None:
        full = f"{self._prefix}.{name}"
        if full in MIRRORED_SETS:
            broadcast_object(("set", full, value, {}))
        setattr(getattr(self._owner._engine, self._prefix), name, value)
