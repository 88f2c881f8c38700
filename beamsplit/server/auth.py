"""The bearer token of the client API (coordinator and aggregated server), both wire formats.

A server given a token (`--auth-token-file FILE`, else the `BEAMSPLIT_AUTH_TOKEN` environment
variable: `beamsplit.cli.security_args`) refuses every call that does not carry
`authorization: Bearer <token>`: gRPC answers UNAUTHENTICATED, HTTP answers 401 with an OpenAI
error body (`code: "invalid_api_key"`, so the openai client raises AuthenticationError). The gRPC health service stays open: probes and load
balancers carry no token. Without a token nothing is checked. Tokens are compared in constant time.
Clients (grpc_client, `generate`/`status --target`) read the same file flag or variable and send it;
the openai client sends its `api_key` in that header already. The HTTP side is `http_auth.py`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token (send 'authorization: Bearer <token>')"


def is_authorized(header_value: str | None, token: str) -> bool:
    if header_value is None:
        return False
    scheme, _, presented = header_value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token with UNAUTHENTICATED, before the servicer runs."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = str(handler_call_details.method)  # type: ignore[attr-defined]
        if method.startswith(OPEN_GRPC_PREFIXES):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        if is_authorized(metadata.get("authorization"), self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED as usual

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
