"""Token embedding and the LM head that maps hidden states back onto the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparse_kernels import linear


class VocabEmbedding(nn.Module):
    """``input_ids [T] -> [T, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """``hidden [N, hidden] -> logits [N, vocab]`` in fp32.

    The matmul runs in the model's dtype (as HF does; ``sparse_kernels.linear``, so decode's few rows
    take the small-M kernel on CUDA) and only the result is widened, so sampling
    and log-probs see fp32 without the cost of an fp32 matmul over the vocabulary. With tied
    embeddings the model points ``weight`` at the embedding's parameter: one tensor, loaded once.
    """

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight).float()
