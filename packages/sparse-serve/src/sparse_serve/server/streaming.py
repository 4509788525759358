"""Delivering a request's outputs over HTTP: server-sent events, or one final output.

Either way the request is aborted in the engine (freeing its KV blocks) as soon as the client
disconnects: a stream's response closes it however it ends, and a non-streamed request races
its final output against the client's disconnect message.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import StreamingResponse

from sparse_serve.outputs import RequestOutput
from sparse_serve.server.async_engine import EngineUnavailableError, RequestStream
from sparse_serve.server.errors import server_error
from sparse_serve.server.responses import DONE_EVENT, CompletionReply, sse_event


async def final_output(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The request's last output, or None if the client disconnected first."""

    async def last() -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        return final

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, gone = asyncio.ensure_future(last()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        result.cancel()
    return result.result() if result.done() and not result.cancelled() else None


async def sse_events(stream: RequestStream, reply: CompletionReply, include_usage: bool):
    for chunk in reply.opening_chunks():
        yield sse_event(chunk)
    last = None
    try:
        async for out in stream:
            last = out
            yield sse_event(reply.chunk(out))
    except EngineUnavailableError as e:
        yield sse_event(server_error(503, str(e), code="engine_unavailable").body())
    else:
        if include_usage and last is not None:
            yield sse_event(reply.usage_chunk(last))
    yield DONE_EVENT


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose request is aborted however the response ends (done, error, disconnect)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
