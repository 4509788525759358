"""Store kinds: what one layer's KV storage holds, per block and per running request.

A store kind is a method-agnostic description, not storage: the tensors each pool block carries
(K/V, or codes with their scales and zero points, or block summaries), the tensors a running
request holds outside the pool (a full-precision tail for an incomplete quantized page), their
shapes and dtypes, and so the real bytes per token. The serving engine allocates every layer's
tensors from it and sizes the pool by it, so admission packs requests by the bytes they really
hold; methods only declare what they need.

A head-major store gives each (layer, KV head) lane its own blocks of one head's K/V, so the heads of a
layer may hold different numbers of tokens (``LayerLayout``'s head-major layout indexes it).

A latent store (multi-head latent attention, DeepSeek-V2) holds one row per token: the normalized
latent ``c_kv`` (``latent_dim`` channels) then the decoupled, post-RoPE key. Attention reads it as one
KV head of ``head_dim = latent_dim + rope_dim`` channels whose values are the first ``latent_dim``.

Shapes leave out the leading dimension: ``num_blocks`` for block tensors, the number of tail rows
for tail tensors. A dtype is a torch dtype name, or ``"model"`` for the model's KV dtype. The
quantized layouts are those that ``sparse_kernels.QuantizedKV`` documents and its kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_DTYPE = "model"
_ITEMSIZE = {"float8_e4m3fn": 1, "int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4}

PAGED = "paged"
PAGED_WITH_SUMMARIES = "paged + block summaries"
QUANTIZED_PAGED = "quantized paged"
LATENT_PAGED = "latent paged"
HEAD_MAJOR_PAGED = "head-major paged"

QUANT_SCHEMES = {"fp8": (8,), "kivi": (2, 4), "turboquant": (2, 3, 4)}
SUMMARY_CODES = "int8"  # block summaries as int8 codes with a float32 scale per (block, KV head)
SUMMARY_TENSORS = ("kmin", "kmax", "kscale")  # the block tensors that summarize keys (kscale: codes only)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor of a store: ``shape`` per block (or per tail row) and its dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def nbytes(self, model_itemsize: int) -> int:
        size = model_itemsize if self.dtype == MODEL_DTYPE else _ITEMSIZE[self.dtype]
        n = 1
        for d in self.shape:
            n *= d
        return n * size


@dataclass(frozen=True, slots=True)
class StoreKind:
    """The storage of one attention layer's KV (every layer of a model uses the same kind).

    ``kind``: ``paged`` (K/V in the model dtype), ``paged + block summaries`` (plus each block's
    elementwise key min / max) or ``quantized paged`` (``scheme`` in ``fp8``, ``kivi``,
    ``turboquant`` with ``bits``; KIVI's value channel group ``group``; TurboQuant's rotation
    ``seed``). ``tail_tensors`` are held once per running request (KIVI's incomplete page).
    ``latent paged``: one head of ``head_dim`` channels per token, the first ``latent_dim`` of
    which are also the values (see ``latent_paged``).
    """

    kind: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_tensors: tuple[TensorSpec, ...]
    tail_tensors: tuple[TensorSpec, ...] = ()
    scheme: str | None = None
    bits: int = 16
    group: int = 0
    seed: int = 0
    latent_dim: int = 0

    @property
    def latent(self) -> bool:
        return self.kind == LATENT_PAGED

    @property
    def head_major(self) -> bool:
        return self.kind == HEAD_MAJOR_PAGED

    @property
    def quantized(self) -> bool:
        return self.kind == QUANTIZED_PAGED

    @property
    def summaries(self) -> bool:
        return any(t.name == "kmin" for t in self.block_tensors)

    @property
    def summary_codes(self) -> bool:
        """Block summaries held as int8 codes with a scale per (block, KV head) (``kscale``)."""
        return any(t.name == "kscale" for t in self.block_tensors)

    @property
    def page_stat_levels(self) -> int:
        """``2**bits - 1`` for a KIVI store, else 0: its keys are quantized per channel over each full page
        with asymmetric min / max, so the page's ``k_min`` and ``k_min + levels * k_scale`` are exactly its
        dequantized keys' elementwise min and max (block summaries with no bytes of their own)."""
        return (1 << self.bits) - 1 if self.scheme == "kivi" else 0

    @property
    def has_tail(self) -> bool:
        return bool(self.tail_tensors)

    def bytes_per_block(self, model_itemsize: int) -> int:
        """Bytes one pool block takes in one layer."""
        return sum(t.nbytes(model_itemsize) for t in self.block_tensors)

    def summary_bytes(self, model_itemsize: int) -> int:
        """Bytes one pool block's key summaries take in one layer (0 without summaries)."""
        return sum(t.nbytes(model_itemsize) for t in self.block_tensors if t.name in SUMMARY_TENSORS)

    def page_bound_bytes(self, model_itemsize: int) -> int:
        """Bytes of one block that a page bound reads in one layer: its key summaries, or a KIVI page's key
        statistics (``page_stat_levels``); 0 when the store bounds no pages."""
        if self.summaries:
            return self.summary_bytes(model_itemsize)
        if self.page_stat_levels:
            return sum(t.nbytes(model_itemsize) for t in self.block_tensors if t.name in ("k_min", "k_scale"))
        return 0

    def bytes_per_token(self, model_itemsize: int) -> float:
        """Bytes one cached token costs in one layer (its block's bytes over the block's tokens)."""
        return self.bytes_per_block(model_itemsize) / self.block_size

    def tail_bytes(self, model_itemsize: int) -> int:
        """Bytes one running request's tail takes in one layer (0 without a tail)."""
        return sum(t.nbytes(model_itemsize) for t in self.tail_tensors)

    def describe(self) -> str:
        if self.latent:
            return f"{self.kind}{self._summaries()} ({self.latent_dim} latent + {self.head_dim - self.latent_dim} rope)"
        if not self.quantized:
            return self.kind + (" (int8 codes)" if self.summary_codes else "")
        return f"{self.kind}{self._summaries()} ({self.scheme}, {self.bits} bits)"

    def _summaries(self) -> str:
        if not self.summaries:
            return ""
        return " + block summaries" + (" (int8 codes)" if self.summary_codes else "")


def summary_tensors(num_kv_heads: int, head_dim: int, summary_dtype: str = MODEL_DTYPE) -> tuple[TensorSpec, ...]:
    """A block's key summaries: elementwise min / max ``[num_kv_heads, head_dim]`` in the model dtype, or
    (``summary_dtype="int8"``) as outward-rounded int8 codes with a float32 scale ``kscale [num_kv_heads]``
    (``sparse_kernels.summary_codes``: half the bytes a page bound reads)."""
    if summary_dtype not in (MODEL_DTYPE, SUMMARY_CODES):
        raise ValueError(f"block summaries are kept in the model dtype or as int8 codes, not {summary_dtype!r}")
    shape = (num_kv_heads, head_dim)
    specs = (TensorSpec("kmin", shape, summary_dtype), TensorSpec("kmax", shape, summary_dtype))
    return specs + ((TensorSpec("kscale", (num_kv_heads,), "float32"),) if summary_dtype == SUMMARY_CODES else ())


def paged(
    block_size: int, num_kv_heads: int, head_dim: int, *, summaries: bool = False, summary_dtype: str = MODEL_DTYPE
) -> StoreKind:
    """K/V in the model dtype, ``[block_size, num_kv_heads, head_dim]`` per block (NHD); with
    ``summaries``, each block's elementwise min / max key too (``summary_tensors``)."""
    _check_positive(block_size, num_kv_heads, head_dim)
    row = (block_size, num_kv_heads, head_dim)
    tensors = (TensorSpec("k", row, MODEL_DTYPE), TensorSpec("v", row, MODEL_DTYPE))
    if not summaries:
        return StoreKind(PAGED, block_size, num_kv_heads, head_dim, tensors)
    tensors += summary_tensors(num_kv_heads, head_dim, summary_dtype)
    return StoreKind(PAGED_WITH_SUMMARIES, block_size, num_kv_heads, head_dim, tensors)


def head_major_paged(block_size: int, num_kv_heads: int, head_dim: int) -> StoreKind:
    """K/V in the model dtype, one KV head per block: ``[block_size, 1, head_dim]`` (a block belongs to
    one (layer, KV head) lane; ``num_kv_heads`` is the model's, for reference)."""
    _check_positive(block_size, num_kv_heads, head_dim)
    row = (block_size, 1, head_dim)
    tensors = (TensorSpec("k", row, MODEL_DTYPE), TensorSpec("v", row, MODEL_DTYPE))
    return StoreKind(HEAD_MAJOR_PAGED, block_size, num_kv_heads, head_dim, tensors)


def latent_paged(
    block_size: int, latent_dim: int, rope_dim: int, *, summaries: bool = False, summary_dtype: str = MODEL_DTYPE
) -> StoreKind:
    """Multi-head latent attention's cache: per block ``kv [block_size, 1, latent_dim + rope_dim]`` in
    the model dtype, each row the normalized latent ``c_kv`` then the post-RoPE decoupled key; with
    ``summaries``, each block's elementwise min / max row ``[1, latent_dim + rope_dim]`` too."""
    _check_positive(block_size, latent_dim, rope_dim)
    d = latent_dim + rope_dim
    tensors = (TensorSpec("kv", (block_size, 1, d), MODEL_DTYPE),)
    if summaries:
        tensors += summary_tensors(1, d, summary_dtype)
    return StoreKind(LATENT_PAGED, block_size, 1, d, tensors, latent_dim=latent_dim)


def quantized_paged(
    scheme: str,
    bits: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    group: int | None = None,
    seed: int = 0,
    summaries: bool = False,
    summary_dtype: str = MODEL_DTYPE,
) -> StoreKind:
    """Quantized K/V pages: codes per token plus their scales (see ``sparse_kernels.QuantizedKV``).

    ``fp8``: e4m3 codes and a float32 scale per (token, KV head). ``kivi``: ``bits``-bit codes packed
    in int32 words; keys' float16 scale / min per channel over the block (the KIVI page, so
    ``group`` must equal ``block_size``), values' per token over groups of ``group`` channels, and a
    model-dtype tail per running request for its incomplete page. ``turboquant``: rotated
    ``bits``-bit codebook indices packed in int32 words and a float32 scale per (token, KV head).
    ``summaries`` (fp8, TurboQuant): each block's elementwise min / max of its dequantized keys too, as in
    ``paged`` (``summary_tensors``).
    """
    _check_positive(block_size, num_kv_heads, head_dim)
    if scheme not in QUANT_SCHEMES:
        raise ValueError(f"unknown KV quantization scheme {scheme!r}; known: {', '.join(QUANT_SCHEMES)}")
    if bits not in QUANT_SCHEMES[scheme]:
        raise ValueError(f"{scheme} stores {' or '.join(map(str, QUANT_SCHEMES[scheme]))} bits, not {bits}")
    s, h, d = block_size, num_kv_heads, head_dim
    summary = summary_tensors(h, d, summary_dtype) if summaries else ()
    if summaries and scheme == "kivi":
        raise ValueError(
            "a KIVI store keeps no block summaries: its pages' key statistics bound them (page_stat_levels)"
        )
    if scheme == "fp8":
        tensors = (
            TensorSpec("k", (s, h, d), "float8_e4m3fn"),
            TensorSpec("v", (s, h, d), "float8_e4m3fn"),
            TensorSpec("k_scale", (s, h), "float32"),
            TensorSpec("v_scale", (s, h), "float32"),
        )
        return StoreKind(QUANTIZED_PAGED, s, h, d, tensors + summary, scheme=scheme, bits=bits)
    words = -(-d // (32 // bits))
    codes = (TensorSpec("k", (s, h, words), "int32"), TensorSpec("v", (s, h, words), "int32"))
    if scheme == "turboquant":
        scales = (TensorSpec("k_scale", (s, h), "float32"), TensorSpec("v_scale", (s, h), "float32"))
        return StoreKind(QUANTIZED_PAGED, s, h, d, codes + scales + summary, scheme=scheme, bits=bits, seed=seed)
    group = block_size if group is None else group
    if group != block_size:
        raise ValueError(f"KIVI quantizes keys over pages of one block: group {group} must equal block_size {s}")
    if d % group or (32 // bits) > d:
        raise ValueError(f"KIVI needs head_dim ({d}) divisible by the page size {group}")
    if d % (32 // bits):
        raise ValueError(f"KIVI packs {32 // bits} codes per word; head_dim {d} is not a multiple")
    stats = (
        TensorSpec("k_scale", (h, d), "float16"),
        TensorSpec("k_min", (h, d), "float16"),
        TensorSpec("v_scale", (s, h, d // group), "float16"),
        TensorSpec("v_min", (s, h, d // group), "float16"),
    )
    tail = (TensorSpec("k_tail", (s, h, d), MODEL_DTYPE), TensorSpec("v_tail", (s, h, d), MODEL_DTYPE))
    return StoreKind(QUANTIZED_PAGED, s, h, d, codes + stats, tail, scheme=scheme, bits=bits, group=group)


def _check_positive(*values: int) -> None:
    if min(values) < 1:
        raise ValueError(f"store dimensions must be positive, got {values}")
