"""Request bodies of the OpenAI-compatible API, validated strictly.

Types are strict (``"5"`` is not an integer) and unknown fields are errors. OpenAI's standard
fields that the engine does not implement are accepted only at their neutral value (``suffix: ""``,
``tools: []``, ``response_format: {"type": "text"}``...) so a client that sends its defaults works,
while one that asks for the feature gets a 400 naming the field instead of a silently different answer.

Engine extensions are extra body fields named as in ``SamplingParams`` (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``min_tokens``, ``repetition_penalty``, ``include_stop_str_in_output``,
``skip_special_tokens``: vLLM's names) and ``LLMEngine.add_request`` (``chain_id``,
``chain_append_start``: the chain cache). ``parse_body`` reads and validates any body of this server.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from sparse_serve.sampling_params import MAX_LOGPROBS, SamplingParams
from sparse_serve.server.errors import APIError, bad_request, from_validation_error, not_supported


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


B = TypeVar("B", bound=BaseModel)


async def parse_body(request: Request, model: type[B], max_body_bytes: int) -> B:
    """Read the body (413 beyond ``max_body_bytes``) and validate it as ``model`` (400 naming the field)."""
    raw = bytearray()
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > max_body_bytes:
                raise APIError(413, f"The request body exceeds {max_body_bytes} bytes.", code="body_too_large")
    except ClientDisconnect:  # gone before sending the whole body: nothing to answer, nothing to log
        raise APIError(499, "The client disconnected.", code="client_disconnected") from None
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as e:
        raise from_validation_error(e) from None


# Choices one request may ask for (prompts x n): each is a request in the engine.
MAX_CHOICES = 64
# OpenAI's bounds: a logit bias in [-100, 100]; completions return at most 5 top logprobs.
MAX_LOGIT_BIAS = 100.0
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(StrictBody):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage in every chunk (vLLM's; guidellm sends it)
    include_obfuscation: bool | None = None  # OpenAI pads chunks against side channels; nothing to pad here


def _neutral(value: Any) -> bool:
    """Unset, zero, false, empty: a standard field at the value that asks for nothing."""
    return value is None or value is False or value == 0 or value == "" or value == [] or value == {}


class SamplingRequest(StrictBody):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # the range of torch.Generator.manual_seed
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Engine extensions, named as in SamplingParams.
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Engine extensions, named as in LLMEngine.add_request: the chain cache.
    chain_id: str | None = None
    chain_append_start: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    unsupported_fields: ClassVar[tuple[str, ...]] = ()
    prompt_field: ClassVar[str] = "prompt"

    def check_supported(self) -> None:
        """Raise a 400 for a feature this server does not implement."""
        for name in self.unsupported_fields:
            if not _neutral(getattr(self, name)):
                raise not_supported(name)
        if self.stop is not None and any(s == "" for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise bad_request("`stop` strings must be non-empty.", param="stop", code="invalid_value")

    def logit_bias_pairs(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` with token-id keys; a 400 naming the field for a key that is not a token id."""
        pairs = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isdigit() and int(key) < vocab_size):
                raise bad_request(
                    f"`logit_bias` keys must be token ids in [0, {vocab_size}); got {key!r}.", param="logit_bias"
                )
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise bad_request(f"`logit_bias` values must be in [-100, 100]; got {value}.", param="logit_bias")
            pairs[int(key)] = value
        return pairs

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def logprob_fields(self) -> dict[str, int | None]:
        """``SamplingParams``' ``logprobs`` and ``prompt_logprobs`` for this request."""
        return {"logprobs": None, "prompt_logprobs": None}

    def chain_fields(self) -> dict[str, Any]:
        """The chain-cache extension fields that were set (empty when the request uses none)."""
        return {k: v for k in ("chain_id", "chain_append_start") if (v := getattr(self, k)) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        default_max_tokens: int | None,
        vocab_size: int,
        sample_index: int = 0,
    ) -> SamplingParams:
        """Engine sampling parameters; a 400 when the prompt plus ``max_tokens`` exceed the context.

        ``default_max_tokens`` applies when the request gives none (None: the rest of the context).
        ``sample_index``: which of the ``n`` samples (a seeded request's samples draw from ``seed + i``,
        so they differ from each other and each is reproducible).
        """
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens} tokens and leaves no room for output.",
                param=self.prompt_field,
                code="context_length_exceeded",
            )
        wanted = self.requested_max_tokens()
        if wanted is not None and wanted > room:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens} tokens, so at most {room} can be generated, but {wanted} were requested.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = wanted if wanted is not None else min(default_max_tokens or room, room)
        seed = None if self.seed is None else (self.seed + sample_index) % 2**64
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                seed=seed,
                stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos),
                min_tokens=self.min_tokens or 0,
                repetition_penalty=self.repetition_penalty or 1.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=self.logit_bias_pairs(vocab_size),
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                skip_special_tokens=self.skip_special_tokens is not False,
                **self.logprob_fields(),
            )
        except ValueError as e:
            field = next((f for f in type(self).model_fields if str(e).startswith(f)), None)
            raise bad_request(str(e), param=field, code="invalid_value") from e


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or several, each as text or token ids.

    ``echo``: each choice's text (and logprobs) starts with its prompt. ``logprobs`` (0-5): the
    sampled tokens' log-probabilities and that many top alternatives; with ``echo`` the prompt's too
    (what lm-evaluation-harness reads for loglikelihood tasks).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    unsupported_fields: ClassVar[tuple[str, ...]] = (*SamplingRequest.unsupported_fields, "suffix")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.num_choices):
            raise not_supported("best_of", "must equal n (or be left out): choosing the best of more is not built")
        if self.chain_id is not None and len(self.prompts()) * self.num_choices > 1:
            raise bad_request("A request on a chain has one prompt and n=1.", param="chain_id")
        if len(self.prompts()) * self.num_choices > MAX_CHOICES:
            raise bad_request(f"At most {MAX_CHOICES} choices (prompts x n) per request.", param="n")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one unless ``prompt`` is a batch); an empty one is a 400."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        if any(not p for p in batch):
            raise bad_request("The prompt is empty.", param="prompt")
        return batch

    def logprob_fields(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    """One message; the fields an OpenAI client echoes back from a response are accepted when empty."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self, index: int) -> dict[str, Any]:
        for name in ("audio", "function_call", "tool_calls"):
            if not _neutral(getattr(self, name)):
                raise not_supported(f"messages.{index}.{name}")
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    prompt_field: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template: str | None = None  # vLLM's per-request template (jinja source)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    # Accepted and ignored: bookkeeping that does not change the output.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    unsupported_fields: ClassVar[tuple[str, ...]] = (
        *SamplingRequest.unsupported_fields,
        *("tools", "functions", "audio", "prediction", "reasoning_effort"),
        *("verbosity", "web_search_options"),
    )

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format not in (None, {"type": "text"}):
            # json_object / json_schema need constrained decoding, which is not built: say so.
            raise not_supported(
                "response_format", "other than {'type': 'text'} needs constrained decoding, which is not supported"
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
        if self.chain_id is not None and self.num_choices > 1:
            raise bad_request("A request on a chain has n=1.", param="n")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise not_supported(name, "needs tools, which are not supported")
        if self.modalities not in (None, ["text"]):
            raise not_supported("modalities", "other than ['text'] is not supported")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_fields(self) -> dict[str, int | None]:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None, "prompt_logprobs": None}

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


class TokenizeRequest(StrictBody):
    """``POST /tokenize``: a prompt, or chat messages rendered by the chat template (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def model_post_init(self, context: Any) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("Send exactly one of `prompt` and `messages`.", param="prompt")


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


def unknown_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
