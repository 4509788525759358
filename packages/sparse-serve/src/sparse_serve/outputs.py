"""What generation returns: the final result, or a streamed update."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step.

    ``token_ids`` and ``text`` are everything generated so far (the whole output once
    ``finished``); ``delta_token_ids`` and ``delta_text`` are what this update added.
    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string, named by
    ``stop_reason``), ``"length"`` (max_tokens or max_model_len) or ``"abort"``.
    ``num_cached_tokens``: prompt tokens served by the radix prefix cache. For a request on a chain,
    ``chain_status`` is ``created``, ``resumed`` or ``recreated`` and ``reused_tokens`` counts the
    prompt tokens whose retained KV it resumed from (not computed again).
    ``logprobs``: a ``sampler.TokenLogprobs`` per generated token so far, when the request asked
    (``SamplingParams.logprobs``); ``prompt_logprobs`` one per prompt token (the first is None).
    ``finish_reason == "error"``: the request failed on its own (``error`` says why); others go on.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    delta_token_ids: tuple[int, ...]
    delta_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    chain_id: str | None = None
    chain_status: str | None = None
    reused_tokens: int = 0
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
    error: str | None = None
