"""OpenAI-compatible HTTP serving: ``sparse-serve serve`` or ``run_server(EngineConfig(...), ServerConfig())``."""

from sparse_serve.server.app import ServerConfig, build_app, run_server

__all__ = ["ServerConfig", "build_app", "run_server"]
