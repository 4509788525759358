"""The block-table rows of a step's observed decode requests, for ``sparse_methods.PagedKeys``.

A method that observes a layer's attention inputs gets the batch's keys left in their pages: the layer's
k-cache plus each observed request's blocks and length. The rows come from the layer group's decode CSR
(host metadata built once per step): one vectorized pick on the host and one non-blocking copy per
(group, step), shared by every layer of the group; the slots are then made on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_methods import PagedKeys
from sparse_serve.step_metadata import LayerGroupMetadata, to_device


@dataclass(frozen=True, slots=True)
class ObservedRows:
    """Device block-table rows ``[B, P]`` (int32, a row's last block repeated past its end), lengths after
    the step (int64 ``[B]``, and on the host), and the decode rows they are (int64 ``[B]``, to pick queries)."""

    block_table: torch.Tensor
    kv_lens: torch.Tensor
    kv_lens_cpu: tuple[int, ...]
    rows: torch.Tensor

    def keys(self, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> PagedKeys:
        return PagedKeys(k_cache, self.block_table, self.kv_lens, self.kv_lens_cpu, v_cache)


def observed_rows(
    group: LayerGroupMetadata, index: list[int], block_size: int, device: torch.device
) -> ObservedRows | None:
    """The rows of decode items ``index`` (ascending) of ``group``, or None where the CSR does not list each
    one's whole table from its first block (a sliding window's list) or an item is not a decode row."""
    num_decode = group.decode_kv_indptr.numel() - 1
    if not index or index[-1] >= num_decode:
        return None
    idx = torch.tensor(index, dtype=torch.int64)
    indptr = group.decode_kv_indptr.to(torch.int64)
    starts, counts = indptr[idx], indptr[idx + 1] - indptr[idx]
    lens = torch.tensor([group.kv_lens[i] + 1 for i in index], dtype=torch.int64)
    if not torch.equal(counts, (lens + block_size - 1) // block_size):
        return None
    cols = torch.minimum(torch.arange(int(counts.max())).view(1, -1), (counts - 1).view(-1, 1))
    table = group.decode_kv_indices[starts.view(-1, 1) + cols]
    return ObservedRows(
        to_device(table.contiguous(), device), to_device(lens, device), tuple(lens.tolist()), to_device(idx, device)
    )
