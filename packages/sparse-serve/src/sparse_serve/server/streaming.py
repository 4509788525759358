"""Delivering a request's outputs over HTTP: server-sent events, or the final outputs.

A request may have several choices (prompts x n), each a request in the engine with its own
``RequestStream``; ``merged`` interleaves their updates as they come. Either way every choice is
aborted in the engine (freeing its KV blocks) as soon as the client disconnects: a stream's response
closes them however it ends, and a non-streamed request races its final outputs against the
client's disconnect message.

A choice that fails on its own (``finish_reason == "error"``) fails the whole request: a 500 for a
non-streamed one, an error event before ``[DONE]`` in a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from sparse_serve.outputs import RequestOutput
from sparse_serve.server.async_engine import EngineUnavailableError, RequestStream
from sparse_serve.server.errors import APIError, server_error
from sparse_serve.server.responses import DONE_EVENT, CompletionReply, sse_event, usage


def request_failed(out: RequestOutput) -> APIError:
    return server_error(500, f"The request failed in the engine: {out.error}", code="request_failed")


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(choice index, update)`` of every stream, in the order the engine produced them."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as e:  # handed to the reader, which re-raises it
            await queue.put((index, e))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(streams: Sequence[RequestStream], request: Request) -> list[RequestOutput] | None:
    """Each choice's last output, or None if the client disconnected first."""

    async def last() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, out in merged(streams):
            finals[index] = out
        return finals

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


async def sse_events(
    streams: Sequence[RequestStream],
    reply: CompletionReply,
    include_usage: bool,
    continuous_usage: bool = False,
    num_prompts: int = 1,
):
    for chunk in reply.opening_chunks(len(streams)):
        yield sse_event(chunk)
    latest: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for index, out in merged(streams):
            first = latest[index] is None
            latest[index] = out
            if out.finish_reason == "error":
                yield sse_event(request_failed(out).body())
                break
            running = usage([out]) if continuous_usage else None  # this choice's so far
            yield sse_event(reply.chunk(index, out, first, running))
        else:
            if include_usage and all(o is not None for o in latest):
                yield sse_event(reply.usage_chunk(latest, num_prompts))
    except EngineUnavailableError as e:
        yield sse_event(server_error(503, str(e), code="engine_unavailable").body())
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
