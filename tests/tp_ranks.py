"""Launching tensor-parallel ranks from a test: each rank is a spawned process joining a gloo group
through a file rendezvous. Rank functions live here (an importable module) so that spawn can pickle them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from sparse_models import ContiguousCausalAttention, load_model
from sparse_models.distributed import init_tensor_parallel, shutdown_tensor_parallel


def random_batch(vocab_size: int, seq_lens=(5, 13, 1), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in seq_lens]


@torch.inference_mode()
def model_logits(path: str, load_format: str) -> torch.Tensor:
    """Logits of ``random_batch`` through the model at ``path`` (fp32, CPU), one flat varlen batch."""
    model, config = load_model(path, load_format=load_format, seed=7)
    seqs = random_batch(config.vocab_size)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    bounds = [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]
    return model.compute_logits(model(torch.cat(seqs), positions, ContiguousCausalAttention(bounds)))


def _logits_rank(rank: int, world: int, rendezvous: str, out: str, cases: list[tuple[str, str]]) -> None:
    init_tensor_parallel(rank, world, f"file://{rendezvous}", backend="gloo")
    try:
        logits = [model_logits(path, load_format) for path, load_format in cases]
        if rank == 0:
            torch.save(logits, out)
    finally:
        shutdown_tensor_parallel()


def logits_on_ranks(world: int, cases: list[tuple[str, str]], tmp: Path) -> list[torch.Tensor]:
    """``model_logits`` of each ``(path, load_format)`` computed by ``world`` ranks (rank 0's result);
    one launch for all cases (starting a rank costs seconds)."""
    rendezvous, out = tmp / f"rdzv-{world}", tmp / f"logits-{world}.pt"
    mp.spawn(_logits_rank, args=(world, str(rendezvous), str(out), cases), nprocs=world)
    return torch.load(out)
