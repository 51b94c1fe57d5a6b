"""Server-sent events, and noticing that a client went away.

`EventStreamResponse` streams `data: ...` events while watching the connection: when the client
disconnects, the event generator is cancelled at once (not only at the next write, which may be
many seconds away while a long prompt is prefilling) and `on_close` runs, so the request is
aborted and its KV blocks are freed. `on_close` also runs after a normal end and is expected to
be idempotent.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)
T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse_event(payload: Any) -> str:
    """One event; `payload` is a dict or an already serialised JSON string."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    """Await `work` unless the client disconnects first: (True, result) or (False, None).
    On disconnect `work` is cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # also reached when this handler itself is cancelled: take both helpers down with it
        for t in (task, gone):
            t.cancel()
        await asyncio.wait({task, gone})
    if task.cancelled():
        return False, None
    return True, task.result()


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str] | None = None):
        # no-cache / no buffering: proxies must pass each event through as it comes
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._on_close()            # first: frees the engine's resources whatever happens next
            for t in (pump, gone):
                t.cancel()
            await asyncio.wait({pump, gone})
            # runs the generator's own cleanup if cancellation caught it suspended at a yield
            await self.body_iterator.aclose()       # type: ignore[attr-defined]
        if not pump.cancelled() and pump.exception() is not None:
            exc = pump.exception()
            if not isinstance(exc, OSError):        # a vanished client is not an error
                logger.error("event stream failed", exc_info=exc)
