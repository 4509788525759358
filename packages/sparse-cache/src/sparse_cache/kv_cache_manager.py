"""Per-request KV blocks on top of the block pool, with the radix prefix cache and the chain cache.

The scheduler asks three things: how much of a prompt is already cached (``match_prefix``, which
never changes state), whether a step's tokens fit (``allocate``, which answers None and changes
nothing when they do not), and to give a request's blocks back (``free``). Full blocks whose KV
has been computed are registered under their chained hash (``cache_blocks``), so later requests
with the same prefix map the same blocks instead of recomputing them.

Chains (``chains``, see ``chain_cache``) hand a request a table whose blocks may be shared with a
fork. Writes never reach a shared block: ``allocate(..., write_from=...)`` and ``make_exclusive``
swap every shared block in the region about to be written for a fresh one and queue a
``(source, destination)`` copy, which the engine performs (``take_copies``) before the write.
Idle chains' blocks are reclaimed, least recently used first, whenever an allocation falls short.

Per-layer layout (``LayerLayout``): a request holds one table per layer, all drawing from the one
pool; ``allocate``, ``shrink`` and the prefix lookups then take and give per-layer counts, each layer's
copy of a cached prefix is its own cache entry, and ``slide`` gives back a sliding-window layer's
blocks that its queries no longer read (its table keeps a null block in their place). A windowed
layer takes a prefix hit of ``P`` tokens from the cached blocks its window still reads.

Each held table also has a packed int32 copy of its block ids (``block_id_array``), kept in step
with every change this manager makes, so that building a step's block lists costs a memory copy
per request instead of converting Python ints: while a request holds a table, only this manager
changes its block ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sparse_cache.block_hash import BlockHash, hash_full_blocks
from sparse_cache.block_pool import BlockPool, as_block_ids
from sparse_cache.block_table import BlockTable, LayerTables, RequestTables
from sparse_cache.chain_cache import ChainCache, ChainCheckout
from sparse_cache.layer_layout import LayerLayout
from sparse_cache.pruning import PrunePlan


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached blocks covering the first ``num_tokens`` tokens of a prompt.

    ``block_ids``: the blocks a request taking the match holds (every layer's, in the per-layer layout);
    ``table_block_ids``: per-layer layout only, each layer's table start (a windowed layer's blocks
    before its window are the null block)."""

    block_ids: tuple[int, ...] = ()
    hashes: tuple[BlockHash, ...] = ()
    num_tokens: int = 0
    table_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(slots=True)
class _RequestBlocks:
    tables: list[BlockTable]  # one per table of the layout
    hashes: list[BlockHash] = field(default_factory=list)  # hashes of the leading full blocks
    cacheable: bool = True  # False: the KV is not token-exact (resumed from a compressed chain)
    ids: list[array] = field(init=False)  # each table's block_ids as packed int32, kept equal by the manager
    nulls: list[int] = field(init=False)  # leading null blocks of each table (windowed layers)

    def __post_init__(self) -> None:
        self.ids = [array("i", t.block_ids) for t in self.tables]
        self.nulls = [0] * len(self.tables)


class KVCacheManager:
    """Allocates blocks to requests from one pool.

    Parameters
    ----------
    num_blocks : blocks of the KV tensors (shared layout: the same ids index every layer's KV tensors;
        per-layer layout: ids index the one tensor all layers share). With windowed layers the last one
        is the null block, outside the pool.
    block_size : tokens per block.
    layout : the tables of a request's layers (default: one shared by every layer).
    enable_prefix_caching : share computed full blocks between requests by content hash.
    salt : fingerprint of what the KV depends on besides tokens (model, dtype, method config).
    max_chains : most chains the chain cache keeps.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        layout: LayerLayout | None = None,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        max_chains: int = 4096,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.layout = layout or LayerLayout(1)
        # Windowed layers' tables keep the last block in place of the ones they gave back: outside the pool.
        self.null_block = num_blocks - 1 if self.layout.windowed else None
        self.pool = BlockPool(num_blocks - (self.null_block is not None))
        self.chains = ChainCache(self.pool, max_chains)
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self._requests: dict[Hashable, _RequestBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def per_layer(self) -> bool:
        return self.layout.per_layer

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus those that evicting every idle chain's KV would free."""
        return self.pool.num_free_blocks + self.chains.num_reclaimable_blocks()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def table(self, request_id: Hashable, layer: int = 0) -> BlockTable:
        """The request's table that ``layer`` uses (the one table in the shared layout)."""
        return self._requests[request_id].tables[layer if self.per_layer else 0]

    def tables(self, request_id: Hashable) -> RequestTables:
        """Everything the request holds: its table, or its ``LayerTables``."""
        return self._handle(self._requests[request_id])

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def block_id_array(self, request_id: Hashable, layer: int = 0) -> array:
        """The block ids of ``table(request_id, layer)`` as an ``array('i')`` (the manager's own copy:
        read it, do not change it)."""
        return self._requests[request_id].ids[layer if self.per_layer else 0]

    def block_id_arrays(self, request_id: Hashable) -> list[array]:
        """``block_id_array`` of each of the request's tables, in table order (read them, do not change them)."""
        return self._requests[request_id].ids

    def num_held_blocks(self, request_id: Hashable) -> int:
        """Pool blocks the request holds (all its tables; null blocks excluded)."""
        req = self._requests[request_id]
        return sum(len(t.block_ids) - n for t, n in zip(req.tables, req.nulls, strict=True))

    def num_blocks_for(self, tokens: int | Sequence[int], step: int | None = None) -> int:
        """Blocks a request holding ``tokens`` slots (per layer, or one count for all) takes; with ``step``
        (the tokens its next step adds) a windowed layer counts at most its window and the step."""
        return self.layout.num_blocks(tokens, self.block_size, step)

    # -- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached leading blocks, leaving at least the last token to compute.

        The last token is never served from cache because its logits are needed. Pure lookup.
        """
        if len(token_ids) < 2:
            return PrefixMatch()
        return self.cached_prefix(token_ids[: (len(token_ids) - 1) // self.block_size * self.block_size])

    def cached_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached leading full blocks of ``token_ids`` (all of them may match). Pure lookup."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        max_blocks = len(token_ids) // self.block_size
        hashes = hash_full_blocks(token_ids[: max_blocks * self.block_size], self.block_size, self.salt)
        if self.per_layer:
            return self._cached_per_layer(hashes)
        block_ids = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        n = len(block_ids)
        return PrefixMatch(tuple(block_ids), tuple(hashes[:n]), n * self.block_size)

    def _cached_per_layer(self, hashes: list[BlockHash]) -> PrefixMatch:
        """Every full layer needs all ``n`` leading blocks cached, a windowed layer those its window reads
        from position ``n * block_size`` on; the longest ``n`` that every layer can take."""
        found = []
        for t in range(self.layout.num_tables):
            key = self.layout.hash_key
            found.append([self.pool.lookup(key(h, t)) for h in hashes])
        n = len(hashes)
        while n > 0:
            firsts = [self.layout.first_read_block(t, n * self.block_size, self.block_size) for t in range(len(found))]
            if all(None not in ids[first:n] for ids, first in zip(found, firsts, strict=True)):
                break
            n -= 1
        if n == 0:
            return PrefixMatch()
        null = self.null_block
        tables = tuple((null,) * first + tuple(ids[first:n]) for ids, first in zip(found, firsts, strict=True))
        held = tuple(b for ids in tables for b in ids if b != null)
        return PrefixMatch(held, tuple(hashes[:n]), n * self.block_size, tables)

    def _prefix_tables(self, prefix: PrefixMatch) -> tuple[tuple[int, ...], ...]:
        if not self.per_layer:
            return (prefix.block_ids,)
        return prefix.table_block_ids or ((),) * self.layout.num_tables

    # -- allocation -----------------------------------------------------------------------------
    def allocate(
        self,
        request_id: Hashable,
        num_tokens: int | Sequence[int],
        prefix: PrefixMatch | None = None,
        *,
        write_from: int | Sequence[int] | None = None,
    ) -> list[int] | None:
        """Grow a request's tables to hold ``num_tokens`` tokens (per layer, or one count for all).

        ``prefix`` (first allocation only) maps cached blocks in before new ones. ``write_from``: the
        first slot the coming step writes (per layer, or its smallest layer's KV length); shared blocks
        from there on are swapped for copies (``take_copies``). Returns the newly allocated block ids,
        or None when the pool cannot supply them even after reclaiming idle chains (nothing changes then).
        """
        req = self._requests.get(request_id)
        if req is not None and (prefix is None or not prefix.block_ids):
            grown = self._grows_in_place(req, num_tokens, write_from)  # most decode steps
            if grown is not None:
                return grown
        if prefix is not None and prefix.block_ids and req is not None:
            raise ValueError(f"request {request_id!r} already holds blocks; a prefix can only start a table")
        prefix = prefix or PrefixMatch()
        bs = self.block_size
        targets = self.layout.per_table(num_tokens)
        tables = req.tables if req is not None else [BlockTable(bs) for _ in targets]
        starts = self._prefix_tables(prefix)
        needed = [
            max(0, -(-n // bs) - len(t.block_ids) - len(s)) for n, t, s in zip(targets, tables, starts, strict=True)
        ]
        shared = [[] for _ in tables] if write_from is None else self._shared_from(tables, write_from)
        if req is not None and not any(needed) and not any(shared):  # most decode steps: the tables have room
            for t, n in zip(tables, targets, strict=True):
                t.num_tokens = max(t.num_tokens, min(n, t.capacity))
            return []
        # Prefix blocks nobody holds sit in the free list; taking them costs free capacity too.
        if not self._ensure_free(sum(needed) + sum(map(len, shared)), prefix.block_ids):
            return None
        if req is None:
            req = self._requests[request_id] = _RequestBlocks(tables)
            self.prefix_query_tokens += max(targets)
        if prefix.block_ids or prefix.table_block_ids:
            self.pool.acquire(prefix.block_ids)
            req.hashes.extend(prefix.hashes)
            self.prefix_hit_tokens += prefix.num_tokens
            for i, start in enumerate(starts):
                tables[i].block_ids.extend(start)
                req.ids[i].extend(start)
                req.nulls[i] = sum(1 for b in start if b == self.null_block)
        new_blocks = []
        for i, table in enumerate(tables):
            self._swap_for_copies(req, i, shared[i])
            fresh = self.pool.allocate(needed[i])
            assert fresh is not None  # checked above
            table.block_ids.extend(fresh)
            req.ids[i].extend(fresh)
            table.num_tokens = max(table.num_tokens, min(targets[i], table.capacity))
            new_blocks += fresh
        return new_blocks

    def allocate_computed(
        self, request_id: Hashable, num_tokens: Sequence[int], kv_lens: Sequence[int]
    ) -> list[int] | None:
        """A new request holding ``num_tokens`` slots per layer whose first ``kv_lens`` count as computed
        without being written (benchmarks' synthetic prefill): a windowed layer takes no block its window
        no longer reads. None when it does not fit (nothing changes then)."""
        if not self.layout.windowed:
            return self.allocate(request_id, list(num_tokens))
        bs, first = self.block_size, self.layout.first_read_block
        starts = tuple((self.null_block,) * first(t, kv_lens[t], bs) for t in range(self.layout.num_tables))
        return self.allocate(request_id, list(num_tokens), PrefixMatch(table_block_ids=starts))

    def _grows_in_place(self, req: _RequestBlocks, num_tokens: int | Sequence[int], write_from) -> list[int] | None:
        """The common case: nothing from ``write_from`` on is shared and the free blocks cover the tables'
        growth; then the tables take the tokens (and fresh blocks where short: returned), else None and
        nothing changes."""
        bs, tables = self.block_size, req.tables
        if not self.per_layer:  # the shared layout's hot path: one table
            table = tables[0]
            n = num_tokens if isinstance(num_tokens, int) else max(num_tokens)
            if -(-n // bs) > len(table.block_ids):
                return None
            if write_from is not None:
                first = write_from if isinstance(write_from, int) else min(write_from)
                if self._shared(table, first // bs):
                    return None
            table.num_tokens = max(table.num_tokens, min(n, table.capacity))
            return []
        # All tables at once (a request has one per layer, or per lane): a decode step adds a block to the
        # few whose last block filled, and writes to the last one or two blocks of each.
        targets = [num_tokens] * len(tables) if isinstance(num_tokens, int) else num_tokens
        have = np.fromiter(map(len, req.ids), dtype=np.int64, count=len(req.ids))
        missing = -(-np.asarray(targets, dtype=np.int64) // bs) - have
        short = np.flatnonzero(missing > 0).tolist()
        wanted = int(missing[short].sum()) if short else 0
        if wanted > self.pool.num_free_blocks or self._writes_shared(req, write_from):
            return None  # the general path copies shared blocks and reclaims idle chains
        new_blocks = self.pool.allocate(wanted)  # one call for every short table, dealt out in table order
        assert new_blocks is not None  # checked above
        at = 0
        for i in short:
            fresh = new_blocks[at : at + int(missing[i])]
            at += len(fresh)
            tables[i].block_ids.extend(fresh)
            req.ids[i].extend(fresh)
        for table, n in zip(tables, targets, strict=True):
            if n > table.num_tokens:
                table.num_tokens = min(n, len(table.block_ids) * bs)
        return new_blocks

    def _writes_shared(self, req: _RequestBlocks, write_from) -> bool:
        """Whether a block some table writes from ``write_from`` on (per table, or one for all) is shared."""
        if write_from is None or not self.pool.num_shared_blocks:  # nothing shared anywhere: nothing to find
            return False
        bs, ids_of = self.block_size, req.ids
        firsts = [write_from] * len(ids_of) if isinstance(write_from, int) else write_from
        pairs = zip(ids_of, firsts, strict=True)
        written = [as_block_ids(ids[max(0, first // bs) :]) for ids, first in pairs if first < len(ids) * bs]
        return bool(written) and self.pool.any_shared(np.concatenate(written), self.null_block)

    def _shared_from(self, tables: list[BlockTable], write_from: int | Sequence[int]) -> list[list[int]]:
        if isinstance(write_from, int) or not self.per_layer:
            firsts = [write_from if isinstance(write_from, int) else min(write_from)] * len(tables)
        else:
            firsts = list(write_from)
        return [self._shared(t, first // self.block_size) for t, first in zip(tables, firsts, strict=True)]

    def make_exclusive(self, request_id: Hashable, first_block: int, end_block: int) -> bool:
        """Swap the shared blocks among ``block_ids[first_block:end_block]`` (of every table) for copies
        before they are rewritten in place (compaction). False, changing nothing, when the pool cannot
        supply them."""
        req = self._requests[request_id]
        shared = [[i for i in self._shared(t, first_block) if i < end_block] for t in req.tables]
        if not self._ensure_free(sum(map(len, shared))):
            return False
        for t, indices in enumerate(shared):
            self._swap_for_copies(req, t, indices)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """``(source, destination)`` block copies owed since the last call, in order; the caller must
        copy every layer's K/V before anything writes to the destinations."""
        copies, self._copies = self._copies, []
        return copies

    def num_exclusive_blocks(self, request_id: Hashable) -> int:
        """Blocks of the request's tables that nobody else holds."""
        null, refcount = self.null_block, self.pool.refcount
        return sum(1 for t in self._requests[request_id].tables for b in t.block_ids if b != null and refcount(b) == 1)

    def _shared(self, table: BlockTable, first_block: int) -> list[int]:
        ids, null, refcount = table.block_ids, self.null_block, self.pool.refcount
        return [i for i in range(max(0, first_block), len(ids)) if ids[i] != null and refcount(ids[i]) > 1]

    def _ensure_free(self, num_blocks: int, revive: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` new blocks plus the free ones among ``revive`` fit, reclaiming idle
        chains' KV if needed (which can turn a revived block free, hence the second look)."""
        for _ in range(2):
            wanted = num_blocks + sum(1 for b in revive if self.pool.refcount(b) == 0)
            if wanted <= self.pool.num_free_blocks:
                return True
            if not self.chains.reclaim(wanted):
                return False
        return num_blocks + sum(1 for b in revive if self.pool.refcount(b) == 0) <= self.pool.num_free_blocks

    def _swap_for_copies(self, req: _RequestBlocks, t: int, indices: list[int]) -> None:
        if not indices:
            return
        fresh = self.pool.allocate(len(indices))
        assert fresh is not None  # the caller checked
        table, ids = req.tables[t], req.ids[t]
        for i, new in zip(indices, fresh, strict=True):
            old = table.block_ids[i]
            table.block_ids[i] = ids[i] = new
            self._copies.append((old, new))
            self.pool.release([old])  # still held by its other holders: the content stays until copied

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is computed (``token_ids[:num_computed_tokens]``)."""
        req = self._requests[request_id]
        if not self.enable_prefix_caching or not req.cacheable:
            return
        num_full = min(num_computed_tokens // self.block_size, *(len(t.block_ids) for t in req.tables))
        if num_full <= len(req.hashes):
            return
        start = len(req.hashes)
        parent = req.hashes[-1] if req.hashes else None
        bs = self.block_size
        # Hash only the new blocks' tokens: slicing from 0 would copy the whole sequence every time.
        new_hashes = hash_full_blocks(token_ids[start * bs : num_full * bs], bs, self.salt, parent=parent)
        key, null = self.layout.hash_key, self.null_block
        for t, table in enumerate(req.tables):
            for block_id, block_hash in zip(table.block_ids[start:num_full], new_hashes, strict=True):
                if block_id != null:
                    self.pool.register(block_id, key(block_hash, t))
        req.hashes.extend(new_hashes)

    # -- giving blocks back -----------------------------------------------------------------------
    def shrink(self, request_id: Hashable, num_tokens: int | Sequence[int]) -> list[int]:
        """Keep only the blocks needed for the first ``num_tokens`` slots (per layer, or one count for
        all); release the rest (tail first).

        Used after eviction compacted a request's kept KV to the front of its tables. Blocks that were
        registered in the prefix cache cannot be shrunk away (their content is shared by hash).
        Returns the released block ids.
        """
        req = self._requests[request_id]
        targets = self.layout.per_table(num_tokens)
        for table, n in zip(req.tables, targets, strict=True):
            if not 0 <= n <= table.capacity:
                raise ValueError(f"cannot shrink to {n} tokens: the table holds {table.capacity} slots")
            if -(-n // self.block_size) < len(req.hashes):
                raise ValueError("cannot shrink into blocks registered in the prefix cache")
        released = []
        for table, ids, n in zip(req.tables, req.ids, targets, strict=True):
            keep_blocks = -(-n // self.block_size)
            released += table.block_ids[keep_blocks:]
            del table.block_ids[keep_blocks:]
            del ids[keep_blocks:]
            table.num_tokens = n
        self._release(released)
        return released

    def slide(self, request_id: Hashable, kv_lens: Sequence[int]) -> list[int]:
        """Give back each windowed layer's blocks that lie wholly before the window of a query at its
        KV length (``kv_lens``, per layer): they become the null block. Returns the released ids."""
        windowed = self.layout.windowed_tables
        if not windowed:
            return []
        req, bs, null = self._requests[request_id], self.block_size, self.null_block
        released = []
        for t in windowed:  # a layer without a window never gives blocks back here
            table, ids = req.tables[t], req.ids[t]
            first = min(self.layout.first_read_block(t, kv_lens[t], bs), len(table.block_ids))
            for i in range(req.nulls[t], first):
                released.append(table.block_ids[i])
                table.block_ids[i] = ids[i] = null
            req.nulls[t] = max(req.nulls[t], first)
        self._release(released)
        return released

    def free(self, request_id: Hashable) -> None:
        """Give back all of a request's blocks, tail first."""
        req = self._requests.pop(request_id)
        held = [as_block_ids(ids) for ids in req.ids if ids]  # the packed twins: no per-block conversion
        self._release(np.concatenate(held) if held else [])

    def _release(self, block_ids: list[int] | np.ndarray) -> None:
        """Give ``block_ids`` back in reverse order (tail first); null blocks are skipped."""
        block_ids = as_block_ids(block_ids)
        if self.null_block is not None:
            block_ids = block_ids[block_ids != self.null_block]
        if self._copies:  # a copy into a block given back (preempted in the same schedule) is moot
            gone = set(block_ids.tolist())
            self._copies = [(s, d) for s, d in self._copies if d not in gone]
        self.pool.release(block_ids[::-1])

    # -- chains ---------------------------------------------------------------------------------
    def _handle(self, req: _RequestBlocks) -> RequestTables:
        return LayerTables(req.tables, self.null_block) if self.per_layer else req.tables[0]

    def attach(self, request_id: Hashable, table: RequestTables, hashes: Sequence[BlockHash] | None = None) -> None:
        """Adopt ``table`` (and its block references) as a request's tables. ``hashes``: the radix hashes
        of its leading full blocks when its KV is token-exact; None keeps its blocks out of the radix cache."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if isinstance(table, LayerTables) != self.per_layer:
            raise ValueError("the table's layout is not this manager's")
        tables = list(table.tables) if isinstance(table, LayerTables) else [table]
        req = self._requests[request_id] = _RequestBlocks(tables, list(hashes or ()), cacheable=hashes is not None)
        for t, ids in enumerate(req.ids):
            req.nulls[t] = next((i for i, b in enumerate(ids) if b != self.null_block), len(ids))

    def detach(self, request_id: Hashable) -> tuple[RequestTables, tuple[BlockHash, ...] | None]:
        """Hand a request's tables (and references) to the caller, with its radix hashes when exact."""
        req = self._requests.pop(request_id)
        exact = req.cacheable and self.enable_prefix_caching
        return self._handle(req), tuple(req.hashes) if exact else None

    def resume_chain(
        self, request_id: Hashable, chain_id: str, token_ids: Sequence[int], *, create: bool = True
    ) -> ChainCheckout:
        """Check chain ``chain_id`` out for a request whose full prompt is ``token_ids``; when it is
        resumed, the request now holds the retained table. Raises the chain cache's errors."""
        checkout = self.chains.checkout(chain_id, token_ids, self.salt, request_id, create=create)
        if checkout.table is not None:
            self.attach(request_id, checkout.table, checkout.hashes)
        return checkout

    def save_chain(
        self,
        request_id: Hashable,
        chain_id: str,
        token_ids: Sequence[int],
        kv_lens: Sequence[int],
        state=None,
        pending: Sequence[int] = (),
    ) -> None:
        """The request's turn on the chain ended: the chain takes its tables (KV of ``token_ids``, each
        layer holding ``kv_lens`` slots), ``state`` and the ``pending`` tokens after them whose KV is
        not computed; a request holding no blocks leaves no KV (its tokens all become pending)."""
        if request_id not in self._requests:
            self.chains.checkin(chain_id, request_id, (), None, pending=[*token_ids, *pending])
            return
        if kv_lens:
            targets = self.layout.per_table(list(kv_lens))
            tables = self._requests[request_id].tables
            if any(len(t.block_ids) > -(-n // self.block_size) for t, n in zip(tables, targets, strict=True)):
                self.shrink(request_id, list(kv_lens))
        table, hashes = self.detach(request_id)
        self.chains.checkin(chain_id, request_id, token_ids, table, kv_lens, state, hashes, pending)

    def add_pruned_chain(
        self, chain_id: str | None, token_ids: Sequence[int], source: PrefixMatch, plan: PrunePlan, num_layers: int
    ) -> tuple[str, list[tuple[int, int]]]:
        """Register the pruned copy of a cached history as a degraded chain.

        ``source``: the history's cached blocks (the caller holds them); ``plan``: what is retained.
        The chain shares the source's unchanged leading blocks and gets fresh blocks for the rest.
        Returns the chain id and the ``(source slot, destination slot)`` KV copies the caller must
        make. Raises ValueError when the pool cannot supply the blocks, ``ChainError`` on capacity.
        """
        if self.per_layer:
            raise ValueError("pruning a cached history needs the shared layout (one table for every layer)")
        self.chains.check_room(chain_id)
        bs = self.block_size
        shared = list(source.block_ids[: plan.num_shared_blocks])
        num_fresh = -(-plan.num_retained // bs) - len(shared)
        if not self._ensure_free(num_fresh):
            raise ValueError(f"pruning needs {num_fresh} free KV blocks; the pool has {self.num_free_blocks}")
        self.pool.acquire(shared)
        fresh = self.pool.allocate(num_fresh)
        assert fresh is not None  # checked above
        table = BlockTable(bs, shared + fresh, plan.num_retained)
        try:
            chain_id = self.chains.add(
                chain_id,
                self.salt,
                token_ids[: plan.num_tokens],
                table,
                [plan.num_retained] * num_layers,
                degraded=True,
            )
        except Exception:
            self.pool.release(reversed(table.block_ids))
            raise
        src = [source.block_ids[p // bs] * bs + p % bs for p in plan.copied_positions()]
        dst = [table.slot(i) for i in range(plan.first_copied_slot, plan.num_retained)]
        return chain_id, list(zip(src, dst, strict=True))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
