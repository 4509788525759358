"""Engine configuration: one validated record, the same field names everywhere.

The names here are the project's parameter vocabulary: ``LLM(model, **fields)``, JSON config
files and CLI flags all use them, and a misspelled name is an error rather than silently ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

import sparse_methods


class _EngineFields(BaseModel):
    """Everything that shapes the engine; validated on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(description="Path to an HF-format model folder (config.json, *.safetensors, tokenizer.json).")
    tokenizer: str | None = Field(None, description="Tokenizer folder; defaults to `model`.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto` picks cuda when available.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV dtype; `auto` is float32 on CPU and the checkpoint's dtype on CUDA."
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="`dummy` skips weight files and fills random weights (benchmarks only)."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks that split the model (heads, MLP width, vocabulary) and the KV heads; one process "
        "per rank (rank r on cuda:r, NCCL; gloo on CPU), driven by the caller's process.",
    )
    seed: int = Field(0, description="Seed for dummy weights and for sampling of requests without their own seed.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks in the pool; overrides the memory sizing.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of GPU memory the engine may use (weights + KV + activations)."
    )
    cpu_kv_cache_gib: float = Field(2.0, gt=0.0, description="KV pool size on CPU, in GiB.")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + output in tokens; defaults to the model's and the pool's limit."
    )
    max_num_seqs: int = Field(256, ge=1, description="Most requests running in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step; longer prompts are prefilled in chunks of this size."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of shared prompt prefixes across requests (token-exact methods only)."
    )
    enforce_eager: bool = Field(False, description="Never run decode steps under CUDA graphs.")
    max_cuda_graph_batch_size: int = Field(
        256, ge=1, description="Largest decode batch captured as a CUDA graph (capped at max_num_seqs)."
    )
    async_scheduling: bool | None = Field(
        None,
        description="Pipeline decode steps: schedule and prepare step N+1 on the host while step N runs, "
        "feeding N's sampled tokens to N+1 on the device. None: on for CUDA, off on CPU.",
    )
    host_threads: int = Field(
        1,
        ge=0,
        description="Threads for torch's CPU ops on a CUDA engine (step metadata, plan checks; set for the whole "
        "process when the engine starts). These ops are small, and a multi-threaded op waits for its slowest "
        "worker: with torch's default (one per core) a descheduled worker held pipelined decode steps for 5-20 ms "
        "at a time on the H200 host. 0 leaves torch's setting; ignored on CPU, where the model runs on them.",
    )
    max_num_chains: int = Field(4096, ge=1, description="Conversation chains remembered at once (LRU beyond).")
    sparse_method: str = Field(
        "dense", description=f"Sparse attention / KV compression method: {', '.join(sparse_methods.method_names())}."
    )
    prefill_sparse_method: str | None = Field(
        None, description=f"Prefill variant of the method: {', '.join(sparse_methods.prefill_method_names())}."
    )
    kv_cache_dtype: Literal["auto", "fp8", "kivi", "turboquant"] = Field(
        "auto",
        description="How KV is stored, beside the sparse_method: `auto` (the model dtype, or what a compressed-"
        "storage method names: fp8_kv -> fp8, kivi, turboquant), `fp8` (e4m3), `kivi`, `turboquant`. Not yet "
        "(start-up errors): AdaKV, KVzip, RetroInfer and a prefill_sparse_method need `auto`; OmniKV runs on all "
        "but kivi.",
    )
    kivi_bits: Literal[2, 4] | None = Field(None, description="KIVI code bits (default 4); kv_cache_dtype kivi only.")
    kv_quant_page_size: int | None = Field(
        None,
        description="KIVI page: tokens its key statistics span and channels per value group; a power of two "
        "from 16 to 128 dividing head_dim (default 32, or block_size when that is given). It is the block size.",
    )
    turboquant_bits: Literal[2, 3, 4] | None = Field(
        None, description="TurboQuant code bits (default 4); kv_cache_dtype turboquant only."
    )
    turboquant_seed: int | None = Field(
        None, description="Seed of TurboQuant's random rotation (default 0); kv_cache_dtype turboquant only."
    )
    fp8_kv_scale_path: str | None = Field(
        None,
        description="fp8 only: a JSON file of static per-layer scales ({'k': [...], 'v': [...]}, dequant "
        "multipliers); default: dynamic scales per (token, KV head), no calibration needed.",
    )

    @field_validator("sparse_method", mode="before")
    @classmethod
    def _canonical_method(cls, name: Any) -> Any:
        """An alias (``skip-kv``) becomes the registered name, which the engine and reports then see."""
        return sparse_methods.canonical_method_name(name) if isinstance(name, str) else name

    @model_validator(mode="before")
    @classmethod
    def _kivi_block_size(cls, data: Any) -> Any:
        """KIVI's page is the block: block_size follows kv_quant_page_size unless given (then they must agree)."""
        if not isinstance(data, dict) or _requested_kv_dtype(data) != "kivi":
            return data
        page, block = data.get("kv_quant_page_size"), data.get("block_size")
        if page is not None and block is not None and page != block:
            raise ValueError(f"kivi: kv_quant_page_size ({page}) is the block size; block_size={block} differs")
        page = page or block or _KIVI_DEFAULT_PAGE
        return {**data, "kv_quant_page_size": page, "block_size": page}

    @model_validator(mode="after")
    def _check_method(self):
        self.method_config()  # raises ValueError naming the parameter the method does not have
        self.resolved_kv_cache_dtype()  # raises on a method / kv_cache_dtype conflict or a stray parameter
        return self

    def resolved_kv_cache_dtype(self) -> str:
        """``auto`` (model dtype), ``fp8``, ``kivi`` or ``turboquant``: the engine's KV store."""
        implied = sparse_methods.get_method_class(self.sparse_method).storage.kv_cache_dtype
        if implied is not None and self.kv_cache_dtype not in ("auto", implied):
            raise ValueError(
                f"sparse_method {self.sparse_method!r} stores KV as {implied!r}; "
                f"kv_cache_dtype={self.kv_cache_dtype!r} "
                "contradicts it (use sparse_method='dense' with the kv_cache_dtype you want)"
            )
        dtype = implied or self.kv_cache_dtype
        for field, owner in _KV_DTYPE_FIELDS.items():
            if getattr(self, field) is not None and owner != dtype:
                raise ValueError(f"{field} applies to kv_cache_dtype={owner!r}; the KV store here is {dtype!r}")
        if dtype == "kivi":
            page = self.kv_quant_page_size
            if page < 16 or page > 128 or page & (page - 1):
                raise ValueError(f"kv_quant_page_size must be a power of two from 16 to 128, got {page}")
        return dtype

    def method_params(self) -> dict[str, Any]:
        """The method parameters that were set (None means: the method's default)."""
        return {n: getattr(self, n) for n in _METHOD_FIELDS if getattr(self, n) is not None}

    def method_config(self) -> sparse_methods.MethodConfig:
        return sparse_methods.make_config(self.sparse_method, self.prefill_sparse_method, **self.method_params())

    @classmethod
    def from_json(cls, path: str | Path, **overrides) -> EngineConfig:
        """Load a JSON config file; keyword overrides win over the file."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of engine config fields")
        return cls(**{**data, **overrides})


_KIVI_DEFAULT_PAGE = 32
_KV_DTYPE_FIELDS = {
    "kivi_bits": "kivi",
    "kv_quant_page_size": "kivi",
    "turboquant_bits": "turboquant",
    "turboquant_seed": "turboquant",
    "fp8_kv_scale_path": "fp8",
}


def _requested_kv_dtype(data: dict) -> str:
    method = data.get("sparse_method", "dense")
    try:
        implied = sparse_methods.get_method_class(method).storage.kv_cache_dtype
    except ValueError:
        return "auto"  # an unknown method: the after-validator names it
    return implied or data.get("kv_cache_dtype", "auto")


def _method_field(info) -> tuple[Any, Any]:
    default = f" (default {info.default!r} where the method has it)" if info.default is not None else ""
    return (info.annotation | None, Field(None, description=(info.description or "") + default))


# Method parameters are flat engine fields (one vocabulary): None leaves the method's default.
_METHOD_FIELDS = {
    n: _method_field(i) for n, i in sparse_methods.parameter_fields().items() if n != "prefill_sparse_method"
}
EngineConfig = create_model("EngineConfig", __base__=_EngineFields, __doc__=_EngineFields.__doc__, **_METHOD_FIELDS)
