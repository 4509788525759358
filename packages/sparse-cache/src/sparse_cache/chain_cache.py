"""The chain cache: one conversation's retained KV, resumable by the next turn that extends it.

Eviction methods keep only part of a history's KV, so the radix cache (token-exact blocks named by
content) cannot reuse it. A *chain* remembers instead the full logical token ids whose KV was
computed, the retained block table with each layer's KV length, and an opaque method state. A
request that names the chain and whose prompt extends those tokens exactly resumes from the
retained KV and computes only the new suffix.

Ownership: an idle chain holds one reference on each of its blocks. ``checkout`` hands the
table (with its references) to the request that resumes the chain, which makes the chain busy
(pinned: a second writer is an error); ``checkin`` takes the request's final table back. ``fork``
adds a second holder to every block (copy-on-write: whoever writes into a shared block copies it
first, see ``KVCacheManager``). Under memory pressure idle chains lose their KV least recently used
first but keep their token ids, so the next turn recomputes (status ``recreated``); at the record
capacity the least recently used idle chain is forgotten entirely.

The cache never touches KV tensors and knows nothing of methods: the state is whatever the caller
saved, and the fingerprint is the caller's configuration salt.
"""

from __future__ import annotations

import enum
import uuid
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from sparse_cache.block_hash import BlockHash
from sparse_cache.block_pool import BlockPool
from sparse_cache.block_table import RequestTables
from sparse_cache.chain_errors import (
    ChainBusyError,
    ChainCapacityError,
    ChainExistsError,
    ChainFingerprintError,
    ChainPrefixMismatchError,
    UnknownChainError,
)


class ChainStatus(enum.StrEnum):
    CREATED = "created"
    """The chain did not exist: the whole prompt is computed and becomes the chain."""
    RESUMED = "resumed"
    """The retained KV is reused: only the tokens after the chain's processed ones are computed."""
    RECREATED = "recreated"
    """The chain exists but retains no KV (evicted, or lost to a preemption): everything is recomputed."""


@dataclass(slots=True)
class _Chain:
    fingerprint: bytes
    token_ids: tuple[int, ...] = ()
    pending: tuple[int, ...] = ()  # known tokens after them whose KV is not computed (the last sampled one)
    table: RequestTables | None = None
    kv_lens: tuple[int, ...] = ()
    state: object | None = None
    hashes: tuple[BlockHash, ...] | None = None  # radix hashes of leading full blocks (None: not token-exact)
    degraded: bool = False
    owner: Hashable | None = None
    last_used: int = 0


@dataclass(frozen=True, slots=True)
class ChainInfo:
    """A read-only view of one chain."""

    chain_id: str
    num_tokens: int  # logical tokens whose KV was computed
    kv_lens: tuple[int, ...]  # retained slots per layer (empty: no KV retained)
    num_blocks: int
    busy: bool
    degraded: bool


@dataclass(frozen=True, slots=True)
class ChainCheckout:
    """What a request takes over from a chain.

    ``token_ids`` / ``table`` / ``kv_lens`` / ``state`` / ``hashes``: the retained history, set only
    when ``status`` is ``resumed``; the table's block references now belong to the request.
    """

    chain_id: str
    status: ChainStatus
    token_ids: tuple[int, ...] = ()
    table: RequestTables | None = None
    kv_lens: tuple[int, ...] = ()
    state: object | None = None
    hashes: tuple[BlockHash, ...] | None = None
    degraded: bool = False

    @property
    def num_reused_tokens(self) -> int:
        return len(self.token_ids)


class ChainCache:
    """Chains by id over one block pool.

    Parameters
    ----------
    pool : the block pool whose references chains hold.
    max_chains : most chain records kept (busy ones included).
    """

    def __init__(self, pool: BlockPool, max_chains: int = 4096):
        if max_chains < 1:
            raise ValueError(f"max_chains must be >= 1, got {max_chains}")
        self.pool = pool
        self.max_chains = max_chains
        self._chains: dict[str, _Chain] = {}
        self._clock = 0
        self.num_kv_evictions = 0

    # -- queries --------------------------------------------------------------------------------
    def __contains__(self, chain_id: str) -> bool:
        return chain_id in self._chains

    def __len__(self) -> int:
        return len(self._chains)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._chains))

    def info(self, chain_id: str) -> ChainInfo:
        c = self._get(chain_id)
        blocks = len(c.table.block_ids) if c.table is not None else 0
        return ChainInfo(chain_id, len(c.token_ids), c.kv_lens, blocks, c.owner is not None, c.degraded)

    def token_ids(self, chain_id: str) -> tuple[int, ...]:
        """The tokens whose KV the chain's history computed (what a prompt must extend)."""
        return self._get(chain_id).token_ids

    def history(self, chain_id: str) -> tuple[int, ...]:
        """Every token of the chain's history: the processed ones, then any not computed yet (the last
        sampled token), which a prompt given as an append (``chain_append_start``) continues."""
        chain = self._get(chain_id)
        return chain.token_ids + chain.pending

    def held_tables(self) -> dict[str, RequestTables]:
        """Tables of the chains that hold KV now (idle chains only: a busy one's table is its request's)."""
        return {cid: c.table for cid, c in self._chains.items() if c.table is not None}

    # -- a request's turn -----------------------------------------------------------------------
    def checkout(
        self, chain_id: str, token_ids: Sequence[int], fingerprint: bytes, owner: Hashable, *, create: bool = True
    ) -> ChainCheckout:
        """Give ``owner`` the chain for a prompt of ``token_ids`` (the full logical prompt).

        Raises ``UnknownChainError`` (absent and not ``create``), ``ChainBusyError``,
        ``ChainFingerprintError``, ``ChainPrefixMismatchError`` (the prompt does not extend the
        processed tokens by at least one token) or ``ChainCapacityError``. Nothing changes on error.
        """
        chain = self._chains.get(chain_id)
        if chain is None:
            if not create:
                raise UnknownChainError(f"no chain {chain_id!r}")
            self._make_room()
            self._chains[chain_id] = _Chain(fingerprint, owner=owner, last_used=self._tick())
            return ChainCheckout(chain_id, ChainStatus.CREATED)
        self._check_idle(chain_id, chain)
        if chain.fingerprint != fingerprint:
            raise ChainFingerprintError(
                f"chain {chain_id!r} was built under another model, dtype or method configuration"
            )
        self._check_extends(chain_id, chain.token_ids, token_ids)
        chain.owner = owner
        chain.last_used = self._tick()
        if chain.table is None:
            chain.degraded = False  # recomputed from its tokens: exact again
            return ChainCheckout(chain_id, ChainStatus.RECREATED)
        table, chain.table = chain.table, None
        return ChainCheckout(
            chain_id,
            ChainStatus.RESUMED,
            chain.token_ids,
            table,
            chain.kv_lens,
            chain.state,
            chain.hashes,
            chain.degraded,
        )

    def checkin(
        self,
        chain_id: str,
        owner: Hashable,
        token_ids: Sequence[int],
        table: RequestTables | None,
        kv_lens: Sequence[int] = (),
        state: object | None = None,
        hashes: Sequence[BlockHash] | None = None,
        pending: Sequence[int] = (),
    ) -> None:
        """The owner's turn ended: the chain now holds its table (and the references) for ``token_ids``,
        followed by ``pending`` tokens whose KV is not computed.

        An empty history or table leaves the chain without KV (its blocks are released).
        """
        chain = self._get(chain_id)
        if chain.owner != owner:
            raise ChainBusyError(f"chain {chain_id!r} is not checked out by {owner!r}")
        chain.owner = None
        chain.last_used = self._tick()
        chain.token_ids, chain.pending = tuple(token_ids), tuple(pending)
        if table is not None and (not token_ids or not table.block_ids):
            self.pool.release(reversed(table.block_ids))
            table = None
        chain.table = table
        chain.kv_lens = tuple(kv_lens) if table is not None else ()
        chain.state = state if table is not None else None
        chain.hashes = tuple(hashes) if hashes is not None and table is not None else None

    # -- explicit operations --------------------------------------------------------------------
    def add(
        self,
        chain_id: str | None,
        fingerprint: bytes,
        token_ids: Sequence[int],
        table: RequestTables,
        kv_lens: Sequence[int],
        *,
        state: object | None = None,
        degraded: bool = False,
    ) -> str:
        """Register an idle chain that takes over ``table``'s references (e.g. a pruned history)."""
        chain_id = self._new_id(chain_id)
        self._make_room()
        self._chains[chain_id] = _Chain(
            fingerprint, tuple(token_ids), (), table, tuple(kv_lens), state, None, degraded, last_used=self._tick()
        )
        return chain_id

    def fork(self, chain_id: str, new_chain_id: str | None = None) -> str:
        """A new idle chain sharing the source's blocks (one more reference each) and its state."""
        src = self._get(chain_id)
        self._check_idle(chain_id, src)
        new_chain_id = self._new_id(new_chain_id)
        self._make_room(keep=chain_id)
        table = None
        if src.table is not None:
            self.pool.acquire(src.table.block_ids)
            table = src.table.copy()
        src.last_used = self._tick()
        self._chains[new_chain_id] = _Chain(
            src.fingerprint,
            src.token_ids,
            src.pending,
            table,
            src.kv_lens,
            src.state,
            src.hashes,
            src.degraded,
            None,
            self._tick(),
        )
        return new_chain_id

    def drop(self, chain_id: str) -> None:
        """Forget an idle chain and release its blocks."""
        chain = self._get(chain_id)
        self._check_idle(chain_id, chain)
        self._release_kv(chain)
        del self._chains[chain_id]

    # -- memory pressure ------------------------------------------------------------------------
    def num_reclaimable_blocks(self) -> int:
        """Blocks that would become free if every idle chain released its KV."""
        holds = Counter(b for c in self._chains.values() if c.table is not None for b in c.table.block_ids)
        return sum(1 for b, n in holds.items() if self.pool.refcount(b) == n)

    def reclaim(self, num_free_blocks: int) -> bool:
        """Evict idle chains' KV, least recently used first, until the pool has ``num_free_blocks``
        free blocks. Evicts nothing and answers False when even evicting every idle chain is not enough."""
        if self.pool.num_free_blocks >= num_free_blocks:
            return True
        if self.pool.num_free_blocks + self.num_reclaimable_blocks() < num_free_blocks:
            return False
        for chain in sorted(self._chains.values(), key=lambda c: c.last_used):
            if self.pool.num_free_blocks >= num_free_blocks:
                break
            if chain.table is not None:
                self._release_kv(chain)
                self.num_kv_evictions += 1
        return self.pool.num_free_blocks >= num_free_blocks

    # -- internals ------------------------------------------------------------------------------
    def _get(self, chain_id: str) -> _Chain:
        chain = self._chains.get(chain_id)
        if chain is None:
            raise UnknownChainError(f"no chain {chain_id!r}")
        return chain

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_id(self, chain_id: str | None) -> str:
        if chain_id is None:
            return uuid.uuid4().hex
        if chain_id in self._chains:
            raise ChainExistsError(f"chain {chain_id!r} already exists")
        return chain_id

    @staticmethod
    def _check_idle(chain_id: str, chain: _Chain) -> None:
        if chain.owner is not None:
            raise ChainBusyError(f"chain {chain_id!r} is in use by request {chain.owner!r}")

    @staticmethod
    def _check_extends(chain_id: str, done: tuple[int, ...], token_ids: Sequence[int]) -> None:
        n = len(done)
        if len(token_ids) <= n or tuple(token_ids[:n]) != done:
            diverge = next((i for i, (a, b) in enumerate(zip(done, token_ids, strict=False)) if a != b), None)
            where = f"differs at token {diverge}" if diverge is not None else f"has {len(token_ids)} tokens"
            raise ChainPrefixMismatchError(
                f"the prompt must extend chain {chain_id!r}'s {n} processed tokens by at least one token; it {where}"
            )

    def _release_kv(self, chain: _Chain) -> None:
        if chain.table is not None:
            self.pool.release(reversed(chain.table.block_ids))
        chain.table, chain.kv_lens, chain.state, chain.hashes = None, (), None, None

    def check_room(self, chain_id: str | None = None, keep: str | None = None) -> None:
        """Raise what adding chain ``chain_id`` would raise for its id or the record capacity, changing
        nothing (``keep``: a chain that must not be forgotten to make room)."""
        if chain_id is not None and chain_id in self._chains:
            raise ChainExistsError(f"chain {chain_id!r} already exists")
        if len(self._chains) >= self.max_chains and not self._idle(keep):
            raise ChainCapacityError(f"all {self.max_chains} chains are in use")

    def _idle(self, keep: str | None) -> list[tuple[int, str]]:
        return [(c.last_used, cid) for cid, c in self._chains.items() if c.owner is None and cid != keep]

    def _make_room(self, keep: str | None = None) -> None:
        """Forget the least recently used idle chain when the cache is at its record capacity."""
        if len(self._chains) < self.max_chains:
            return
        self.check_room(keep=keep)
        _, victim = min(self._idle(keep))
        self._release_kv(self._chains.pop(victim))
