"""Sparse-attention and KV-compression methods behind one lifecycle contract.

The registry, the ``SparseMethodRuntime`` contract and the methods themselves (StreamingLLM,
SnapKV, PyramidKV, H2O, Quest, OmniKV, ...) land here with the sparse-methods issues; until then
the engine runs dense attention only. See ``../shared/DESIGN.md`` for the contract.
"""
