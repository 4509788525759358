"""Block tables: which pool blocks hold a request's KV, per layer.

Dense and logical-selection methods keep the same tokens in every layer, so all layers share one
table (a ``BlockTable``). Where layers diverge (per-layer budgets, sliding windows) a request holds
``LayerTables``: one table per layer, all drawing from one pool of block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockTable:
    """The blocks of one request in one layer group, in sequence order.

    ``num_tokens`` counts the slots in use; they fill ``block_ids`` from the front.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks required for the table to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(self.block_ids))

    def slot(self, position: int) -> int:
        """Pool slot (``block_id * block_size + offset``) of the token at ``position``."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} outside the table's {self.capacity} slots")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def copy(self) -> BlockTable:
        return BlockTable(self.block_size, list(self.block_ids), self.num_tokens)

    def last_block_len(self) -> int:
        """Tokens used in the last block (1..block_size); the table must hold at least one token."""
        if self.num_tokens < 1:
            raise ValueError("an empty table has no last block")
        return (self.num_tokens - 1) % self.block_size + 1


class LayerTables:
    """One request's block tables, one per layer (the per-layer layout).

    A sliding-window layer's blocks that lie wholly before its window are given back and replaced in
    its table by ``null_block``, a reserved block that no request holds and no kernel reads (it keeps
    every later block at its position). ``block_ids`` lists the blocks the request holds, all layers.
    """

    __slots__ = ("tables", "null_block")

    def __init__(self, tables: list[BlockTable], null_block: int | None = None):
        if not tables:
            raise ValueError("LayerTables needs at least one layer's table")
        self.tables = tables
        self.null_block = null_block

    def __getitem__(self, layer: int) -> BlockTable:
        return self.tables[layer]

    def __len__(self) -> int:
        return len(self.tables)

    @property
    def block_size(self) -> int:
        return self.tables[0].block_size

    @property
    def num_tokens(self) -> int:
        return max(t.num_tokens for t in self.tables)

    @property
    def block_ids(self) -> list[int]:
        null = self.null_block
        return [b for t in self.tables for b in t.block_ids if b != null]

    def copy(self) -> LayerTables:
        return LayerTables([t.copy() for t in self.tables], self.null_block)


RequestTables = BlockTable | LayerTables
"""What a request (or a chain) holds: one table for every layer, or one per layer."""
