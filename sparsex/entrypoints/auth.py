"""API-key check as plain ASGI middleware.

Plain ASGI (not a FastAPI dependency) so that it runs before the body is read or validated: an
unauthenticated client learns nothing, not even whether its JSON parses. It also leaves streaming
responses and disconnect detection untouched (BaseHTTPMiddleware would wrap both).
"""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sparsex.entrypoints.errors import error_body


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protected: tuple[str, ...] = ("/v1", "/tokenize")):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._protected = protected

    def _authorized(self, scope: Scope) -> bool:
        got = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        return hmac.compare_digest(got, self._expected)      # constant time: no key-guessing by timing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(self._protected)
                and not self._authorized(scope)):
            body = error_body(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)
