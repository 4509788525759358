"""Block tables: which pool blocks hold a request's KV, per layer.

Dense and logical-selection methods keep the same tokens in every layer, so all layers share one
table. Eviction methods with per-layer budgets let layers diverge; ``LayerTables`` maps each
layer to its table so both cases read the same way.
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

    def last_block_len(self) -> int:
        """Tokens used in the last block (1..block_size); the table must hold at least one token."""
        if self.num_tokens < 1:
            raise ValueError("an empty table has no last block")
        return (self.num_tokens - 1) % self.block_size + 1


class LayerTables:
    """Maps each layer to a block table; ``shared=True`` gives every layer the same table."""

    def __init__(self, num_layers: int, block_size: int, shared: bool = True):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.shared = shared
        self.tables = [BlockTable(block_size) for _ in range(1 if shared else num_layers)]

    def __getitem__(self, layer: int) -> BlockTable:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return self.tables[0 if self.shared else layer]
