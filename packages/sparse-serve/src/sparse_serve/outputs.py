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
