"""Store kinds: tensor lists, bytes per token and the validation of quantized layouts."""

import pytest

from sparse_cache import StoreKind, latent_paged, paged, quantized_paged


def test_plain_paged_is_k_and_v_in_the_model_dtype():
    kind = paged(16, 8, 128)
    assert [t.name for t in kind.block_tensors] == ["k", "v"]
    assert kind.bytes_per_block(2) == 2 * 16 * 8 * 128 * 2
    assert kind.bytes_per_token(2) == 2 * 8 * 128 * 2
    assert not kind.quantized and not kind.has_tail and kind.tail_bytes(2) == 0


def test_summaries_add_two_rows_per_block():
    kind = paged(16, 8, 128, summaries=True)
    assert kind.summaries
    assert kind.bytes_per_block(2) == (2 * 16 + 2) * 8 * 128 * 2


def test_int8_summary_codes_halve_the_summary_bytes_and_carry_a_scale_per_head():
    exact, coded = paged(16, 8, 128, summaries=True), paged(16, 8, 128, summaries=True, summary_dtype="int8")
    assert coded.summaries and coded.summary_codes and not exact.summary_codes
    specs = {t.name: t for t in coded.block_tensors}
    assert (specs["kmin"].dtype, specs["kmax"].dtype, specs["kscale"].dtype) == ("int8", "int8", "float32")
    assert specs["kscale"].shape == (8,)
    plain = paged(16, 8, 128).bytes_per_block(2)
    assert coded.bytes_per_block(2) - plain == 2 * 8 * 128 + 8 * 4  # vs 2 * 8 * 128 * 2 in bf16
    assert exact.bytes_per_block(2) - plain == 2 * 8 * 128 * 2
    assert "int8 codes" in coded.describe()
    fp8 = quantized_paged("fp8", 8, 16, 8, 128, summaries=True, summary_dtype="int8")
    assert fp8.summary_codes and "int8 codes" in fp8.describe()
    assert latent_paged(16, 512, 64, summaries=True, summary_dtype="int8").summary_codes
    with pytest.raises(ValueError, match="int8"):
        paged(16, 8, 128, summaries=True, summary_dtype="fp8")


@pytest.mark.parametrize(
    ("scheme", "bits", "per_token_head"),
    [
        # (codes + per-token scale) for K and V, in bytes per (token, KV head), head_dim 128
        ("fp8", 8, 2 * (128 + 4)),
        ("turboquant", 4, 2 * (16 * 4 + 4)),
        ("turboquant", 3, 2 * (13 * 4 + 4)),  # 10 codes per word: 13 words
        ("turboquant", 2, 2 * (8 * 4 + 4)),
        # KIVI, page 32: K codes + K stats (2 x fp16 x 128 per page of 32) + V codes + V stats (2 x fp16 x 4 groups)
        ("kivi", 4, 64 + 2 * 2 * 128 // 32 + 64 + 2 * 2 * 4),
        ("kivi", 2, 32 + 2 * 2 * 128 // 32 + 32 + 2 * 2 * 4),
    ],
)
def test_quantized_bytes_per_token(scheme, bits, per_token_head):
    kind = quantized_paged(scheme, bits, 32, 8, 128)
    assert kind.quantized
    assert kind.bytes_per_token(2) == per_token_head * 8
    assert kind.has_tail == (scheme == "kivi")
    if scheme == "kivi":
        assert kind.tail_bytes(2) == 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize("scheme", ["fp8", "turboquant"])
def test_quantized_summaries_add_a_model_dtype_min_and_max_per_block(scheme):
    # Quest over a per-token store: each block's key min / max [H, D] in the model dtype beside the codes.
    plain, summarised = (quantized_paged(scheme, 8 if scheme == "fp8" else 4, 16, 8, 128, summaries=s) for s in (0, 1))
    assert summarised.summaries and not plain.summaries and summarised.quantized
    assert summarised.bytes_per_block(2) == plain.bytes_per_block(2) + 2 * 8 * 128 * 2
    assert "block summaries" in summarised.describe()
    with pytest.raises(ValueError, match="KIVI store keeps no block summaries"):
        quantized_paged("kivi", 4, 16, 8, 128, summaries=True)


def test_page_bounds_read_summaries_or_kivi_key_statistics():
    # What a page bound reads per block: the summaries, or a KIVI page's per-channel key min and step (fp16).
    assert paged(16, 8, 128).page_bound_bytes(2) == 0
    assert paged(16, 8, 128, summaries=True).page_bound_bytes(2) == 2 * 8 * 128 * 2
    assert paged(16, 8, 128, summaries=True, summary_dtype="int8").page_bound_bytes(2) == 2 * 8 * 128 + 8 * 4
    for bits in (2, 4):
        kivi = quantized_paged("kivi", bits, 16, 8, 128)
        assert kivi.page_stat_levels == 2**bits - 1 and not kivi.summaries
        assert kivi.page_bound_bytes(2) == 2 * 8 * 128 * 2
    assert quantized_paged("fp8", 8, 16, 8, 128).page_stat_levels == 0


def test_compression_ratios_against_bf16():
    bf16 = paged(32, 8, 128).bytes_per_token(2)
    assert bf16 / quantized_paged("fp8", 8, 32, 8, 128).bytes_per_token(2) == pytest.approx(1.94, abs=0.01)
    assert bf16 / quantized_paged("kivi", 4, 32, 8, 128).bytes_per_token(2) == pytest.approx(3.2)
    assert bf16 / quantized_paged("kivi", 2, 32, 8, 128).bytes_per_token(2) == pytest.approx(5.33, abs=0.01)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("int3", 3, 16, 2, 64), {}, "unknown KV quantization scheme"),
        (("kivi", 3, 16, 2, 64), {}, "2 or 4 bits"),
        (("fp8", 4, 16, 2, 64), {}, "8 bits"),
        (("kivi", 4, 16, 2, 64), {"group": 32}, "must equal block_size"),
        (("kivi", 4, 32, 2, 48), {}, "divisible by the page size"),
        (("fp8", 8, 0, 2, 64), {}, "positive"),
    ],
)
def test_bad_layouts_are_clear_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantized_paged(*args, **kwargs)


def test_store_kind_is_frozen():
    kind = paged(16, 2, 64)
    assert isinstance(kind, StoreKind)
    with pytest.raises(AttributeError):
        kind.block_size = 32


def test_latent_store_is_one_row_of_latent_plus_rope_per_token():
    kind = latent_paged(16, 512, 64)
    assert kind.latent and not kind.quantized and not kind.summaries and not kind.has_tail
    assert [t.name for t in kind.block_tensors] == ["kv"]
    assert (kind.num_kv_heads, kind.head_dim, kind.latent_dim) == (1, 576, 512)
    assert kind.bytes_per_token(2) == 576 * 2  # DeepSeek-V2 / GLM-4.7-Flash: 1152 bytes per token and layer
    with_summaries = latent_paged(16, 512, 64, summaries=True)
    assert with_summaries.summaries and with_summaries.latent
    assert with_summaries.bytes_per_block(2) == (16 + 2) * 576 * 2
    with pytest.raises(ValueError):
        latent_paged(16, 0, 64)
