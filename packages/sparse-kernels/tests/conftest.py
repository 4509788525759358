"""Shared builders for kernel tests: a shuffled block pool plus the contiguous truth, and the device
Triton tests run on (CUDA natively where present, else the CPU through Triton's interpreter)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from sparse_kernels import causal_attention


@dataclass
class PagedBatch:
    """One step's paged layout, its pool, and per-request contiguous K/V to check against."""

    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [nnz]
    kv_last_len: torch.Tensor  # int32 [B]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; unused slots hold NaN
    v_cache: torch.Tensor
    q: torch.Tensor  # [T, Hq, D]
    k_seqs: list[torch.Tensor]  # per request [kv_len, Hkv, D]
    v_seqs: list[torch.Tensor]

    def layout(self) -> dict[str, int]:
        """The head and block layout ``plan`` needs, read off the batch's own tensors."""
        _, block_size, num_kv_heads, head_dim = self.k_cache.shape
        return dict(num_qo_heads=self.q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)

    def plan_prefill(self, wrapper, **kwargs) -> None:
        wrapper.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_len, **self.layout(), **kwargs)

    def plan_decode(self, wrapper, **kwargs) -> None:
        wrapper.plan(self.kv_indptr, self.kv_indices, self.kv_last_len, **self.layout(), **kwargs)

    def to(self, device: str | torch.device) -> PagedBatch:
        """Pool and queries on ``device`` (CSR and the K/V truth stay on the host)."""
        for name in ("k_cache", "v_cache", "q"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def reference(self, sm_scale: float | None = None, causal: bool = True) -> torch.Tensor:
        """Per-request oracle output, concatenated to ``[T, Hq, D]``."""
        outs = []
        for b, (k, v) in enumerate(zip(self.k_seqs, self.v_seqs, strict=True)):
            q = self.q[int(self.qo_indptr[b]) : int(self.qo_indptr[b + 1])].cpu()  # K/V truth lives on CPU
            outs.append(causal_attention(q, k, v, sm_scale=sm_scale, causal=causal))
        return torch.cat(outs)


def make_paged_batch(
    qo_lens: list[int],
    kv_lens: list[int],
    *,
    block_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    """Build a batch whose blocks come in shuffled order from a larger NaN-filled pool.

    NaN in every slot no request owns makes any read outside the listed tokens poison the output.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in kv_lens]
    pool_blocks = sum(num_blocks) + spare_blocks
    perm = torch.randperm(pool_blocks, generator=gen).to(torch.int32)
    shape = (pool_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    k_seqs, v_seqs, indices = [], [], []
    start = 0
    for n, nb in zip(kv_lens, num_blocks, strict=True):
        blocks = perm[start : start + nb].to(torch.int64)
        start += nb
        indices.append(blocks)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        k_flat[slots], v_flat[slots] = k, v
        k_seqs.append(k)
        v_seqs.append(v)
    last_len = [n - (nb - 1) * block_size for n, nb in zip(kv_lens, num_blocks, strict=True)]
    return PagedBatch(
        qo_indptr=_indptr(qo_lens),
        kv_indptr=_indptr(num_blocks),
        kv_indices=torch.cat(indices).to(torch.int32),
        kv_last_len=torch.tensor(last_len, dtype=torch.int32),
        k_cache=k_cache,
        v_cache=v_cache,
        q=torch.randn(sum(qo_lens), num_qo_heads, head_dim, generator=gen).to(dtype),
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )


@dataclass
class HeadLists:
    """A head-sparse plan over a ``PagedBatch``: one list per (request, KV head), request-major."""

    kv_indptr: torch.Tensor  # int32 [B * Hkv + 1]
    kv_indices: torch.Tensor  # int32 [nnz]: block ids (page_size = block_size) or slot ids (page_size = 1)
    kv_last_len: torch.Tensor  # int32 [B * Hkv]
    page_size: int
    positions: list[torch.Tensor]  # per list: sequence positions of its tokens, in list order

    def plan(self, wrapper, batch: PagedBatch, **kwargs) -> None:
        wrapper.plan(
            self.kv_indptr,
            self.kv_indices,
            self.kv_last_len,
            **batch.layout(),
            head_sparse=True,
            page_size=self.page_size,
            **kwargs,
        )

    def reference(self, batch: PagedBatch, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Oracle ``(out [B, Hq, D], scores [nnz * page_size])`` from the per-list K/V truth."""
        num_kv_heads = batch.k_cache.shape[2]
        q = batch.q.cpu()
        batch_size, num_qo_heads, head_dim = q.shape
        group = num_qo_heads // num_kv_heads
        scale = head_dim**-0.5 if sm_scale is None else sm_scale
        out = torch.empty(batch_size, num_qo_heads, head_dim, dtype=q.dtype)
        scores = torch.zeros(int(self.kv_indptr[-1]) * self.page_size)
        for lst, pos in enumerate(self.positions):
            b, h = divmod(lst, num_kv_heads)
            heads = slice(h * group, (h + 1) * group)
            k = batch.k_seqs[b][pos, h : h + 1]  # [n, 1, D]
            v = batch.v_seqs[b][pos, h : h + 1]
            out[b, heads] = causal_attention(q[b, heads][None], k, v, sm_scale=sm_scale, causal=False)[0]
            probs = torch.softmax(q[b, heads].float() @ k[:, 0].float().T * scale, dim=-1)  # [g, n]
            start = int(self.kv_indptr[lst]) * self.page_size
            scores[start : start + len(pos)] = probs.sum(0)
        return out, scores


def make_head_lists(batch: PagedBatch, *, slots: bool, seed: int = 0) -> HeadLists:
    """Random non-empty per-(request, head) selections in shuffled order: whole blocks, or single slots."""
    gen = torch.Generator().manual_seed(seed)
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    indptr, indices, last_len, positions = [0], [], [], []
    for b, k in enumerate(batch.k_seqs):
        kv_len = k.shape[0]
        blocks = batch.kv_indices[int(batch.kv_indptr[b]) : int(batch.kv_indptr[b + 1])].to(torch.int64)
        num_blocks = blocks.numel()
        for _ in range(num_kv_heads):
            if slots:
                pos = torch.randperm(kv_len, generator=gen)[: int(torch.randint(1, kv_len + 1, (1,), generator=gen))]
                indices.append(blocks[pos // block_size] * block_size + pos % block_size)
                last_len.append(1)
            else:
                pages = torch.randperm(num_blocks, generator=gen)[
                    : int(torch.randint(1, num_blocks + 1, (1,), generator=gen))
                ]
                pages = torch.cat([pages[pages != num_blocks - 1], pages[pages == num_blocks - 1]])  # partial page last
                pos = (pages[:, None] * block_size + torch.arange(block_size)).reshape(-1)
                pos = pos[pos < kv_len]
                indices.append(blocks[pages])
                last_len.append(kv_len - (num_blocks - 1) * block_size if pages[-1] == num_blocks - 1 else block_size)
            positions.append(pos)
            indptr.append(indptr[-1] + indices[-1].numel())
    return HeadLists(
        kv_indptr=torch.tensor(indptr, dtype=torch.int32),
        kv_indices=torch.cat(indices).to(torch.int32),
        kv_last_len=torch.tensor(last_len, dtype=torch.int32),
        page_size=1 if slots else block_size,
        positions=positions,
    )


def dense_scores(batch: PagedBatch, sm_scale: float | None = None) -> torch.Tensor:
    """Oracle ``scores_out`` of a dense decode plan: ``[Hkv, kv_indptr[-1] * block_size]``."""
    _, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    q = batch.q.cpu().float()
    group = q.shape[1] // num_kv_heads
    scores = torch.zeros(num_kv_heads, int(batch.kv_indptr[-1]) * block_size)
    for b, k in enumerate(batch.k_seqs):
        k = k.float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * scale, dim=-1)  # [Hq, n]
        start = int(batch.kv_indptr[b]) * block_size
        scores[:, start : start + k.shape[0]] = probs.view(num_kv_heads, group, -1).sum(1)
    return scores


def awkward_lengths(batch: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """KV lengths cycling 1, 97, 300, random; queries alternate full-sequence and cached-prefix."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens, qo_lens = [], []
    for b in range(batch):
        kv = [1, 97, 300, int(torch.randint(2, 300, (1,), generator=gen))][b % 4]
        kv_lens.append(kv)
        qo_lens.append(kv if b % 2 == 0 else int(torch.randint(1, kv + 1, (1,), generator=gen)))
    return qo_lens, kv_lens


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Where Triton-vs-reference tests run: natively on CUDA when present, else interpreted on CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return make_paged_batch


@pytest.fixture
def lengths() -> Callable[..., tuple[list[int], list[int]]]:
    return awkward_lengths


@pytest.fixture
def head_lists() -> Callable[..., HeadLists]:
    return make_head_lists


@pytest.fixture
def scores_oracle() -> Callable[..., torch.Tensor]:
    return dense_scores


@pytest.fixture(autouse=True)
def compiled_for_hopper():
    """Without a GPU, every interpreted kernel launch is also compiled for sm_90 (``compile_check``):
    the interpreter alone accepts code the compiler rejects. Each distinct signature compiles once."""
    from sparse_kernels._triton.compile_check import compiling_for

    if torch.cuda.is_available():
        yield
        return
    with compiling_for("cuda", 90, 32):
        yield


@dataclass
class QuantizedBatch:
    """A decode/prefill step over a quantized pool (``sparse_kernels.quantized_kv``), with its truth.

    ``k_seqs`` / ``v_seqs`` are each request's dequantized K/V in the original (unrotated) space: what
    attention over the quantized pool must equal. Stats and scales of every block no request owns are
    NaN (KIVI: also each incomplete page's block, which lives in the tail), so a stray read poisons
    the output.
    """

    kv: object  # QuantizedKV
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [nnz], block ids
    kv_last_len: torch.Tensor  # int32 [B]
    tail_index: torch.Tensor | None  # int32 [B] (KIVI), None otherwise
    k_seqs: list[torch.Tensor]  # per request float32 [kv_len, Hkv, D]
    v_seqs: list[torch.Tensor]

    def layout(self) -> dict[str, int]:
        return dict(num_kv_heads=self.kv.num_kv_heads, head_dim=self.kv.head_dim, block_size=self.kv.block_size)

    def kv_on(self, device: str | torch.device):
        """The ``QuantizedKV`` with every tensor on ``device``."""
        fields = {f.name: getattr(self.kv, f.name) for f in dataclasses.fields(self.kv)}
        return type(self.kv)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})


def make_quantized_batch(
    kv_lens: list[int],
    *,
    scheme: str,
    bits: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    tail_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> QuantizedBatch:
    """Random K/V per request, encoded into shuffled blocks of a larger pool by ``kv_quant``'s encoders."""
    from sparse_kernels.kv_quant import (
        allocate_quantized_kv,
        decode_kivi_pages,
        decode_rows,
        encode_kivi_pages,
        encode_rows,
    )

    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in kv_lens]
    pool_blocks = sum(num_blocks) + spare_blocks
    kv = allocate_quantized_kv(
        scheme, bits, pool_blocks, block_size, num_kv_heads, head_dim, tail_dtype, "cpu",
        num_tails=len(kv_lens) + 2, seed=seed,
    )  # fmt: skip
    for t in (kv.k_scale, kv.v_scale, kv.k_min, kv.v_min, kv.k_tail, kv.v_tail):
        if t is not None:
            t.fill_(float("nan"))
    perm = torch.randperm(pool_blocks, generator=gen)
    tails = torch.randperm(len(kv_lens) + 2, generator=gen)[: len(kv_lens)]
    k_seqs, v_seqs, indices, start = [], [], [], 0
    for b, (n, nb) in enumerate(zip(kv_lens, num_blocks, strict=True)):
        blocks = perm[start : start + nb]
        start += nb
        indices.append(blocks)
        # Spread per channel (keys) and per token (values), as real K/V have.
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen) * (1 + 3 * torch.rand(head_dim, generator=gen))
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen) * (0.5 + torch.rand(n, 1, 1, generator=gen))
        if scheme == "kivi":
            full = n // block_size
            pages = (x[: full * block_size].view(full, block_size, num_kv_heads, head_dim) for x in (k, v))
            k_codes, v_codes, k_scale, k_min, v_scale, v_min = encode_kivi_pages(*pages, bits, block_size)
            ids = blocks[:full]
            kv.k[ids], kv.v[ids], kv.k_scale[ids], kv.k_min[ids] = k_codes, v_codes, k_scale, k_min
            kv.v_scale[ids], kv.v_min[ids] = v_scale, v_min
            kd, vd = decode_kivi_pages(k_codes, v_codes, k_scale, k_min, v_scale, v_min, bits, head_dim)
            rest = n - full * block_size
            kv.k_tail[tails[b], :rest], kv.v_tail[tails[b], :rest] = k[full * block_size :], v[full * block_size :]
            k_tail = kv.k_tail[tails[b], :rest].float()
            v_tail = kv.v_tail[tails[b], :rest].float()
            k_seqs.append(torch.cat([kd.reshape(-1, num_kv_heads, head_dim), k_tail]))
            v_seqs.append(torch.cat([vd.reshape(-1, num_kv_heads, head_dim), v_tail]))
            continue
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k_flat = kv.k.view(-1, num_kv_heads, kv.k.shape[-1])
        v_flat = kv.v.view(-1, num_kv_heads, kv.v.shape[-1])
        rotation = kv.rotation if scheme == "turboquant" else torch.eye(head_dim)
        deq = []
        for x, flat, scale in ((k, k_flat, kv.k_scale), (v, v_flat, kv.v_scale)):
            codes, s = encode_rows(x @ rotation, scheme, bits, codebook=kv.codebook)
            flat[slots] = codes
            scale.view(-1, num_kv_heads)[slots] = s
            deq.append(decode_rows(codes, s, scheme, bits, head_dim, codebook=kv.codebook) @ rotation.T)
        k_seqs.append(deq[0])
        v_seqs.append(deq[1])
    last_len = [n - (nb - 1) * block_size for n, nb in zip(kv_lens, num_blocks, strict=True)]
    return QuantizedBatch(
        kv=kv,
        kv_indptr=_indptr(num_blocks),
        kv_indices=torch.cat(indices).to(torch.int32),
        kv_last_len=torch.tensor(last_len, dtype=torch.int32),
        tail_index=tails.to(torch.int32) if scheme == "kivi" else None,
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )


@pytest.fixture
def quantized_batch() -> Callable[..., QuantizedBatch]:
    return make_quantized_batch
