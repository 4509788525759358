"""A server on a background thread of this process, for tests and in-process benchmarks."""

from __future__ import annotations

import socket
import threading
import time

from sparse_serve.server.app import ServerConfig, build_app


class BackgroundServer:
    """``with BackgroundServer(engine, config) as server: httpx.get(server.url + "/health")``.

    ``engine``: an ``LLMEngine`` (run on a thread) or an ``EngineProcess``.

    Port 0 (the default here) takes a free port from the OS; the socket is bound before uvicorn
    starts, so there is no race for it. Leaving the block shuts down as Ctrl-C does: open
    requests get ``config.graceful_shutdown_s`` to finish, then the engine thread stops.
    """

    def __init__(self, engine, config: ServerConfig | None = None, start_timeout_s: float = 60.0):
        import uvicorn

        self.config = config or ServerConfig(port=0, access_log=False, log_level="warning")
        self.app = build_app(engine, self.config)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_level=self.config.log_level,
                access_log=self.config.access_log,
                timeout_graceful_shutdown=self.config.graceful_shutdown_s,
            )
        )
        # The engine died: stop serving, as ``run_server`` does (which then exits with status 1).
        self.app.state.fatal_hooks.append(lambda: setattr(self._server, "should_exit", True))
        self._start_timeout_s = start_timeout_s
        self._thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        return self

    @property
    def fatal_error(self) -> str | None:
        """Why the engine died (None while it has not)."""
        return self.app.state.fatal_error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.config.graceful_shutdown_s + 30)
