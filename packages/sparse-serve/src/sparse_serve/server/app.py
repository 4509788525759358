"""The OpenAI-compatible HTTP server: FastAPI routes over an engine handle.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or
server-sent events with ``stream: true``; ``generation.py``), ``POST /tokenize``, ``POST /detokenize``,
``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus) and the chain cache's
``/v1/chains/...`` (``chains.py``).
Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
A client that goes away, mid-stream or while waiting for a whole response, has its request
aborted in the engine, which frees its KV blocks.

The engine runs on a thread of this process (``AsyncEngine``: tests, embedding) or in a process of
its own (``EngineProcess``: ``run_server``, as vLLM v1 does), so parsing, tokenizing and SSE never
take CPU time from the step loop. If the engine dies, every open request fails with a 503 and the
server stops; ``run_server`` then exits with status 1 so that a supervisor restarts it.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.server import chains, generation
from sparse_serve.server.async_engine import AsyncEngine, EngineInfo
from sparse_serve.server.chat import ChatTemplate
from sparse_serve.server.errors import APIError, server_error
from sparse_serve.server.generation import State
from sparse_serve.server.metrics import CONTENT_TYPE, ServerMetrics
from sparse_serve.server.protocol import unknown_model

logger = logging.getLogger("uvicorn.error")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings (the engine's are an ``EngineConfig``).

    ``served_model_name``: the names clients may send (the first is the one ``/v1/models`` lists
    first); default the model folder's name. ``max_waiting_requests`` bounds the requests accepted but
    not yet scheduled; beyond it requests get 503. On shutdown, open requests get
    ``graceful_shutdown_s`` to finish before they are cancelled. ``api_key``: every ``/v1`` route and
    ``/tokenize`` / ``/detokenize`` need ``Authorization: Bearer <api_key>`` (401 otherwise).
    ``allowed_origins`` (empty: no CORS headers), ``allowed_methods``, ``allowed_headers``,
    ``allow_credentials``: CORS. ``chat_template``: a jinja file or the template itself, instead of the
    tokenizer's. ``engine_process``: ``run_server`` runs the engine in a process of its own.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: tuple[str, ...] | str | None = None
    max_waiting_requests: int = 1024
    max_body_bytes: int = 32 * 2**20
    graceful_shutdown_s: float = 30.0
    access_log: bool = True
    log_level: str = "info"
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    chat_template: str | None = None
    engine_process: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        names = self.served_model_name
        names = (names,) if isinstance(names, str) else tuple(names or ())
        if any(not n for n in names):
            raise ValueError("served_model_name entries must be non-empty")
        object.__setattr__(self, "served_model_name", names or None)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


def server_version() -> str:
    try:
        return version("sparse-serve")
    except PackageNotFoundError:
        return "unknown"


def build_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``engine``: an ``LLMEngine`` (run on a thread from the app's startup to its
    shutdown) or an engine handle such as ``EngineProcess``. ``app.state.fatal_hooks``: called when
    the engine dies (the server stops)."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    if isinstance(engine, LLMEngine):
        handle = AsyncEngine(engine, metrics, max_waiting_requests=config.max_waiting_requests)
    else:  # an engine elsewhere (EngineProcess): the server counts what it receives
        handle = engine
        handle.metrics = metrics
    info: EngineInfo = handle.info
    tokenizer = handle.tokenizer
    state = State(
        engine=handle,
        metrics=metrics,
        model_names=config.served_model_name or (Path(info.model).name,),
        tokenizer=tokenizer,
        chat_template=_chat_template(config.chat_template, info) if tokenizer is not None else None,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        max_body_bytes=config.max_body_bytes,
        created=int(time.time()),
        max_prompt_chars=info.max_model_len * (tokenizer.max_token_chars() if tokenizer is not None else 1),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        handle.on_fatal = lambda message: _engine_died(app, message)
        handle.start()
        logger.info(
            "serving %s: max_model_len %d, %d KV blocks of %d tokens, chat template %s, engine %s",
            ", ".join(repr(n) for n in state.model_names),
            state.max_model_len,
            info.num_kv_blocks,
            info.block_size,
            "none" if state.chat_template is None else "fallback" if state.chat_template.is_fallback else "set",
            handle.describe(),
        )
        try:
            yield
        finally:
            await handle.shutdown()

    app = FastAPI(title="SparseEngine", lifespan=lifespan)
    app.state.server = state
    app.state.fatal_hooks = []
    app.state.fatal_error = None
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if config.api_key is not None:
        app.middleware("http")(_api_key_check(config.api_key))
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    for route, endpoint, methods in (
        ("/health", health, ["GET"]),
        ("/metrics", metrics_route, ["GET"]),
        ("/version", version_route, ["GET"]),
        ("/v1/models", list_models, ["GET"]),
        ("/v1/models/{model_id:path}", get_model, ["GET"]),
    ):
        app.add_api_route(route, endpoint, methods=methods)
    app.include_router(generation.router)
    app.include_router(chains.router)
    return app


def _chat_template(source: str | None, info: EngineInfo) -> ChatTemplate:
    """``--chat-template``: a file holding the template, or the template text itself."""
    if source is None:
        return ChatTemplate.from_pretrained(info.tokenizer_path)
    path = Path(source)
    text = path.read_text() if len(source) < 4096 and path.is_file() else source
    base = ChatTemplate.from_pretrained(info.tokenizer_path)
    return ChatTemplate(text, *base.special_tokens)


def _engine_died(app: FastAPI, message: str) -> None:
    app.state.fatal_error = message
    logger.error("the engine died (%s); stopping the server", message)
    for hook in app.state.fatal_hooks:
        hook()


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Build the engine and serve it with uvicorn until interrupted (Ctrl-C drains, twice forces).
    Exits with status 1 when the engine died."""
    import uvicorn

    if config.engine_process:
        from sparse_serve.server.engine_process import EngineProcess

        engine = EngineProcess(engine_config, max_waiting_requests=config.max_waiting_requests)
    else:
        engine = LLMEngine(engine_config)
    app = build_app(engine, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=config.graceful_shutdown_s,
        )
    )
    app.state.fatal_hooks.append(lambda: setattr(server, "should_exit", True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it drained for; the drain is done
        pass
    if app.state.fatal_error is not None:
        sys.exit(1)


# -- routes ---------------------------------------------------------------------------------------
async def health(request: Request) -> dict[str, str]:
    if not _state(request).engine.is_alive:
        raise server_error(503, "The engine is not running.", code="engine_unavailable")
    return {"status": "ok"}


async def metrics_route(request: Request) -> PlainTextResponse:
    state = _state(request)
    text = state.metrics.render(state.engine.snapshot(), state.model_names[0])
    return PlainTextResponse(text, media_type=CONTENT_TYPE)


async def version_route() -> dict[str, str]:
    return {"version": server_version()}


async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}


async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if model_id not in state.model_names:
        raise unknown_model(model_id)
    return _model_card(state, model_id)


def _state(request: Request) -> State:
    return request.app.state.server


def _model_card(state: State, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "sparse-engine",
        "root": state.model_names[0],
        "max_model_len": state.max_model_len,
    }


# -- authentication and errors --------------------------------------------------------------------
_OPEN_PATHS = ("/health", "/metrics", "/version")


def _api_key_check(api_key: str):
    expected = f"Bearer {api_key}"

    async def check(request: Request, call_next):
        # CORS preflights carry no credentials; open probes stay open (as vLLM's /health).
        if request.method == "OPTIONS" or request.url.path in _OPEN_PATHS:
            return await call_next(request)
        if request.headers.get("authorization") != expected:
            return APIError(
                401,
                "Incorrect API key provided; send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            ).response()
        return await call_next(request)

    return check


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    # Starlette's headers (a 405's Allow, ...) go out with the error.
    return APIError(error.status_code, str(error.detail), type=kind, headers=error.headers).response()


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return server_error(500, f"Internal server error: {type(error).__name__}").response()
