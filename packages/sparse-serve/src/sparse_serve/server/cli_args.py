"""``sparse-serve serve``'s HTTP-side flags (the engine's come from ``cli.add_engine_flags``)."""

from __future__ import annotations

import argparse
import os

from sparse_serve.server.app import ServerConfig


def _list(value: str) -> list[str]:
    """``a,b`` or a JSON list ``["a", "b"]`` (vLLM's form for the CORS flags)."""
    import json

    value = value.strip()
    if value.startswith("["):
        return [str(v) for v in json.loads(value)]
    return [v.strip() for v in value.split(",") if v.strip()]


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="model names clients may send; the first is listed first (default: the model folder's name)",
    )
    parser.add_argument(
        "--max-waiting-requests", type=int, default=1024, help="requests queued beyond the running batch; more get 503"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPARSE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize (env SPARSE_API_KEY)",
    )
    parser.add_argument("--allowed-origins", type=_list, default=[], help="CORS origins ('*' for any; default none)")
    parser.add_argument("--allowed-methods", type=_list, default=["*"], help="CORS methods")
    parser.add_argument("--allowed-headers", type=_list, default=["*"], help="CORS headers")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--chat-template", help="jinja chat template, or a file holding one (default: the tokenizer's)")
    parser.add_argument(
        "--engine-in-server-process",
        action="store_true",
        help="run the engine on a thread of the server process instead of a process of its own",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=tuple(args.served_model_name or ()),
        max_waiting_requests=args.max_waiting_requests,
        api_key=args.api_key,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        chat_template=args.chat_template,
        engine_process=not args.engine_in_server_process,
    )
