"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sparse_serve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """Tokens, progress and output of one generation request.

    ``num_computed_tokens`` counts the tokens of ``token_ids`` whose KV is in the cache. A step
    processes the next ``num_tokens`` of them; when that reaches the end of ``token_ids`` the step
    also samples the next token.
    """

    request_id: str
    token_ids: list[int]  # prompt then generated tokens; grows in place (never rebuilt per step)
    sampling_params: SamplingParams
    arrival: int
    prompt: str | None = None
    num_prompt_tokens: int | None = None  # None: all of token_ids is the prompt
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: tuple[int, ...] = ()  # set from token_ids on creation
    # KV slots each layer holds (each (layer, KV head) lane in the head-major layout, layer-major);
    # equals num_computed_tokens unless the sparse method evicted some.
    kv_lens: list[int] = field(default_factory=lambda: [0])
    # Tokens present when the request was (re)admitted: what this admission prefills. Equals the
    # prompt, or prompt + output so far after a preemption (recompute).
    prefill_len: int = 0
    # The chain this request continues (None: none), how it started on it, and how many prompt
    # tokens it took from the chain's retained KV instead of computing them.
    chain_id: str | None = None
    chain_status: str | None = None
    num_reused_tokens: int = 0
    # Holds a chain's retained KV from before its admission (cleared when preempted: it recomputes), and the
    # method's state of that chain (what ``release`` returned), which its first step hands the method.
    resumed: bool = False
    resumed_state: object | None = None
    # A resumed chain's incomplete page on the host (a store with tails: per layer, each tail tensor's row),
    # copied into the request's tail row before its first step writes anything; None when none is pending.
    resumed_tail: tuple[dict[str, object], ...] | None = None  # host tensors
    # Log-probabilities of the sampled tokens (when asked for), and of the prompt tokens by position
    # (None: not asked for; entry 0 is always None, nothing precedes the first token).
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    # The method's replay passes (token ids) for this admission's prompt, and how many have run:
    # they run, one per step, after the prompt and before the first decode (``SparseMethod.replay_passes``).
    replay_passes: tuple[tuple[int, ...], ...] = ()
    num_replays_done: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.token_ids)
        self.prompt_token_ids = tuple(self.token_ids[: self.num_prompt_tokens])

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def state_to_resume(self) -> object | None:
        """The resumed chain's method state while the method has not had it yet: until the request's first
        step (``RequestStep.resumed_state``), which starts after the chain's reused tokens; else None."""
        if self.resumed and self.num_computed_tokens == self.num_reused_tokens:
            return self.resumed_state
        return None

    @property
    def replaying(self) -> bool:
        """The request's next step runs a replay pass instead of its own tokens."""
        return self.num_replays_done < len(self.replay_passes)

    @property
    def next_replay(self) -> tuple[int, ...]:
        return self.replay_passes[self.num_replays_done]

    @property
    def kv_len(self) -> int:
        """Slots the request's table must hold (its largest layer)."""
        return max(self.kv_lens)

    def reset_kv(self, num_tokens: int = 0) -> None:
        self.kv_lens = [num_tokens] * len(self.kv_lens)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
