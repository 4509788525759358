"""The chain cache's errors: each case a class (all ``ValueError``), with a ``code`` for API layers."""

from __future__ import annotations


class ChainError(ValueError):
    """Base of the chain cache's errors; ``code`` names the case for API layers."""

    code = "chain_error"


class UnknownChainError(ChainError):
    """No chain of that id (appending to, forking or dropping it)."""

    code = "chain_not_found"


class ChainExistsError(ChainError):
    """A new chain (fork, pruned copy) was given an id already in use."""

    code = "chain_exists"


class ChainBusyError(ChainError):
    """The chain is checked out by a request (a second writer, or a fork or drop meanwhile)."""

    code = "chain_busy"


class ChainPrefixMismatchError(ChainError):
    """The prompt does not extend the chain's processed tokens by at least one token."""

    code = "chain_prefix_mismatch"


class ChainFingerprintError(ChainError):
    """The chain was built under another model, dtype or method configuration."""

    code = "chain_fingerprint_mismatch"


class ChainCapacityError(ChainError):
    """Every chain record is in use, so none can be forgotten to make room."""

    code = "chain_capacity"
