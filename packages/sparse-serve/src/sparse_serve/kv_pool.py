"""The KV pool: every layer's tensors of one store kind, sized from the memory budget.

The store kind (``sparse_cache.StoreKind``) says what a block holds (plain K/V, K/V plus key
summaries, or quantized codes with their scales) and what a running request holds beside the pool
(KIVI's tail); this module allocates those tensors per layer and counts their bytes. The store
kind is chosen here from the method's declaration and the engine's ``kv_cache_dtype``.

In the per-layer layout (``sparse_cache.LayerLayout``: each layer has its own block table) every
layer's entry is a view of one tensor per kind holding all layers' blocks: a block id names the same
memory whichever layer's table holds it, so the pool's blocks serve any layer. A head-major store
(``head_major_paged``: one KV head per block) is laid out the same way, with a table per (layer, KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_cache import MODEL_DTYPE, SUMMARY_TENSORS, StoreKind, head_major_paged, latent_paged, paged, quantized_paged
from sparse_kernels.kv_quant import lloyd_max_codebook, turboquant_rotation
from sparse_kernels.quantized_kv import QuantizedKV
from sparse_methods import SparseMethod, Support, get_method_class, method_names
from sparse_methods import StoreKind as MethodStore
from sparse_models import ModelConfig


@dataclass(frozen=True, slots=True)
class KVPool:
    """``layers[l]``: layer ``l``'s block tensors by name (leading dim ``num_blocks``); ``tails[l]``:
    its tail tensors (leading dim: tail rows), empty when the store has no tail.

    In the per-layer layout ``layers[l]`` holds the same tensors for every ``l`` (all layers' blocks).
    Plain stores: ``k[l]`` / ``v[l]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD);
    with summaries ``kmin[l]`` / ``kmax[l]`` ``[num_blocks, num_kv_heads, head_dim]`` are each block's
    elementwise min / max key. Quantized stores: ``quantized[l]`` is the layer as the quantized
    kernels read it (``sparse_kernels.QuantizedKV``).
    """

    store: StoreKind
    layers: tuple[dict[str, torch.Tensor], ...]
    tails: tuple[dict[str, torch.Tensor], ...]
    quantized: tuple[QuantizedKV, ...] | None = None

    @classmethod
    def from_tensors(cls, k: tuple[torch.Tensor, ...], v: tuple[torch.Tensor, ...]) -> KVPool:
        """A plain pool over caller-owned per-layer K and V ``[num_blocks, block_size, Hkv, D]``."""
        _, block_size, heads, head_dim = k[0].shape
        layers = tuple({"k": kl, "v": vl} for kl, vl in zip(k, v, strict=True))
        return cls(paged(block_size, heads, head_dim), layers, tuple({} for _ in layers))

    @property
    def num_blocks(self) -> int:
        return next(iter(self.layers[0].values())).shape[0]

    @property
    def num_tail_rows(self) -> int:
        return self.tails[0]["k_tail"].shape[0] if self.store.has_tail else 0

    @property
    def device(self) -> torch.device:
        return next(iter(self.layers[0].values())).device

    @property
    def latent(self) -> tuple[torch.Tensor, ...] | None:
        """Latent stores: per layer ``[num_blocks, block_size, 1, latent_dim + rope_dim]``; else None."""
        return tuple(layer["kv"] for layer in self.layers) if self.store.latent else None

    @property
    def k(self) -> tuple[torch.Tensor, ...]:
        return tuple(layer["k"] for layer in self.layers)

    @property
    def v(self) -> tuple[torch.Tensor, ...]:
        return tuple(layer["v"] for layer in self.layers)

    @property
    def kmin(self) -> tuple[torch.Tensor, ...] | None:
        return tuple(layer["kmin"] for layer in self.layers) if self.store.summaries else None

    @property
    def kmax(self) -> tuple[torch.Tensor, ...] | None:
        return tuple(layer["kmax"] for layer in self.layers) if self.store.summaries else None

    @property
    def kscale(self) -> tuple[torch.Tensor, ...] | None:
        """Summaries kept as int8 codes: per layer each block's scale ``[num_blocks, num_kv_heads]``; else None."""
        return tuple(layer["kscale"] for layer in self.layers) if self.store.summary_codes else None

    def summary(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Layer ``layer``'s block summaries ``(kmin, kmax, scale)`` (scale None in the model dtype); None
        without summaries."""
        if not self.store.summaries:
            return None
        t = self.layers[layer]
        return t["kmin"], t["kmax"], t.get("kscale")

    @property
    def one_tensor(self) -> bool:
        """The per-layer layout: every layer indexes the same tensors."""
        return len(self.layers) > 1 and self.layers[0] is self.layers[1]

    def block_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-block tensor (a block's whole content, for copies): every layer's, each tensor once."""
        layers = self.layers[:1] if self.one_tensor else self.layers
        return tuple(t for layer in layers for t in layer.values())

    def nbytes(self) -> int:
        """Bytes the pool's tensors take (blocks and tails, all layers)."""
        tails = (t for layer in self.tails for t in layer.values())
        return sum(t.numel() * t.element_size() for t in (*self.block_tensors(), *tails))


def store_kind(
    method: SparseMethod | None,
    cfg: ModelConfig,
    block_size: int,
    kv_cache_dtype: str = "auto",
    *,
    kivi_bits: int | None = None,
    turboquant_bits: int | None = None,
    turboquant_seed: int | None = None,
) -> StoreKind:
    """The store kind for ``method`` over a ``kv_cache_dtype`` store (``auto``: the model dtype)."""
    h, d = cfg.num_key_value_heads, cfg.head_dim
    summaries = method is not None and method.storage.kind is MethodStore.PAGED_WITH_SUMMARIES
    summary_dtype = method.storage.summary_dtype if summaries else MODEL_DTYPE
    if method is not None and method.storage.kind is MethodStore.HEAD_MAJOR and cfg.mla is None:
        if kv_cache_dtype != "auto":
            raise ValueError(f"{method.name} keeps a head-major store in the model dtype, not {kv_cache_dtype!r}")
        return head_major_paged(block_size, h, d)
    if cfg.mla is not None:  # multi-head latent attention: one latent row per token
        if method is not None and Support.MLA not in method.supports:
            able = [name for name in method_names() if Support.MLA in get_method_class(name).supports]
            raise ValueError(
                f"method {method.name} does not support MLA models ({cfg.architecture}); those that do: {able}"
            )
        if kv_cache_dtype != "auto":
            raise ValueError(f"MLA models keep a latent store in the model dtype, not {kv_cache_dtype!r}")
        rope = cfg.mla.qk_rope_head_dim
        return latent_paged(block_size, cfg.mla.kv_lora_rank, rope, summaries=summaries, summary_dtype=summary_dtype)
    if kv_cache_dtype == "auto":
        return paged(block_size, h, d, summaries=summaries, summary_dtype=summary_dtype)
    if kv_cache_dtype == "fp8":
        return quantized_paged("fp8", 8, block_size, h, d, summaries=summaries, summary_dtype=summary_dtype)
    if kv_cache_dtype == "kivi":  # summaries: the pages' own key statistics (StoreKind.page_stat_levels)
        return quantized_paged("kivi", kivi_bits or 4, block_size, h, d)
    if kv_cache_dtype == "turboquant":
        seed = turboquant_seed or 0
        bits = turboquant_bits or 4
        return quantized_paged(
            "turboquant", bits, block_size, h, d, seed=seed, summaries=summaries, summary_dtype=summary_dtype
        )
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")


def _torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == MODEL_DTYPE else getattr(torch, name)


def bytes_per_block(store: StoreKind, num_layers: int, dtype: torch.dtype) -> int:
    """KV bytes one block takes across all layers."""
    return store.bytes_per_block(torch.empty((), dtype=dtype).element_size()) * num_layers


def tail_bytes(store: StoreKind, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes one running request's tail takes across all layers (0 without a tail)."""
    return store.tail_bytes(torch.empty((), dtype=dtype).element_size()) * num_layers


def allocate_kv_pool(
    store: StoreKind,
    num_layers: int,
    num_blocks: int,
    dtype: torch.dtype,
    device,
    num_tail_rows: int = 0,
    one_tensor: bool = False,
    tables_per_layer: int = 1,
) -> KVPool:
    """Every layer's tensors of ``store``: ``num_blocks`` blocks and ``num_tail_rows`` tail rows.
    ``one_tensor`` (the per-layer layout): one tensor per kind of ``num_layers * tables_per_layer *
    num_blocks`` blocks (``tables_per_layer``: the head-major layout's KV heads), which every layer
    indexes (the same bytes)."""
    device = torch.device(device)
    # Kernels read only slots that were written. On CPU an uninitialised pool costs memory only as
    # it fills (the OS maps pages on first touch); on GPU it is zeroed, so padded graph rows read zeros.
    # Quantized stores are zeroed everywhere: a never-written fp8 byte could be NaN.
    new = torch.empty if device.type == "cpu" and not store.quantized else torch.zeros

    def blocks(n: int) -> dict[str, torch.Tensor]:
        specs = store.block_tensors
        return {t.name: new((n, *t.shape), dtype=_torch_dtype(t.dtype, dtype), device=device) for t in specs}

    if one_tensor:
        layers = (blocks(num_layers * tables_per_layer * num_blocks),) * num_layers
    else:
        layers = tuple(blocks(num_blocks) for _ in range(num_layers))
    tails = tuple(
        {
            t.name: torch.zeros((num_tail_rows, *t.shape), dtype=_torch_dtype(t.dtype, dtype), device=device)
            for t in store.tail_tensors
        }
        for _ in range(num_layers)
    )
    if not store.quantized:
        return KVPool(store, layers, tails)
    extra = {}
    if store.scheme == "turboquant":
        extra = {
            "rotation": turboquant_rotation(store.head_dim, store.seed).to(device),
            "codebook": lloyd_max_codebook(store.bits).to(device),
        }
    quantized = tuple(
        QuantizedKV(
            store.scheme,
            store.bits,
            store.head_dim,
            group=store.group,
            **{name: t for name, t in layer.items() if name not in SUMMARY_TENSORS},  # the pool's, not QuantizedKV's
            **tail,
            **extra,
        )
        for layer, tail in zip(layers, tails, strict=True)
    )
    return KVPool(store, layers, tails, quantized)


def num_blocks_for_budget(
    store: StoreKind,
    num_layers: int,
    dtype: torch.dtype,
    budget_bytes: int,
    cap: int | None = None,
    num_tail_rows: int = 0,
) -> int:
    """Blocks that fit in ``budget_bytes`` after the tails (at most ``cap``); an error when none fits."""
    per_block = bytes_per_block(store, num_layers, dtype)
    available = budget_bytes - num_tail_rows * tail_bytes(store, num_layers, dtype)
    n = available // per_block
    if cap is not None:
        n = min(n, cap)
    if n < 1:
        raise ValueError(
            f"no KV block fits: {budget_bytes / 2**20:.1f} MiB available, {per_block / 2**20:.2f} MiB per block"
            + (f" after {num_tail_rows} tails" if num_tail_rows else "")
        )
    return int(n)
