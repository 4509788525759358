"""Run a registered eviction method inside HF transformers' ``model.generate`` on an unmodified model.

    with SparseKVCache(model, "snapkv", decode_keep_tokens=64, recent_keep_tokens=32) as cache:
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)

``SparseKVCache`` is a ``DynamicCache`` that holds, per layer, the K/V slots the method kept (each KV
head may keep different tokens, as in the engine) and every slot's logical position. It reports the
*logical* length (tokens processed) as its sequence length, so ``generate`` computes
``cache_position`` and the RoPE positions as if nothing had been evicted.

Inside the ``with`` block the model's attention implementation is ``"sparse_methods"``, registered
through transformers' ``AttentionInterface`` (the documented way to plug attention in; the model's
code is not touched, and the previous implementation comes back on exit). That attention:

1. attends over the kept slots: every kept slot is older than every new token, so the mask is
   "all cached slots, then the new tokens causally" whatever was evicted;
2. hands the method the step's post-RoPE queries and the layer's keys (``LayerAttentionBatch``) when the
   method asked for them (what ``prepare_step`` returned);
3. after the last layer, applies the method's compactions (``finish_step``) to every layer.

The method sees the same calls as inside ``sparse_serve``: ``prepare_step`` with one
``RequestStep`` per batch row (row ``b`` is request ``b``) before the first layer, hooks per layer,
``finish_step`` after the forward. A forward of several tokens is a prompt (the first forward of a
cache, or a later turn's new tokens); a forward of one token after the first is a decode step.

Limits: rows of a batch must have the same length (no padding) and the method must keep equally
many slots in each row and KV head of a layer (not AdaKV's or KVzip's ragged heads); greedy and
sampled decoding work, beam search does not; every layer must be full attention (no sliding window).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import Category, LayerAttention, ModelShape, RequestStep, StepContext, StoreKind
from sparse_methods.registry import build_method

ATTENTION_NAME = "sparse_methods"
_ACTIVE: dict[int, SparseKVCache] = {}  # id(decoder config) -> the cache whose `with` block is open


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    cache = _ACTIVE.get(id(module.config))
    if cache is None:
        raise RuntimeError("the sparse_methods attention runs only inside `with SparseKVCache(model, ...)`")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sparse_methods.hf supports full-attention layers only (this layer has a sliding window)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache._attend(module.layer_idx, query, key, value, scaling), None


def _padding_check(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """The mask interface: our attention builds its own mask; refuse padded batches, which it does not model."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("SparseKVCache needs rows of equal length: padded batches are not supported")
    return None


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, _padding_check)


def model_shape(config: Any) -> ModelShape:
    """The ``ModelShape`` of an HF decoder config (full-attention layers only)."""
    types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise ValueError(f"sparse_methods.hf supports full-attention layers only; this model has {sorted(set(types))}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(config.num_hidden_layers, heads, kv_heads, head_dim)


class SparseKVCache(DynamicCache):
    """A KV cache run by a registered eviction method, and the context that routes attention through it.

    Parameters
    ----------
    model
        An HF causal LM (Llama, Qwen2, Qwen3, Mistral, ... with full attention).
    sparse_method
        A registered method name (``sparse_methods.method_names()``) of the physical-eviction
        category (or ``dense``).
    prefill_sparse_method, **params
        The method's parameters, as for ``sparse_methods.build_method`` (and ``sparse_serve.LLM``).

    Use one cache per generation (as a ``DynamicCache``); ``generate`` again with the same cache and
    the whole history as input continues the conversation from the kept KV.
    """

    def __init__(self, model: torch.nn.Module, sparse_method: str, prefill_sparse_method: str | None = None, **params):
        super().__init__()
        self.model = model
        self._config = model.config.get_text_config(decoder=True)
        self.shape = model_shape(self._config)
        self.method = build_method(sparse_method, self.shape, prefill_sparse_method, **params)
        if self.method.category not in (Category.PHYSICAL_EVICTION, Category.DENSE):
            raise ValueError(
                f"sparse_methods.hf runs eviction methods; {sparse_method!r} is {self.method.category.value}"
            )
        if self.method.storage.kind is StoreKind.HEAD_MAJOR:  # a DynamicCache layer keeps one count for all heads
            raise ValueError(f"{sparse_method!r} keeps ragged per-head counts: sparse_methods.hf cannot hold them")
        self.num_tokens = 0  # logical length: tokens processed, evicted ones included
        self.prompt_len = 0
        self._positions: list[torch.Tensor] = []  # per layer [B, Hkv, n] int64 logical positions of the slots
        self._requests: dict[Hashable, RequestStep] = {}
        self._observed: Collection[Hashable] = frozenset()  # this step's, from ``prepare_step``
        self._num_new = 0
        self._saved_attention: str | None = None

    # -- context: route the model's attention through this cache -------------------------------------
    def __enter__(self) -> SparseKVCache:
        key = id(self._config)
        if key in _ACTIVE:
            raise RuntimeError("this model already runs inside another SparseKVCache")
        self._saved_attention = self._config._attn_implementation
        _ACTIVE[key] = self
        self.model.set_attn_implementation(ATTENTION_NAME)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.set_attn_implementation(self._saved_attention)
        _ACTIVE.pop(id(self._config), None)

    # -- lengths -------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The logical length (what positions continue from), not the number of kept slots."""
        return self.num_tokens

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        return self.num_tokens + cache_position.shape[0], 0

    def kv_lens(self) -> tuple[int, ...]:
        """Slots each layer holds now (per KV head; every row of the batch holds the same)."""
        held = [p.shape[-1] for p in self._positions]
        return tuple(held + [0] * (self.shape.num_layers - len(held)))

    def kept_positions(self, layer: int) -> torch.Tensor:
        """``[batch, num_kv_heads, kv_len]`` logical positions of the tokens layer ``layer`` kept, ascending."""
        return self._positions[layer]

    # -- one forward step ----------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_kv_heads, n, _ = key_states.shape
        if layer_idx == 0:
            self._begin_step(batch, n)
        keys, values = super().update(key_states, value_states, layer_idx, cache_kwargs)
        new = torch.arange(self.num_tokens, self.num_tokens + n, device=key_states.device)
        new = new.expand(batch, num_kv_heads, n)
        if layer_idx < len(self._positions):
            self._positions[layer_idx] = torch.cat([self._positions[layer_idx], new], dim=-1)
        else:
            self._positions.append(new.clone())
        return keys, values

    def _begin_step(self, batch: int, n: int) -> None:
        if self.num_tokens == 0 or n > 1:
            self.prompt_len = self.num_tokens + n  # a prompt, or a later turn's new tokens
        kv_lens = self.kv_lens()
        steps = [RequestStep(b, self.num_tokens, n, self.prompt_len, kv_lens) for b in range(batch)]
        self._requests = {r.request_id: r for r in steps}
        self._num_new = n
        self._observed = self.method.prepare_step(StepContext(tuple(steps)))

    def _attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """``query`` ``[B, Hq, n, D]``, ``key`` / ``value`` ``[B, Hkv, kv_len, D]`` (kept slots, then the new ones)
        -> ``[B, n, Hq, D]``."""
        batch, num_q_heads, n, head_dim = query.shape
        kv_len, num_kv_heads = key.shape[2], key.shape[1]
        group = num_q_heads // num_kv_heads
        past = kv_len - n
        if n == 1:  # decode sees every slot: fold each KV group's query heads into rows (no K/V copy)
            folded = query.reshape(batch, num_kv_heads, group, head_dim)
            out = F.scaled_dot_product_attention(folded, key, value, scale=scaling).reshape(batch, num_q_heads, 1, -1)
            return self._after_attention(layer, query, key, scaling, out)
        k = key.repeat_interleave(group, dim=1)
        v = value.repeat_interleave(group, dim=1)
        if past == 0:
            out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        else:  # every cached slot is older than every new token: see all of them, the new ones causally
            cols = torch.arange(kv_len, device=query.device)
            rows = torch.arange(past, kv_len, device=query.device)
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=cols[None, :] <= rows[:, None], scale=scaling)
        return self._after_attention(layer, query, key, scaling, out)

    def _after_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, out: torch.Tensor
    ) -> torch.Tensor:
        """Hand the method what it asked for, finish the step after the last layer; ``out`` -> ``[B, n, Hq, D]``."""
        if self._observed:
            rids = sorted(self._observed)
            views = [LayerAttention(query[rid].transpose(0, 1), key[rid].transpose(0, 1), scaling) for rid in rids]
            batch = LayerAttentionBatch.of_views(tuple(self._requests[rid] for rid in rids), views)
            self.method.on_attention_end(layer, batch)
        if layer == self.shape.num_layers - 1:
            self._finish_step()
        return out.transpose(1, 2).contiguous()

    def _finish_step(self) -> None:
        compactions = self.method.finish_step()
        self.num_tokens += self._num_new
        if not compactions:
            return
        batch = len(self._requests)
        for layer in range(self.shape.num_layers):
            keeps = [compactions[b].keep[layer] if b in compactions else None for b in range(batch)]
            if all(k is None for k in keeps):
                continue
            if any(k is None for k in keeps) or len({tuple(k.shape) for k in keeps}) > 1:
                raise ValueError("the method kept different numbers of slots in different rows of the batch")
            self._compact(layer, torch.stack(keeps))

    def _compact(self, layer: int, keep: torch.Tensor) -> None:
        """Gather the kept slots ``keep`` ``[B, Hkv, n]`` (ascending) to the front of ``layer``."""
        cached = self.layers[layer]
        keep = keep.to(cached.keys.device)
        cached.keys = cached.keys.gather(2, keep[..., None].expand(-1, -1, -1, cached.keys.shape[-1]))
        cached.values = cached.values.gather(2, keep[..., None].expand(-1, -1, -1, cached.values.shape[-1]))
        self._positions[layer] = self._positions[layer].gather(2, keep)
