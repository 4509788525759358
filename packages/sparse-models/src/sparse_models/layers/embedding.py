"""Token embedding and the LM head that maps hidden states back onto the vocabulary, vocab-parallel.

Under tensor parallelism each rank holds ``ceil(vocab / world)`` consecutive rows of the table (the last
rank's tail padded with zeros). The embedding looks up the ids in its range, zeroes the others and sums
over the ranks; the LM head computes its rows' logits and gathers them (Megatron-LM's split). On one
rank both are a plain lookup and matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparse_kernels import linear
from sparse_models.distributed import all_gather, all_reduce, tp_rank, tp_world_size
from sparse_models.weights import check_shape, copy_checked


class _VocabRows(nn.Module):
    """A ``[vocab, hidden]`` table of which this rank holds rows ``[start, start + rows)``."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp_world_size())
        self.start = tp_rank() * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.logical_shape = (vocab_size, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(loaded, param.logical_shape)
        mine = loaded[self.start : self.start + self.rows]
        param.data[mine.shape[0] :].zero_()  # padding rows past the vocabulary
        copy_checked(param.data[: mine.shape[0]], mine)


class VocabEmbedding(_VocabRows):
    """``input_ids [T] -> [T, hidden]``."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside[:, None], 0.0))


class LMHead(_VocabRows):
    """``hidden [N, hidden] -> logits [N, vocab]`` in fp32.

    The matmul runs in the model's dtype (as HF does; ``sparse_kernels.linear``, so decode's few rows
    take the small-M kernel on CUDA) and only the result is widened, so sampling
    and log-probs see fp32 without the cost of an fp32 matmul over the vocabulary. With tied
    embeddings the model points ``weight`` at the embedding's parameter (the same rows on every rank):
    one tensor, loaded once.
    """

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight).float()
        if tp_world_size() == 1:
            return logits
        return all_gather(logits, dim=-1)[:, : self.vocab_size]
