"""Request bodies of the OpenAI-compatible API, validated strictly.

Types are strict (``"5"`` is not an integer) and unknown fields are errors. OpenAI's standard
fields that the engine does not implement are accepted only at their neutral value (``echo: false``,
``frequency_penalty: 0``, ``tools: []``...) so a client that sends its defaults works, while one
that asks for the feature gets a 400 naming the field instead of a silently different answer.

Engine extensions are extra body fields named as in ``SamplingParams`` (``top_k``, ``ignore_eos``,
``stop_token_ids``) and ``LLMEngine.add_request`` (``chain_id``, ``chain_append_start``: the chain
cache). ``parse_body`` reads and validates any body of this server.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from sparse_serve.sampling_params import SamplingParams
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


class StreamOptions(StrictBody):
    include_usage: bool | None = None
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
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Engine extensions, named as in SamplingParams.
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # Engine extensions, named as in LLMEngine.add_request: the chain cache.
    chain_id: str | None = None
    chain_append_start: int | None = None
    # Standard OpenAI fields accepted only when neutral (see unsupported_fields).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    unsupported_fields: ClassVar[tuple[str, ...]] = ("frequency_penalty", "presence_penalty", "logit_bias")
    prompt_field: ClassVar[str] = "prompt"

    def check_supported(self) -> None:
        """Raise a 400 for a feature this server does not implement."""
        if self.n not in (None, 1):
            raise bad_request("Only `n=1` is supported; send one request per sample.", param="n")
        for name in self.unsupported_fields:
            if not _neutral(getattr(self, name)):
                raise not_supported(name)

    def chain_fields(self) -> dict[str, Any]:
        """The chain-cache extension fields that were set (empty when the request uses none)."""
        return {k: v for k in ("chain_id", "chain_append_start") if (v := getattr(self, k)) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(
        self, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int | None
    ) -> SamplingParams:
        """Engine sampling parameters; a 400 when the prompt plus ``max_tokens`` exceed the context.

        ``default_max_tokens`` applies when the request gives none (None: the rest of the context).
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
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                seed=self.seed,
                stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos),
            )
        except ValueError as e:
            raise bad_request(str(e)) from e


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    unsupported_fields: ClassVar[tuple[str, ...]] = (*SamplingRequest.unsupported_fields, "echo", "suffix", "logprobs")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise not_supported("best_of", "must be 1 (or left out)")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, unwrapped from a one-element batch; batches of several are a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(
                    f"Batched prompts are not supported ({len(prompt)} given); send one request per prompt.",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise bad_request("The prompt is empty.", param="prompt")
        return prompt


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
    top_logprobs: int | None = None
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
        *("logprobs", "top_logprobs", "tools", "functions", "audio", "prediction", "reasoning_effort"),
        *("verbosity", "web_search_options"),
    )

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format not in (None, {"type": "text"}):
            raise not_supported("response_format", "other than {'type': 'text'} is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise not_supported(name, "needs tools, which are not supported")
        if self.modalities not in (None, ["text"]):
            raise not_supported("modalities", "other than ['text'] is not supported")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


def unknown_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
