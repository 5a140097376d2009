"""Who may call the API: an API key on /v1/* (`ApiKeyGuard`) and, when asked, CORS for browser origins.

The key is compared in constant time (`hmac.compare_digest` over SHA-256 digests, so neither the content nor the
length of a wrong key shows in the timing) and is never logged or echoed. /health and /metrics stay open:
probes and scrapers carry no key (bind the port to a private network when the metrics are not for everyone).
"""

from __future__ import annotations

import hashlib
import hmac
import json

from fastapi import FastAPI

from refusion.serve.schemas import error_body

PROTECTED_PREFIX = "/v1/"
"""Paths that need the key (the OpenAI API); everything else (health, metrics, the OpenAPI document) is open."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyGuard:
    """ASGI middleware: a request to /v1/* without `Authorization: Bearer <key>` is answered 401 (OpenAI's body,
    code "invalid_api_key") before it reaches a route. A pure ASGI wrapper, so streams and disconnects pass
    through untouched."""

    def __init__(self, app, api_key: str):
        self.app, self._expected = app, _digest(api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX) or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        if self.allows(_bearer(scope)):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body("invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                                     type="invalid_request_error", code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def allows(self, presented: str | None) -> bool:
        """Whether `presented` is the key (constant time; a missing key is compared too, as an empty one)."""
        return hmac.compare_digest(_digest(presented or ""), self._expected) and presented is not None


def _bearer(scope) -> str | None:
    """The token of the request's `Authorization: Bearer ...` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def add_access(app: FastAPI, *, api_key: str | None, cors_origins: tuple[str, ...]) -> None:
    """Guard /v1/* with `api_key` (None: open) and allow `cors_origins` (empty: no CORS headers at all). CORS is
    the outer layer, so that a browser's preflight (OPTIONS, which carries no key) is answered."""
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
