"""The bearer token on the HTTP front (rules in `auth.py`): 401 in the OpenAI error shape."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from beamsplit.server.auth import is_authorized
from beamsplit.server.openai_response import error_body


class BearerTokenMiddleware:
    """ASGI middleware of the HTTP front: 401 in the OpenAI error shape without the token.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would stand between the routes
    and the client's disconnect that cancels the backend call."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {name.decode("latin-1").lower(): value for name, value in scope.get("headers", [])}
            value = headers.get("authorization")
            if not is_authorized(None if value is None else value.decode("latin-1"), self._token):
                body = error_body(
                    "missing or wrong API key (send 'Authorization: Bearer <token>')",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)
