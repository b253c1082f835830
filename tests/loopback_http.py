"""An aiohttp app served on a free loopback port for the length of a block, as the frontend serves its own
(services/frontend/app.py: a client that leaves cancels its handler, and HTTP aiohttp cannot parse gets an
OpenAI error body)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from services.frontend.bad_http import FrontendRunner


@contextlib.asynccontextmanager
async def served_on_loopback(app: web.Application) -> AsyncIterator[str]:
    """The app's base URL ("http://127.0.0.1:PORT"); it stops serving when the block ends."""
    http = FrontendRunner(app, handler_cancellation=True, access_log=None)
    await http.setup()
    try:
        await web.TCPSite(http, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{http.addresses[0][1]}"
    finally:
        await http.cleanup()
