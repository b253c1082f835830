"""CORS: which browser pages may call the API (`--allowed-origins`).

A page on another origin first sends a preflight (`OPTIONS` with `Origin` and
`Access-Control-Request-Method`), without its API key; an allowed origin gets a 204
that names the methods and headers it may use, before the API-key check. Every answer
to an allowed origin (streams included, since the headers go on at prepare time) then
carries `Access-Control-Allow-Origin` and exposes `x-request-id`, `retry-after` and
`x-ferry-ignored-fields`. Nothing is added for other origins, and with no `--allowed-origins` nothing at
all, so browsers refuse cross-origin calls as they do by default. No cookies are involved (keys travel in
`Authorization`), so credentials are never allowed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id"
EXPOSED_HEADERS = "x-request-id, retry-after, x-ferry-ignored-fields"
PREFLIGHT_MAX_AGE_S = 600


class CorsPolicy:
    def __init__(self, allowed_origins: Sequence[str]) -> None:
        self._origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)  # browsers send lower case
        self._any = "*" in self._origins

    def allowed_origin(self, request: web.Request) -> str | None:
        """The value for Access-Control-Allow-Origin, or None when this request gets no CORS headers."""
        origin = request.headers.get("Origin")
        if origin is None or not (self._any or origin.lower() in self._origins):
            return None
        return "*" if self._any else origin

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = self.allowed_origin(request)
        if (request.method == "OPTIONS" and origin is not None
                and "Access-Control-Request-Method" in request.headers):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    DEFAULT_ALLOWED_HEADERS),
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self.allowed_origin(request)
        if origin is None:
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        if origin != "*":
            response.headers["Vary"] = "Origin"
