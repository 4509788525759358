"""Token sampling: greedy, temperature, top-k and top-p, reproducible per request seed."""

from __future__ import annotations

import torch

from sparse_serve.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus. logits: [V]."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly above it already reach top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    """Picks one token per row. Requests with a seed draw from their own generator, so their
    output does not depend on what else is in the batch; others share one engine generator."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self._engine_gen = torch.Generator(device=device).manual_seed(seed)
        self._request_gens: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._engine_gen
        gen = self._request_gens.get(request_id)
        if gen is None:
            gen = self._request_gens[request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return gen

    def release(self, request_id: str) -> None:
        self._request_gens.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: [N, vocab] float32 -> N token ids (waits for the device)."""
        return self.sample(logits, request_ids, params).tolist()

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> SampledTokens:
        """logits: [N, vocab] float32 -> N token ids, computed on the device without waiting for it.

        Rows draw from their generators in row order, as ``__call__`` always did, so outputs match.
        """
        tokens = logits.argmax(dim=-1)
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.greedy:
                continue
            row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            tokens[i : i + 1] = torch.multinomial(probs, 1, generator=self._generator(rid, p))
        return SampledTokens(tokens)


class SampledTokens:
    """A step's sampled token ids on their way to the host.

    On CUDA the copy into pinned host memory is queued behind the step's kernels and ``tolist`` waits
    only for it, so the host can do other work (bookkeeping of the step) while the device runs.
    """

    def __init__(self, tokens: torch.Tensor):
        self.device_tokens = tokens  # [N] int64 on the step's device: what a pipelined next step reads
        self._event = None
        if tokens.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tokens = host
        self._tokens = tokens

    @classmethod
    def empty(cls) -> SampledTokens:
        return cls(torch.zeros(0, dtype=torch.int64))

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._tokens.tolist()


class TokenFeed:
    """Input-id rows of a step that take the previous step's sampled tokens without a host round trip.

    ``rows[i]`` of the step's flat ids gets ``tokens[sources[i]]`` (``tokens``: the previous step's
    ``SampledTokens.device_tokens``). The copy is queued on the current stream after the host ids'
    copy, so it runs after the previous step's sampling and before this step's forward.
    """

    def __init__(self, tokens: torch.Tensor, rows: list[int], sources: list[int]):
        self.tokens = tokens
        self.rows, self.sources = rows, sources
        n = len(rows)
        self._prefix = n if rows == sources == list(range(n)) else None  # the common case: same order
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply_(self, input_ids: torch.Tensor) -> None:
        """Write the fed rows of ``input_ids`` ([>= max(rows) + 1] int64, on the tokens' device) in place."""
        if not self.rows:
            return
        if self._prefix is not None:
            input_ids[: self._prefix].copy_(self.tokens[: self._prefix])
            return
        if self._index is None:
            device = self.tokens.device
            rows = torch.tensor(self.rows, dtype=torch.int64)
            sources = torch.tensor(self.sources, dtype=torch.int64)
            if device.type == "cuda":
                rows, sources = (t.pin_memory().to(device, non_blocking=True) for t in (rows, sources))
            self._index = rows, sources
        rows, sources = self._index
        input_ids.index_copy_(0, rows, self.tokens.index_select(0, sources))

    def apply_reference(self, input_ids: torch.Tensor) -> None:
        """``apply_`` row by row (tests hold them equal)."""
        for row, source in zip(self.rows, self.sources, strict=True):
            input_ids[row] = self.tokens[source]
