"""The generation routes (``/v1/completions``, ``/v1/chat/completions``) and the tokenizer's
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``).

A request becomes one engine request per choice: each prompt (completions take a batch) times
``n``. With ``n > 1`` the first sample of a prompt goes first and the others follow once its prompt
is computed, so exact-KV methods (dense, Quest) share its prompt blocks through the prefix cache;
evicting methods have no prefix cache and compute each sample's prompt.

Text is bounded before it is tokenized: a prompt longer than ``max_model_len`` times the longest
token's length (in characters, from the vocabulary) cannot fit, and is refused without encoding it,
so a huge prompt costs milliseconds and never holds the interpreter lock for seconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sparse_serve.server.async_engine import EngineUnavailableError, QueueFullError, RequestStream
from sparse_serve.server.chat import ChatTemplate, ChatTemplateError
from sparse_serve.server.errors import bad_request, from_engine_error, server_error
from sparse_serve.server.metrics import ServerMetrics
from sparse_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    parse_body,
    unknown_model,
)
from sparse_serve.server.responses import ChatReply, CompletionReply
from sparse_serve.server.streaming import EventStreamResponse, final_outputs, request_failed, sse_events
from sparse_serve.tokenizer import Tokenizer

T = TypeVar("T", bound=SamplingRequest)
router = APIRouter()


@dataclass(frozen=True, slots=True)
class State:
    engine: Any  # AsyncEngine or EngineProcess
    metrics: ServerMetrics
    model_names: tuple[str, ...]
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    max_model_len: int
    vocab_size: int
    max_body_bytes: int
    created: int
    max_prompt_chars: int  # text longer than this cannot fit max_model_len tokens

    @property
    def model_name(self) -> str:
        return self.model_names[0]


# -- routes ---------------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, CompletionRequest, state)
    prompts = [
        await encode(state, p, add_special_tokens=True, param="prompt") if isinstance(p, str) else p
        for p in body.prompts()
    ]
    texts = [p if isinstance(p, str) else _decode(state, p) for p in body.prompts()] if body.echo else ()
    reply = CompletionReply(
        body.model, _token_text(state, body.logprobs is not None), bool(body.echo), texts, body.num_choices
    )
    return await _generate(request, state, body, prompts, reply, default_max_tokens=16)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, ChatCompletionRequest, state)
    if state.chat_template is None:
        raise bad_request("This model has no tokenizer, so it cannot serve chat; use /v1/completions with token ids.")
    template = state.chat_template
    if body.chat_template is not None:
        template = _request_template(body.chat_template, template)
    _bound_text(state, sum(len(m.text()) for m in body.messages), "messages")
    try:
        text = template.render(body.template_messages())
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    # The template writes the special tokens itself (as HF's apply_chat_template does).
    ids = await encode(state, text, add_special_tokens=False, param="messages")
    reply = ChatReply(body.model, _token_text(state, bool(body.logprobs)))
    return await _generate(request, state, body, [ids], reply, default_max_tokens=None)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = await parse_body(request, TokenizeRequest, state.max_body_bytes)
    _check_model(state, body.model)
    if body.messages is not None:
        if state.chat_template is None:
            raise bad_request("This model has no chat template.", param="messages")
        text = state.chat_template.render(
            [m.for_template(i) for i, m in enumerate(body.messages)], body.add_generation_prompt
        )
        ids = await encode(state, text, add_special_tokens=False, param="messages")
    else:
        ids = await encode(state, body.prompt, add_special_tokens=body.add_special_tokens, param="prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and length limit (vLLM's route; what
    lm-evaluation-harness's remote tokenizer reads, so a client needs no copy of the tokenizer)."""
    state = _state(request)
    if state.tokenizer is None or state.chat_template is None:
        raise bad_request("This model has no tokenizer.json.")
    bos, eos = state.chat_template.special_tokens
    return {
        "bos_token": bos or None,
        "eos_token": eos or None,
        "pad_token": None,
        "chat_template": state.chat_template.source,
        "model_max_length": state.max_model_len,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = await parse_body(request, DetokenizeRequest, state.max_body_bytes)
    _check_model(state, body.model)
    if state.tokenizer is None:
        raise bad_request("This model has no tokenizer.json.", param="tokens")
    if any(not 0 <= t < state.vocab_size for t in body.tokens):
        raise bad_request(f"Token ids must be in [0, {state.vocab_size}).", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}


# -- request handling -----------------------------------------------------------------------------
def _state(request: Request) -> State:
    return request.app.state.server


def _check_model(state: State, name: str | None) -> None:
    if name is not None and name not in state.model_names:
        raise unknown_model(name)


async def _parse(request: Request, model: type[T], state: State) -> T:
    """Read, size-limit and validate the body, then the checks every generation request shares."""
    body = await parse_body(request, model, state.max_body_bytes)
    _check_model(state, body.model)
    body.check_supported()
    if body.stream_options is not None and not body.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    if "chain_append_start" in body.chain_fields() and body.chain_id is None:
        raise bad_request("`chain_append_start` needs a `chain_id`", param="chain_append_start")
    return body


def _bound_text(state: State, num_chars: int, param: str) -> None:
    """Refuse text that cannot fit the context whatever its tokens, before spending time on it."""
    limit = state.max_prompt_chars
    if num_chars > limit:
        raise bad_request(
            f"This model's maximum context length is {state.max_model_len} tokens; a text of {num_chars} "
            f"characters is longer than any {state.max_model_len} tokens can be ({limit} characters).",
            param=param,
            code="context_length_exceeded",
        )


async def encode(state: State, text: str, add_special_tokens: bool, param: str) -> list[int]:
    if state.tokenizer is None:
        raise bad_request("This model has no tokenizer.json; send the prompt as token ids.", param=param)
    _bound_text(state, len(text), param)
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


def _decode(state: State, token_ids: list[int]) -> str:
    if state.tokenizer is None or any(not 0 <= t < state.vocab_size for t in token_ids):
        return ""  # the engine rejects bad ids; a model without a tokenizer has no text to echo
    return state.tokenizer.decode(token_ids, skip_special_tokens=False)


def _token_text(state: State, wanted: bool):
    if not wanted or state.tokenizer is None:
        return None
    tokenizer = state.tokenizer
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def _request_template(source: str, base: ChatTemplate) -> ChatTemplate:
    try:
        return ChatTemplate(source, *base.special_tokens)
    except Exception as e:  # jinja's syntax errors
        raise bad_request(f"The chat template does not compile: {e}", param="chat_template") from None


async def _add_choices(
    state: State, body: SamplingRequest, prompts: list[list[int]], default_max_tokens: int | None
) -> list[RequestStream]:
    """Queue every choice; on any failure, abort those already queued and raise the error."""
    n = body.num_choices
    params = [
        body.sampling_params(len(ids), state.max_model_len, default_max_tokens, state.vocab_size) for ids in prompts
    ]  # every prompt is checked before anything is queued
    streams: list[RequestStream] = []
    try:
        for ids, first_params in zip(prompts, params, strict=True):
            first = await _add(state, body, ids, first_params)
            streams.append(first)
            if n > 1:
                await first.wait_first_output()  # its prompt blocks are cached now
            for i in range(1, n):
                p = body.sampling_params(len(ids), state.max_model_len, default_max_tokens, state.vocab_size, i)
                streams.append(await _add(state, body, ids, p))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def _add(state: State, body: SamplingRequest, ids: list[int], params) -> RequestStream:
    try:
        return await state.engine.add(ids, params, body.chain_fields())
    except QueueFullError as e:
        state.metrics.on_rejected("queue_full")
        message = f"The server is at capacity: {e}; retry later."
        raise server_error(503, message, code="queue_full", retry_after_s=1) from None
    except EngineUnavailableError as e:
        raise server_error(503, str(e), code="engine_unavailable") from None
    except ValueError as e:
        raise from_engine_error(e, param=body.prompt_field) from None


async def _generate(
    request: Request,
    state: State,
    body: SamplingRequest,
    prompts: list[list[int]],
    reply: CompletionReply,
    default_max_tokens: int | None,
) -> Response:
    streams = await _add_choices(state, body, prompts, default_max_tokens)

    def close_all() -> None:
        for s in streams:
            s.close()

    if body.stream:
        events = sse_events(streams, reply, body.include_usage, body.continuous_usage, len(prompts))
        return EventStreamResponse(events, on_close=close_all)
    try:
        finals = await final_outputs(streams, request)
    except EngineUnavailableError as e:
        raise server_error(503, str(e), code="engine_unavailable") from None
    finally:
        close_all()
    if finals is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    failed = next((o for o in finals if o.finish_reason == "error"), None)
    if failed is not None:
        raise request_failed(failed)
    return JSONResponse(reply.response(finals, len(prompts)))
