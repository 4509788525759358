"""Content hashes of KV blocks, chained so that a block's hash names its whole prefix.

A block's hash covers its parent's hash and its own token ids, so two requests share a cached
block only when every token before it matches too. The chain starts from a root derived from a
salt that fingerprints everything else the KV depends on (model, dtype, method config), so caches
of different configurations can never be confused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def root_hash(salt: bytes | str = b"") -> BlockHash:
    """The parent hash of a chain's first block for a given salt."""
    salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt)
    return hashlib.sha256(b"sparse-engine/root\0" + salt_bytes).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash and its token ids."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, salt: bytes | str = b"", start: int = 0, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``.

    Parameters
    ----------
    token_ids : the sequence's tokens.
    block_size : tokens per block.
    salt : configuration fingerprint (ignored when ``parent`` is given).
    start : index of the first block to hash; ``parent`` must then be block ``start - 1``'s hash.
    parent : hash of the block before ``start`` (None: the chain's root).

    Returns
    -------
    Hashes of blocks ``start .. len(token_ids) // block_size - 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError("hashing from a block other than the first needs the parent's hash")
    prev = root_hash(salt) if parent is None else parent
    hashes = []
    for b in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(prev)
    return hashes
