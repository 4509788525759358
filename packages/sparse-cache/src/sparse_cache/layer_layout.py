"""Which block tables a request's layers use: one table shared by every layer, or one per layer.

The shared layout (one table; block ``b`` means the same block in every layer's KV tensors) is the
fast path: dense and logical-selection methods keep the same slots in every layer. When layers hold
different amounts (per-layer budgets such as PyramidKV's, sliding-window layers that keep only their
window) every layer gets its own table, and block ids come from one pool shared by all layers (one KV
tensor per kind that every layer indexes with its own ids), so the memory in use is the sum of what
each layer holds instead of its largest layer times the layer count.

The head-major layout (``heads > 1``) goes one step further: every (layer, KV head) is a *lane* with
its own table, and a block holds one head's K/V, so the KV heads of a layer may keep different numbers
of tokens (ragged per-head budgets) and the memory in use is the sum of what each head holds. Lane
``layer * heads + head`` is table ``layer * heads + head``. Per-layer token counts given to a head-major
layout are per-head averages of ragged lanes: a layer of average ``n`` takes at most
``ceil(heads * (n + block_size - 1) / block_size)`` blocks (each lane wastes less than one block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sparse_cache.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """The tables of a request's layers.

    num_layers : layers of the model.
    per_layer : one table per layer (else one table for all).
    window_left : per layer (per-layer layout only; empty otherwise): a query at position ``p`` reads
        slots ``p - window_left .. p`` (the kernels' ``window_left``); None: every slot.
    heads : tables per layer: 1, or the KV heads of the head-major layout (one lane per head).
    """

    num_layers: int
    per_layer: bool = False
    window_left: tuple[int | None, ...] = ()
    heads: int = 1

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.window_left and len(self.window_left) != self.num_layers:
            raise ValueError(f"{len(self.window_left)} windows for {self.num_layers} layers")
        if any(w is not None for w in self.window_left) and not self.per_layer:
            raise ValueError("sliding windows free blocks per layer: they need the per-layer layout")
        if self.heads < 1 or (self.heads > 1 and (not self.per_layer or self.windowed)):
            raise ValueError(f"the head-major layout ({self.heads} heads) needs per-layer tables and no window")

    @classmethod
    def head_major(cls, num_layers: int, heads: int) -> LayerLayout:
        """One table per (layer, KV head) lane."""
        return cls(num_layers, True, (None,) * num_layers, heads)

    @classmethod
    def choose(
        cls, num_layers: int, window_left: Sequence[int | None] = (), plans: Iterable[Sequence[int]] = ()
    ) -> LayerLayout:
        """Per-layer tables when some layer slides over a window or some plan (tokens per layer, e.g. a
        method's memory plan) differs between layers; the shared table otherwise."""
        windows = tuple(None if w is None or w < 0 else w for w in window_left)
        diverge = any(w is not None for w in windows) or any(len(set(p)) > 1 for p in plans)
        if not diverge:
            return cls(num_layers)
        return cls(num_layers, True, windows or (None,) * num_layers)

    @property
    def num_tables(self) -> int:
        return self.num_layers * self.heads if self.per_layer else 1

    @property
    def num_lens(self) -> int:
        """KV lengths a request keeps: one per layer, or per lane in the head-major layout."""
        return self.num_layers * self.heads

    def lanes(self, layer: int) -> range:
        """The tables of ``layer`` (its one table, or its heads' lanes)."""
        return range(layer * self.heads, (layer + 1) * self.heads) if self.per_layer else range(1)

    def layer_lens(self, lens: Sequence[int]) -> tuple[int, ...]:
        """Per layer, the most slots a lane of it holds (``lens``: per layer, or per lane)."""
        if len(lens) == self.num_layers:
            return tuple(lens)
        return tuple(max(lens[t] for t in self.lanes(layer)) for layer in range(self.num_layers))

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.window_left)

    @property
    def windowed_tables(self) -> tuple[int, ...]:
        """The tables whose layer slides over a window (empty in the shared layout)."""
        return tuple(t for t, w in enumerate(self.window_left) if w is not None) if self.per_layer else ()

    def window(self, table: int) -> int | None:
        return self.window_left[table // self.heads] if self.per_layer else None

    def per_table(self, tokens: int | Sequence[int]) -> list[int]:
        """Slots each table must hold for a request holding ``tokens`` (per layer, per lane in the
        head-major layout, or one count for all; a layer's count goes to each of its lanes)."""
        if isinstance(tokens, int):
            return [tokens] * self.num_tables
        if self.heads > 1 and len(tokens) == self.num_tables:
            return list(tokens)
        if len(tokens) != self.num_layers:
            raise ValueError(f"{len(tokens)} token counts for {self.num_layers} layers")
        if not self.per_layer:
            return [max(tokens)]
        return [n for n in tokens for _ in range(self.heads)]

    def num_blocks(self, tokens: int | Sequence[int], block_size: int, step: int | None = None) -> int:
        """Blocks a request holding ``tokens`` slots (per layer, per lane, or one count for all) takes from
        the pool; with ``step`` (the tokens a step adds), a windowed layer's at most its window and the
        step. Head-major per-layer counts are per-head averages of ragged lanes (their bound)."""
        if self.heads > 1 and not isinstance(tokens, int) and len(tokens) == self.num_layers:
            h = self.heads
            return sum(-(-h * (n + block_size - 1) // block_size) if n else 0 for n in tokens)
        per_table = self.per_table(tokens)
        if step is not None and self.windowed:
            per_table = self.window_peaks(per_table, step, block_size)
        return sum(-(-n // block_size) for n in per_table)

    def window_peaks(self, tokens: Sequence[int], chunk: int, block_size: int) -> tuple[int, ...]:
        """``tokens`` per layer, a windowed layer's capped at what it holds at most while it advances in
        steps of up to ``chunk`` tokens: its window and the step, in whole blocks, plus one partial block."""
        if not self.windowed:
            return tuple(tokens)
        return tuple(
            n if w is None else min(n, (-(-(w + chunk) // block_size) + 1) * block_size)
            for n, w in zip(tokens, self.window_left, strict=True)
        )

    def first_read_block(self, table: int, kv_len: int, block_size: int) -> int:
        """The table's first block a query at position ``kv_len`` (or later) reads: blocks before it
        may be given back (0 for a table without a window)."""
        w = self.window(table)
        return 0 if w is None else max(0, kv_len - w) // block_size

    def hash_key(self, block_hash: BlockHash, table: int) -> BlockHash:
        """The prefix-cache key of a table's block: each layer's copy of a prefix is its own entry."""
        return block_hash if table == 0 else block_hash + table.to_bytes(4, "little")
