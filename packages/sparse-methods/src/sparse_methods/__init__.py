"""Sparse-attention and KV-compression methods behind one lifecycle contract.

``build_method(name, shape, **params)`` makes a method from the flat parameter vocabulary;
``method_names()`` lists the registry. The contract (``SparseMethod``) is in ``base``; scoring
functions are pure and exported from ``scoring``. See ``../shared/DESIGN.md``.
"""

from sparse_methods import methods  # noqa: F401 - registers the methods
from sparse_methods.attention_batch import LayerAttentionBatch, PagedKeys
from sparse_methods.base import (
    DENSE_LAYER,
    AttentionState,
    Category,
    Compaction,
    DecodeBatch,
    DecodeRead,
    DecodeSelection,
    DeviceState,
    HeadReduction,
    LayerAttention,
    LayerPlan,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefillPolicy,
    PrefillView,
    PrefixCacheMode,
    ReplayPass,
    RequestStep,
    Selection,
    SparseMethod,
    StepContext,
    Storage,
    StoreKind,
    Support,
    Unit,
)
from sparse_methods.cluster_arena import ClusterArena
from sparse_methods.decode_score_sums import DecodeScoreSums
from sparse_methods.keep_rows import KeepRows
from sparse_methods.prefill_attention import PrefillAttention
from sparse_methods.query_ring import QueryRing
from sparse_methods.registry import (
    build_method,
    canonical_method_name,
    check_prefill_method,
    get_method_class,
    make_config,
    make_prefill_attention,
    method_names,
    parameter_fields,
    parameter_owners,
    prefill_method_names,
    register,
)

__all__ = [
    "DENSE_LAYER",
    "AttentionState",
    "Category",
    "ClusterArena",
    "Compaction",
    "DecodeBatch",
    "DecodeRead",
    "DecodeSelection",
    "DecodeScoreSums",
    "DeviceState",
    "HeadReduction",
    "KeepRows",
    "LayerAttention",
    "LayerAttentionBatch",
    "LayerPlan",
    "MemoryPlan",
    "MethodConfig",
    "ModelShape",
    "PagedKeys",
    "PrefillAttention",
    "PrefillPolicy",
    "PrefillView",
    "PrefixCacheMode",
    "QueryRing",
    "ReplayPass",
    "RequestStep",
    "Selection",
    "SparseMethod",
    "StepContext",
    "Storage",
    "StoreKind",
    "Support",
    "Unit",
    "build_method",
    "canonical_method_name",
    "check_prefill_method",
    "get_method_class",
    "make_config",
    "make_prefill_attention",
    "method_names",
    "parameter_fields",
    "parameter_owners",
    "prefill_method_names",
    "register",
]
