"""API keys (`--api-key`): every path but the open ones needs `Authorization: Bearer <key>`
with one of the keys, compared in constant time; anything else is a 401 `invalid_api_key`
(raised here, answered by the error middleware, http_errors.py)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from aiohttp import web

from services.common.errors import Unauthenticated
from services.frontend.cors import Handler

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


class ApiKeyError(Unauthenticated):
    code = "invalid_api_key"
    param = None


class ApiKeyPolicy:
    def __init__(self, api_keys: Sequence[str]) -> None:
        self._api_keys = tuple(api_keys)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._api_keys and request.path not in OPEN_PATHS and not self._is_authorized(request):
            raise ApiKeyError("missing or incorrect API key; send it as 'Authorization: Bearer <key>' "
                              "(keys are set with --api-key)")
        return await handler(request)

    def _is_authorized(self, request: web.Request) -> bool:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        key_bytes = key.strip().encode(errors="surrogateescape")  # the header's bytes, UTF-8 or not
        return any(hmac.compare_digest(key_bytes, allowed.encode()) for allowed in self._api_keys)
