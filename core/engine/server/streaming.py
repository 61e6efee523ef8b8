"""Server-sent events: ``data: {json}`` chunks, ``data: [DONE]`` at the end, and an abort of the
request's work whenever the response ends early (the client went away, the server stops)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends.

    Starlette cancels the body iterator when the client disconnects, but a disconnect noticed
    while a chunk is being sent only surfaces in ``send``; wrapping the whole response is the one
    place that sees every ending.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come (one prompt's deltas each)."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(it):
        try:
            async for item in it:
                await queue.put(item)
        finally:
            await queue.put(end)

    tasks = [asyncio.ensure_future(pump(it)) for it in iterators]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            else:
                yield item
        for t in tasks:
            t.result()  # re-raise what a pump raised
    finally:
        for t in tasks:
            t.cancel()


def all_deltas(handles: list) -> AsyncIterator:
    """``(i, delta)`` for the deltas of every handle (``i`` its position), as they come."""

    async def tagged(i, handle):
        async for delta in handle.deltas():
            yield i, delta

    return merge([tagged(i, h) for i, h in enumerate(handles) if h.reqs])
