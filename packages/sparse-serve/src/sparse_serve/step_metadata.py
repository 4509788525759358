"""Host-side metadata of one step, built once and copied to the device once.

Tokens of all scheduled requests are laid out flat: single-token items (decodes) first, then
prefill chunks. Paged attention metadata uses FlashInfer's CSR names, all int32.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from sparse_cache import BlockTable
from sparse_serve.request import Request
from sparse_serve.scheduler import ScheduledBatch


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Tensors describing one forward step (CPU tensors until ``to`` moves the device ones).

    Attributes
    ----------
    input_ids, positions : [num_tokens] int64.
    slot_mapping : [num_tokens] int32, where each token's K/V is stored.
    num_decode_tokens : the leading tokens that are single-token items (one per request).
    decode_kv_* : CSR over the blocks of the single-token items (kv_indptr [Bd+1], kv_indices, kv_last_len [Bd]).
    prefill_* : qo_indptr [Bp+1] (relative to the first prefill token) and CSR over their blocks.
    logits_indices : [num_sampled] int64, the flat rows whose logits are sampled.
    sampled : the requests sampled this step, in ``logits_indices`` order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_kv_indptr: torch.Tensor
    decode_kv_indices: torch.Tensor
    decode_kv_last_len: torch.Tensor
    prefill_qo_indptr: torch.Tensor
    prefill_kv_indptr: torch.Tensor
    prefill_kv_indices: torch.Tensor
    prefill_kv_last_len: torch.Tensor
    logits_indices: torch.Tensor
    sampled: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_prefill_requests(self) -> int:
        return self.prefill_kv_last_len.numel()

    @property
    def num_decode_requests(self) -> int:
        return self.decode_kv_last_len.numel()


def _csr(tables: list[BlockTable], kv_lens: list[int], block_size: int) -> tuple[list[int], list[int], list[int]]:
    indptr, indices, last_len = [0], [], []
    for table, kv_len in zip(tables, kv_lens, strict=True):
        num_blocks = -(-kv_len // block_size)
        indices.extend(table.block_ids[:num_blocks])
        indptr.append(len(indices))
        last_len.append(kv_len - (num_blocks - 1) * block_size)
    return indptr, indices, last_len


def build_step_metadata(
    batch: ScheduledBatch, table_of: Callable[[Hashable], BlockTable], block_size: int
) -> StepMetadata:
    """Lay out a scheduled batch (decodes first, as the scheduler orders it) as step tensors."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    decode_tables, decode_lens, prefill_tables, prefill_lens, qo_indptr = [], [], [], [], [0]
    num_decode_tokens = 0
    for req, n in batch.items:
        table = table_of(req.request_id)
        start = req.num_computed_tokens
        input_ids.extend(req.token_ids[start : start + n])
        positions.extend(range(start, start + n))
        slots.extend(table.slot(p) for p in range(start, start + n))
        if n == 1:
            if prefill_tables:
                raise ValueError("single-token items must come before prefill chunks")
            num_decode_tokens += 1
            decode_tables.append(table)
            decode_lens.append(start + 1)
        else:
            prefill_tables.append(table)
            prefill_lens.append(start + n)
            qo_indptr.append(qo_indptr[-1] + n)
        if start + n == req.num_tokens:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(req)
    d_indptr, d_indices, d_last = _csr(decode_tables, decode_lens, block_size)
    p_indptr, p_indices, p_last = _csr(prefill_tables, prefill_lens, block_size)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32)

    return StepMetadata(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=i32(slots),
        num_decode_tokens=num_decode_tokens,
        decode_kv_indptr=i32(d_indptr),
        decode_kv_indices=i32(d_indices),
        decode_kv_last_len=i32(d_last),
        prefill_qo_indptr=i32(qo_indptr),
        prefill_kv_indptr=i32(p_indptr),
        prefill_kv_indices=i32(p_indices),
        prefill_kv_last_len=i32(p_last),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sampled=tuple(sampled),
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``: pinned and non-blocking on CUDA, a no-op on CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
