"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (as vLLM): dividing logits by a tinier one overflows to
# inf and the softmax to NaN, and the distribution is one-hot to float32 precision long before.
GREEDY_TEMPERATURE = 1e-5
# Most top log-probabilities a request may ask for per token (OpenAI allows 20 in chat, 5 in completions).
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) is greedy. ``top_k == 0`` and
    ``top_p == 1`` disable those filters. Generation stops at ``max_tokens``, at an EOS token
    (unless ``ignore_eos``), at any of ``stop_token_ids``, or when the text contains one of ``stop``
    (the stop string itself is returned only with ``include_stop_str_in_output``). ``min_tokens``:
    EOS and ``stop_token_ids`` cannot be sampled before that many tokens were generated.

    Logit processing, in order, on the raw logits: ``logit_bias`` (token id -> added value),
    ``repetition_penalty`` (> 1 discourages every token of the prompt and output, CTRL's rule),
    ``frequency_penalty`` (times each token's count in the output) and ``presence_penalty`` (once per
    token present in the output), as OpenAI defines them.

    ``logprobs``: return the sampled token's log-probability and the ``logprobs`` most likely tokens'
    (0: the sampled one only), from the raw model distribution. ``prompt_logprobs``: the same for
    each prompt token after the first (the prompt is then computed, never taken from the prefix cache).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        self._check_logit_processing()

    def _check_logit_processing(self) -> None:
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else tuple(tuple(p) for p in bias)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        if any(t < 0 or not math.isfinite(b) for t, b in self.logit_bias):
            raise ValueError("logit_bias maps non-negative token ids to finite values")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the request's token history (the tokens, not only their count)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0
