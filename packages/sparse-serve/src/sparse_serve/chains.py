"""Requests on chains: a conversation's next turn resumes the retained KV of the previous ones.

A request that names a ``chain_id`` checks the chain out when it is added (the chain cache checks
busy, fingerprint and prefix, see ``sparse_cache.chain_cache``): when the chain retains KV, the
request takes over its block table, each layer's KV length and the method's saved state (which the
request's first step hands the method: ``RequestStep.resumed_state``), so its logical positions continue
after the chain's processed tokens while its slots continue after the retained ones, and only the suffix
is computed. When the request ends (finished, stopped or aborted) the chain takes back the request's
table and state for the tokens whose KV was computed (the last sampled token has none yet: the next
turn's prompt carries it); a request that ends before its first step gives back the state it took.

Blocks shared with a fork are copied before anything writes to them: the KV manager swaps them for
fresh blocks and this module copies their contents, for appends when a step is scheduled and for
compactions just before they rewrite slots.

A store with tails (KIVI) keeps a running request's incomplete page outside the pool, in the request's tail
row. A chain carries it on the host: when a request on a chain ends, its tail row (every layer's) is copied
out with the method's state (``ChainState``); the request that resumes the chain gets it copied into its own
tail row before its first step writes anything. Forks share it (it is never written in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparse_cache import ChainStatus, KVCacheManager, UnknownChainError
from sparse_methods import Compaction
from sparse_serve.kv_pool import KVPool
from sparse_serve.request import Request


def copy_blocks(pool: KVPool, copies: Sequence[tuple[int, int]]) -> None:
    """``block[dst] = block[src]`` in every layer's block tensors (K and V, key summaries, or codes and
    scales, whatever the store keeps), for each ``(src, dst)`` pair.

    Every source is read before any destination is written (a gather, then a scatter), so a block
    given back and reused as a destination within the same batch of copies is read first.
    """
    if not copies:
        return
    device = pool.device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for cache in pool.block_tensors():
        cache[dst] = cache[src]


def rewritten_slots(compaction: Compaction) -> tuple[int, int] | None:
    """``(first, end)``: compaction writes only slots in ``[first, end)`` of any layer (kept slots
    already in place are not rewritten); None when it only drops trailing slots.

    One device reduction per layer and one host read for all of them (``rewritten_slots_reference``
    reads each layer)."""
    keeps = [keep for keep in compaction.keep if keep is not None and keep.numel()]
    if not keeps:
        return None
    firsts = []
    for keep in keeps:
        n = keep.shape[1]
        moved = (keep != torch.arange(n, device=keep.device)).any(0)  # [n]
        # the first moved column, or n when none moved (argmax of all-False is 0: pad one True)
        firsts.append(torch.cat([moved, moved.new_ones(1)]).int().argmax())
    first_of = torch.stack(firsts).tolist()  # the one wait for the device
    moved_layers = [(f, keep.shape[1]) for f, keep in zip(first_of, keeps, strict=True) if f < keep.shape[1]]
    if not moved_layers:
        return None
    return min(f for f, _ in moved_layers), max(n for _, n in moved_layers)


def rewritten_slots_reference(compaction: Compaction) -> tuple[int, int] | None:
    """``rewritten_slots`` one layer at a time (the plain reference)."""
    first, end = None, 0
    for keep in compaction.keep:
        if keep is None:
            continue
        n = keep.shape[1]
        in_place = (keep == torch.arange(n, device=keep.device)).all(0)
        moved = (~in_place).nonzero()
        if moved.numel():
            first = int(moved[0]) if first is None else min(first, int(moved[0]))
            end = max(end, n)
    return None if first is None else (first, end)


@dataclass(frozen=True, slots=True)
class ChainState:
    """What a chain keeps for its next request beside its blocks, over a store with tails: the method's
    state and the incomplete page's tail rows on the host (per layer, each tail tensor's row)."""

    method_state: object | None
    tail: tuple[dict[str, torch.Tensor], ...]


class EngineChains:
    """The engine's side of the chain cache (``kv.chains``): opening and closing requests on chains.
    ``tail_rows``: the runner's tail-row allocator over a store with tails (None otherwise)."""

    def __init__(self, kv: KVCacheManager, pool: KVPool, tail_rows=None):
        self.kv = kv
        self.pool = pool
        self.tail_rows = tail_rows

    @property
    def cache(self):
        return self.kv.chains

    def logical_prompt(self, chain_id: str, append_start: int | None, token_ids: list[int]) -> list[int]:
        """The full prompt of a request on ``chain_id``: ``token_ids`` itself, or with ``append_start``
        set, the first ``append_start`` tokens of the chain's history (its prompts and outputs so far)
        followed by ``token_ids``."""
        if append_start is None:
            return token_ids
        if chain_id not in self.cache:
            raise UnknownChainError(f"no chain {chain_id!r} to append to")
        history = self.cache.history(chain_id)
        if not 0 <= append_start <= len(history):
            raise ValueError(
                f"chain_append_start={append_start} is outside chain {chain_id!r}'s history of {len(history)} tokens"
            )
        return [*history[:append_start], *token_ids]

    def open(self, req: Request) -> None:
        """Check ``req.chain_id`` out for ``req``; a resumed chain's KV and state become the request's."""
        checkout = self.kv.resume_chain(req.request_id, req.chain_id, req.token_ids)
        req.chain_status = checkout.status.value
        if checkout.status is not ChainStatus.RESUMED:
            return
        req.resumed = True
        req.num_computed_tokens = req.num_reused_tokens = checkout.num_reused_tokens
        req.kv_lens = list(checkout.kv_lens)
        state = checkout.state
        if isinstance(state, ChainState):
            state, req.resumed_tail = state.method_state, state.tail
        req.resumed_state = state

    def close(self, req: Request, state: object | None) -> None:
        """Hand the request's computed history back to its chain (before its blocks would be freed), with
        the method's state of the request (what ``release`` returned)."""
        if req.chain_id is None:
            return
        rid = req.request_id
        pending = req.state_to_resume  # ended before its first step: the method never had the chain's state
        state = pending if pending is not None else state if self.kv.has_request(rid) else None
        tail = self._tail_of(req)
        if tail is not None:
            state = ChainState(state, tail)
        n = req.num_computed_tokens
        self.kv.save_chain(rid, req.chain_id, req.token_ids[:n], req.kv_lens, state, req.token_ids[n:])

    def _tail_of(self, req: Request) -> tuple[dict[str, torch.Tensor], ...] | None:
        """The request's incomplete pages as the chain keeps them (host copies of its tail row), None when the
        store keeps no tails, the request holds no KV or every layer's length ends on a block boundary."""
        if self.tail_rows is None or not self.kv.has_request(req.request_id):
            return None
        if all(n % self.kv.block_size == 0 for n in req.kv_lens):
            return None
        if req.resumed_tail is not None:  # ended before its first step: the chain's own tail, never restored
            return req.resumed_tail
        row = self.tail_rows.held().get(req.request_id)
        if row is None:
            return None
        return tuple({name: t[row].to("cpu", copy=True) for name, t in layer.items()} for layer in self.pool.tails)

    def restore_tails(self, requests: Sequence[Request]) -> None:
        """Copy each resumed request's pending chain tail into its tail row (before the step writes it)."""
        if self.tail_rows is None:  # a store without tails: nothing is ever pending (every step asks)
            return
        for req in requests:
            if req.resumed_tail is None:
                continue
            row = self.tail_rows.row(req.request_id)
            for layer, saved in zip(self.pool.tails, req.resumed_tail, strict=True):
                for name, t in layer.items():
                    t[row].copy_(saved[name], non_blocking=False)
            req.resumed_tail = None

    def copy_pending(self) -> None:
        """Perform the block copies the KV manager queued (before the step writes anything)."""
        copy_blocks(self.pool, self.kv.take_copies())

    def make_writable(self, req: Request, compaction: Compaction) -> bool:
        """Copy the shared blocks a compaction is about to rewrite; False when the pool is too short."""
        if not req.resumed:
            return True  # only a resumed chain's table can hold blocks shared with a fork
        rid = req.request_id
        if self.kv.num_exclusive_blocks(rid) == self.kv.num_held_blocks(rid):
            return True  # nothing shared (no fork holds these blocks): nothing to read on the device
        span = rewritten_slots(compaction)
        if span is None:
            return True
        bs = self.kv.block_size
        if not self.kv.make_exclusive(rid, span[0] // bs, -(-span[1] // bs)):
            return False
        self.copy_pending()
        return True
