"""Token sampling: greedy, temperature, top-k and top-p, reproducible per request seed.

Before sampling, a request's logits may be processed (``SamplingParams``: logit bias, min_tokens,
repetition / frequency / presence penalties). Whatever the accepted parameters, a row never becomes
NaN: temperatures below ``GREEDY_TEMPERATURE`` are greedy, top-p always keeps the most likely token,
and a row left with no finite probability falls back to its argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparse_serve.request import Request
from sparse_serve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability of one chosen token and the ``top`` most likely tokens at its position
    (``(token_id, logprob)`` pairs, most likely first), from the raw model distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Rows of a step whose next prompt tokens' log-probabilities a request asked for.

    Rows ``start .. start + len(targets) - 1`` of the step's flat tokens are prompt positions
    ``first_position ..``; ``targets[j]`` is the prompt token that follows row ``start + j``.
    """

    request_id: str
    start: int
    first_position: int
    targets: tuple[int, ...]
    top_k: int


def prompt_token_logprobs(logits: torch.Tensor, rows: PromptRows) -> dict[int, TokenLogprobs]:
    """logits: [len(rows.targets), V] -> {prompt position of the target token: its TokenLogprobs}."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(rows.targets, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top = torch.topk(logprobs, max(rows.top_k, 1), dim=-1)
    values, ids = top.values[:, : rows.top_k].tolist(), top.indices[:, : rows.top_k].tolist()
    return {
        rows.first_position + 1 + j: TokenLogprobs(t, chosen[j], tuple(zip(ids[j], values[j], strict=True)))
        for j, t in enumerate(rows.targets)
    }


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus. logits: [V]."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly above it already reach top_p. The most likely token
        # always stays: a top_p that rounds to 0 in float32 would otherwise drop every token.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, history: Request | None, eos: frozenset[int]):
    """Apply ``params``' logit bias, min_tokens mask and penalties to one row ``logits`` [V] in place.

    ``history``: the request (its prompt and output token ids); needed for penalties and min_tokens.
    Placeholder ids (< 0, a token still on the device) are skipped; the engine does not pipeline
    steps of penalized requests, so none is there when penalties read the history.
    """
    vocab = logits.numel()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.int64)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=logits.dtype)
        logits.index_add_(0, ids.to(logits.device), bias.to(logits.device))
    if history is None:
        return logits
    if history.num_output_tokens < params.min_tokens:
        banned = [t for t in (*eos, *params.stop_token_ids) if 0 <= t < vocab]
        if banned:
            logits[torch.tensor(banned, dtype=torch.int64, device=logits.device)] = float("-inf")
    if not params.penalized:
        return logits
    ids = torch.tensor(history.token_ids, dtype=torch.int64, device=logits.device)
    ids = ids[(ids >= 0) & (ids < vocab)]
    output = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
    out_ids = ids[history.num_prompt_tokens :] if len(ids) > history.num_prompt_tokens else ids[:0]
    output.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[ids] = True
        scaled = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    logits -= params.frequency_penalty * output + params.presence_penalty * (output > 0).to(logits.dtype)
    return logits


def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token from a processed row [V]; never raises on a row whose every probability is 0 or NaN."""
    row = _filter_top_k_top_p(row / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(row, dim=-1)
    probs = torch.where(torch.isfinite(probs), probs, torch.zeros_like(probs))
    # No mass left (a model that produced inf or NaN): put it all on the argmax instead of failing.
    empty = (probs.sum() <= 0).to(probs.dtype)
    probs[torch.nan_to_num(row, nan=float("-inf")).argmax()] += empty
    return torch.multinomial(probs, 1, generator=generator)


class Sampler:
    """Picks one token per row. Requests with a seed draw from their own generator, so their
    output does not depend on what else is in the batch; others share one engine generator.

    ``eos_token_ids``: what ``min_tokens`` keeps from being sampled (set by the engine).
    """

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.eos_token_ids: frozenset[int] = frozenset()
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

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        requests: Sequence[Request] | None = None,
    ) -> SampledTokens:
        """logits: [N, vocab] float32 -> N token ids, computed on the device without waiting for it.

        ``requests``: the rows' requests, whose token histories penalties and min_tokens read.
        Rows draw from their generators in row order, as ``__call__`` always did, so outputs match.
        """
        raw = logits
        if any(p.processes_logits for p in params):
            logits = logits.clone()
            for i, p in enumerate(params):
                if p.processes_logits:
                    process_logits(logits[i], p, None if requests is None else requests[i], self.eos_token_ids)
        tokens = logits.argmax(dim=-1)
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if not p.greedy:
                tokens[i : i + 1] = _draw(logits[i], p, self._generator(rid, p))
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return SampledTokens(tokens)
        return SampledTokens(tokens, _LogprobRows.of(raw, tokens, wanted, [params[i].logprobs for i in wanted]))


class _LogprobRows:
    """Log-probabilities of some rows' sampled tokens and their top alternatives, on the device until read."""

    def __init__(self, rows: list[int], top_ks: list[int], chosen: torch.Tensor, top_values, top_ids):
        self.rows, self.top_ks = rows, top_ks
        self.tensors = [chosen, top_values, top_ids]

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], top_ks: list[int]) -> _LogprobRows:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
        chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
        top = torch.topk(logprobs, max(max(top_ks), 1), dim=-1)
        return cls(rows, top_ks, chosen, top.values, top.indices)

    def to_host(self) -> None:
        self.tensors = [t.to("cpu", non_blocking=True) for t in self.tensors]

    def read(self, tokens: list[int]) -> dict[int, TokenLogprobs]:
        chosen, values, ids = (t.tolist() for t in self.tensors)
        out = {}
        for j, (row, k) in enumerate(zip(self.rows, self.top_ks, strict=True)):
            top = tuple(zip(ids[j][:k], values[j][:k], strict=True))
            out[row] = TokenLogprobs(tokens[row], chosen[j], top)
        return out


class SampledTokens:
    """A step's sampled token ids on their way to the host.

    On CUDA the copy into pinned host memory is queued behind the step's kernels and ``tolist`` waits
    only for it, so the host can do other work (bookkeeping of the step) while the device runs.

    ``logprobs()`` (after ``tolist``): the rows' ``TokenLogprobs``, for rows whose request asked for
    them. ``prompt_logprobs``: what the step computed for prompt tokens, by request id (see
    ``ModelRunner.run``).
    """

    def __init__(self, tokens: torch.Tensor, logprob_rows: _LogprobRows | None = None):
        self.device_tokens = tokens  # [N] int64 on the step's device: what a pipelined next step reads
        self.prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = {}
        self._event = None
        self._logprob_rows = logprob_rows
        if tokens.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            if logprob_rows is not None:
                logprob_rows.to_host()
            self._event = torch.cuda.Event()
            self._event.record()
            tokens = host
        self._tokens = tokens

    @classmethod
    def empty(cls) -> SampledTokens:
        return cls(torch.zeros(0, dtype=torch.int64))

    def with_prompt_logprobs(self, computed: dict[str, dict[int, TokenLogprobs]]) -> SampledTokens:
        self.prompt_logprobs = computed
        return self

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._tokens.tolist()

    def logprobs(self) -> dict[int, TokenLogprobs]:
        """Row -> the sampled token's log-probabilities, for the rows that asked (waits for the device)."""
        if self._logprob_rows is None:
            return {}
        return self._logprob_rows.read(self.tolist())


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
