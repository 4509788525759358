"""Prefix-cache pruning: the layout of a compressed copy of an exact cached history.

Pruning keeps, inside chosen token ranges of a cached history (an old tool output, say), only the
tokens a scoring policy picked, and every token outside the ranges. The result is a *degraded*
history: its KV no longer matches its tokens one to one, so it lives in the chain cache (resumed by
naming it), never in the radix cache, where a request that did not ask for pruning could hit it.

This module only plans: which positions are retained and where they go. Leading blocks whose
slots do not change are shared with the source; every later retained slot is copied, in order,
to fresh blocks. Scoring (which tokens of a range to keep) is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PruneRange:
    """Token positions ``[start, end)`` of a history to compress."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def check_ranges(ranges: Sequence[tuple[int, int] | PruneRange], num_tokens: int) -> tuple[PruneRange, ...]:
    """Validated ranges: non-empty, inside ``[0, num_tokens)``, ascending and not overlapping."""
    out = [r if isinstance(r, PruneRange) else PruneRange(*r) for r in ranges]
    if not out:
        raise ValueError("no ranges to prune")
    prev_end = 0
    for r in out:
        if not 0 <= r.start < r.end <= num_tokens:
            raise ValueError(f"range [{r.start}, {r.end}) is empty or outside the history's {num_tokens} tokens")
        if r.start < prev_end:
            raise ValueError(f"range [{r.start}, {r.end}) overlaps or precedes the previous range")
        prev_end = r.end
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PrunePlan:
    """``retained[i]``: the history position whose KV slot ``i`` of the pruned table holds (ascending).

    ``num_shared_blocks`` leading blocks are unchanged (``retained[i] == i`` throughout them) and
    are shared with the source; the slots after them are copied from the source.
    """

    num_tokens: int
    retained: tuple[int, ...]
    num_shared_blocks: int
    block_size: int

    @property
    def num_retained(self) -> int:
        return len(self.retained)

    @property
    def first_copied_slot(self) -> int:
        return self.num_shared_blocks * self.block_size

    def copied_positions(self) -> tuple[int, ...]:
        """Source positions of slots ``first_copied_slot ..`` of the pruned table, in order."""
        return self.retained[self.first_copied_slot :]


def plan_prune(
    num_tokens: int, ranges: Sequence[PruneRange], kept: Sequence[Sequence[int]], block_size: int
) -> PrunePlan:
    """The pruned layout of a ``num_tokens`` history keeping ``kept[j]`` (positions inside
    ``ranges[j]``, ascending, unique) of each range and every position outside the ranges."""
    ranges = check_ranges(ranges, num_tokens)
    if len(kept) != len(ranges):
        raise ValueError(f"{len(kept)} kept sets for {len(ranges)} ranges")
    retained: list[int] = []
    pos = 0
    for r, keep in zip(ranges, kept, strict=True):
        keep = list(keep)
        if keep != sorted(set(keep)) or any(not r.start <= p < r.end for p in keep):
            raise ValueError(f"kept positions of [{r.start}, {r.end}) must be ascending, unique and inside it")
        retained.extend(range(pos, r.start))
        retained.extend(keep)
        pos = r.end
    retained.extend(range(pos, num_tokens))
    first_changed = next((i for i, p in enumerate(retained) if p != i), len(retained))
    return PrunePlan(num_tokens, tuple(retained), first_changed // block_size, block_size)
