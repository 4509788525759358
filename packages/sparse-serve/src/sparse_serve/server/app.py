"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncEngine``.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or
server-sent events with ``stream: true``), ``GET /health``, ``GET /metrics`` (Prometheus) and the
chain cache's ``/v1/chains/...`` (``chains.py``).
Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
A client that goes away, mid-stream or while waiting for a whole response, has its request
aborted in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.server import chains
from sparse_serve.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError
from sparse_serve.server.chat import ChatTemplate, ChatTemplateError
from sparse_serve.server.errors import APIError, bad_request, from_engine_error, server_error
from sparse_serve.server.metrics import CONTENT_TYPE, ServerMetrics
from sparse_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    parse_body,
    unknown_model,
)
from sparse_serve.server.responses import ChatReply, CompletionReply
from sparse_serve.server.streaming import EventStreamResponse, final_output, sse_events
from sparse_serve.tokenizer import Tokenizer

logger = logging.getLogger("uvicorn.error")
T = TypeVar("T", bound=SamplingRequest)
router = APIRouter()


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings (the engine's are an ``EngineConfig``).

    ``served_model_name`` defaults to the model folder's name. ``max_waiting_requests`` bounds the
    requests accepted but not yet scheduled; beyond it requests get 503. On shutdown, open requests
    get ``graceful_shutdown_s`` to finish before they are cancelled.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_waiting_requests: int = 1024
    max_body_bytes: int = 32 * 2**20
    graceful_shutdown_s: float = 30.0
    access_log: bool = True
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")


@dataclass(frozen=True, slots=True)
class _State:
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    max_model_len: int
    max_body_bytes: int
    created: int


def build_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``engine``; the engine thread runs from the app's startup to its shutdown."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    tokenizer_path = engine.config.tokenizer or engine.config.model
    state = _State(
        engine=AsyncEngine(engine, metrics, max_waiting_requests=config.max_waiting_requests),
        metrics=metrics,
        model_name=config.served_model_name or Path(engine.config.model).name,
        tokenizer=engine.tokenizer,
        chat_template=ChatTemplate.from_pretrained(tokenizer_path) if engine.tokenizer is not None else None,
        max_model_len=engine.max_model_len,
        max_body_bytes=config.max_body_bytes,
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        logger.info(
            "serving %r: max_model_len %d, %d KV blocks of %d tokens, chat template %s",
            state.model_name,
            state.max_model_len,
            engine.kv.num_blocks,
            engine.config.block_size,
            "none" if state.chat_template is None else "fallback" if state.chat_template.is_fallback else "tokenizer's",
        )
        try:
            yield
        finally:
            await state.engine.shutdown()

    app = FastAPI(title="SparseEngine", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    app.include_router(chains.router)
    return app


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Build the engine and serve it with uvicorn until interrupted (Ctrl-C drains, twice forces)."""
    import uvicorn

    app = build_app(LLMEngine(engine_config), config)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=config.graceful_shutdown_s,
    )


# -- routes ---------------------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request) -> dict[str, str]:
    if not _state(request).engine.is_alive:
        raise server_error(503, "The engine is not running.", code="engine_unavailable")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    state = _state(request)
    return PlainTextResponse(state.metrics.render(state.engine.snapshot()), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if model_id != state.model_name:
        raise unknown_model(model_id)
    return _model_card(state)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, CompletionRequest, state)
    prompt = body.single_prompt()
    ids = await _encode(state, prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
    return await _generate(request, state, body, ids, CompletionReply(state.model_name), default_max_tokens=16)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, ChatCompletionRequest, state)
    if state.chat_template is None:
        raise bad_request("This model has no tokenizer, so it cannot serve chat; use /v1/completions with token ids.")
    try:
        text = state.chat_template.render(body.template_messages())
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    # The template writes the special tokens itself (as HF's apply_chat_template does).
    ids = await _encode(state, text, add_special_tokens=False)
    return await _generate(request, state, body, ids, ChatReply(state.model_name), default_max_tokens=None)


# -- request handling -----------------------------------------------------------------------------
def _state(request: Request) -> _State:
    return request.app.state.server


def _model_card(state: _State) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "sparse-engine",
        "max_model_len": state.max_model_len,
    }


async def _parse(request: Request, model: type[T], state: _State) -> T:
    """Read, size-limit and validate the body, then the checks every generation request shares."""
    body = await parse_body(request, model, state.max_body_bytes)
    if body.model != state.model_name:
        raise unknown_model(body.model)
    body.check_supported()
    if body.stream_options is not None and not body.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    _chain_extension(body)
    return body


def _chain_extension(body: SamplingRequest) -> None:
    """The chain cache's fields (``chain_id``, ``chain_append_start``) go to the engine as they are
    (``_generate``); a ``chain_append_start`` needs the ``chain_id`` it applies to."""
    fields = body.chain_fields()
    if "chain_append_start" in fields and "chain_id" not in fields:
        raise bad_request("`chain_append_start` needs a `chain_id`", param="chain_append_start")


async def _encode(state: _State, text: str, add_special_tokens: bool) -> list[int]:
    if state.tokenizer is None:
        raise bad_request("This model has no tokenizer.json; send the prompt as token ids.", param="prompt")
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


async def _generate(
    request: Request,
    state: _State,
    body: SamplingRequest,
    prompt_ids: list[int],
    reply: CompletionReply,
    default_max_tokens: int | None,
) -> Response:
    params = body.sampling_params(len(prompt_ids), state.max_model_len, default_max_tokens)
    try:
        stream = await state.engine.add(prompt_ids, params, body.chain_fields())
    except QueueFullError as e:
        state.metrics.on_rejected("queue_full")
        message = f"The server is at capacity: {e}; retry later."
        raise server_error(503, message, code="queue_full", retry_after_s=1) from None
    except EngineUnavailableError as e:
        raise server_error(503, str(e), code="engine_unavailable") from None
    except ValueError as e:
        raise from_engine_error(e, param=body.prompt_field) from None
    if body.stream:
        return EventStreamResponse(sse_events(stream, reply, body.include_usage), on_close=stream.close)
    try:
        final = await final_output(stream, request)
    except EngineUnavailableError as e:
        raise server_error(503, str(e), code="engine_unavailable") from None
    finally:
        stream.close()
    if final is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    return JSONResponse(reply.response(final))


# -- errors ---------------------------------------------------------------------------------------
async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return APIError(error.status_code, str(error.detail), type=kind).response()


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return server_error(500, f"Internal server error: {type(error).__name__}").response()
