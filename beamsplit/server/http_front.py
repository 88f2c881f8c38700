"""The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, and
what tools look for beside them on the same port: `/health`, `/tokenize`, `/detokenize`, `/metrics`.

A thin adapter over the same backend the gRPC servicer calls (`CoordinatorService` or
`AggregatedService`): the JSON becomes a `GenerateRequest` (`openai_wire`), the backend validates
and runs it exactly as for a gRPC client, and its responses become OpenAI JSON
(`openai_response`). The backend's generator blocks, so each request runs it on a thread of its
own (`BackendCall`) while uvicorn's event loop, on one more thread beside the gRPC server, awaits
the responses. A client that disconnects fires the backend's `on_client_gone` callbacks, which
stop upstream work at once (no KV left held). Calls pass the gRPC server's `ShutdownGate`, so
SIGTERM drains HTTP requests with the gRPC ones.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from beamsplit.server.backend_call import BackendCall
from beamsplit.server.client_api_servicer import GenerateBackend
from beamsplit.server.http_auth import BearerTokenMiddleware
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.openai_response import (
    HTTP_STATUS,
    INTERNAL_ERROR,
    LogprobStream,
    ResponseWriter,
    TextStream,
    error_body,
    final_choices,
)
from beamsplit.server.openai_wire import (
    CompletionRequest,
    OpenAIRequestError,
    openai_param,
    parse_chat_request,
    parse_completion_request,
)
from beamsplit.server.server_common import ShutdownGate
from beamsplit.server.tls import TlsConfig
from beamsplit.server.tokenize_api import detokenize, tokenize
from beamsplit.v1 import common_pb2
from beamsplit.wire import ServiceError
from engine.tokenizer import Tokenizer

MAX_IN_FLIGHT = 256  # requests (each a thread) at once; more get 429 at once
DEFAULT_MAX_BODY_MB = 4.0  # a 128k-token prompt as JSON token ids is about 1 MB


class BodyTooLargeError(Exception):
    """The request body is over the front's limit: 413, before any of it is parsed."""


class OpenAIFront:
    """The routes, over one backend and the tokenizer the backend validates with."""

    def __init__(
        self,
        backend: GenerateBackend,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        gate: ShutdownGate,
        metrics: ServerMetrics,
        role: str,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_body_mb: float = DEFAULT_MAX_BODY_MB,
        unready_reason: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`unready_reason`: why the backend cannot serve now (the coordinator: no healthy worker of
        a kind), None when it can; `/health` answers 503 with it."""
        self._backend = backend
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._gate = gate
        self._metrics = metrics
        self._role = role
        self._created = int(time.time())
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._max_body_bytes = int(max_body_mb * 1024 * 1024)
        self._unready_reason = unready_reason

    def build_app(self) -> FastAPI:
        app = FastAPI(title="beamsplit", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_exception_handler(OpenAIRequestError, _request_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(BodyTooLargeError, _body_too_large_response)  # type: ignore[arg-type]
        app.add_exception_handler(RequestValidationError, _framework_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, _http_error_response)  # type: ignore[arg-type]
        return app

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self._model_name:
            message = f"model {model_id!r} is not served here; this server serves {self._model_name!r}"
            return JSONResponse(
                error_body(message, "not_found_error", "model", "model_not_found"), status_code=404
            )
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self._model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "beamsplit",
            "max_model_len": self._max_model_len,
        }

    async def health(self) -> JSONResponse:
        """200 while serving; 503 once draining (SIGTERM) or while the backend cannot serve."""
        reason = "draining: shutting down" if self._gate.is_draining else self._unready_reason()
        if reason is not None:
            return JSONResponse(
                {"status": "unavailable", "reason": f"{self._role}: {reason}"}, status_code=503
            )
        return JSONResponse({"status": "serving"})

    async def metrics(self) -> Response:
        """The same registry the metrics port serves, so a tool given only this port finds it."""
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await _json_body(request, self._max_body_bytes)
        return JSONResponse(tokenize(body, self._tokenizer, self._model_name, self._max_model_len))

    async def detokenize(self, request: Request) -> JSONResponse:
        body = await _json_body(request, self._max_body_bytes)
        return JSONResponse(detokenize(body, self._tokenizer, self._model_name))

    async def completions(self, request: Request) -> Response:
        parsed = parse_completion_request(await _json_body(request, self._max_body_bytes), self._model_name)
        return await self._serve(request, parsed, is_chat=False)

    async def chat_completions(self, request: Request) -> Response:
        parsed = parse_chat_request(
            await _json_body(request, self._max_body_bytes), self._model_name, self._tokenizer
        )
        return await self._serve(request, parsed, is_chat=True)

    async def _serve(self, request: Request, parsed: CompletionRequest, is_chat: bool) -> Response:
        # One backend call per prompt (a batch of prompts runs side by side), choices in prompt order.
        calls = [
            BackendCall(self._backend, prompt, self._gate, self._metrics, self._role, self._slots)
            for prompt in parsed.all_requests
        ]
        for started in calls:
            started.start()
        call = calls[0]  # a streamed request has one prompt
        prefix = "chatcmpl" if is_chat else "cmpl"
        writer = ResponseWriter(
            parsed,
            self._model_name,
            is_chat,
            f"{prefix}-{uuid.uuid4().hex}",
            int(time.time()),
            self._tokenizer,
        )
        try:
            first = await call.next(request)  # validation and admission errors keep their status
            if not parsed.is_stream:
                finals = [await self._final(call, request, first)]
                for other in calls[1:]:
                    finals.append(await self._final(other, request, await other.next(request)))
                return JSONResponse(writer.response(finals))
        except ServiceError as error:
            for started in calls:
                started.cancel()
            return _service_error_response(error, parsed)
        except BaseException:  # this task cancelled (uvicorn's shutdown timeout): stop the backend too
            for started in calls:
                started.cancel()
            raise
        return StreamingResponse(
            self._events(call, first, parsed, writer, is_chat), media_type="text/event-stream"
        )

    async def _final(
        self, call: BackendCall, request: Request, response: common_pb2.GenerateResponse | None
    ) -> common_pb2.FinalResult:
        """Reads one call to its final result (deltas skipped)."""
        while response is not None and not response.HasField("final"):
            response = await call.next(request)
        if response is None:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"{self._role}: the request ended without a result")
        return response.final

    async def _events(
        self,
        call: BackendCall,
        first: common_pb2.GenerateResponse | None,
        parsed: CompletionRequest,
        writer: ResponseWriter,
        is_chat: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events; a disconnect cancels this generator, and `finally` stops the backend.

        With logprobs, a one-sequence stream sends each delta's records with the text released
        with it (text held back for a stop string or a split character may be empty): every
        token's record arrives once, in order, the last ones with the final chunk."""
        text_stream = TextStream(self._tokenizer, parsed.stop)
        records = LogprobStream(writer)
        try:
            if is_chat:
                yield _event(writer.chunk(0, "", None))
            response = first
            while response is not None:
                delta = response.delta if response.HasField("delta") else None
                if delta is not None and delta.beams and not parsed.is_beam_search:
                    text = text_stream.add(list(delta.beams[0].token_ids))
                    logprobs = records.add(delta.logprobs)
                    if text or logprobs is not None:
                        yield _event(writer.chunk(0, text, None, logprobs=logprobs))
                if response.HasField("final"):
                    choices = final_choices(response.final, parsed, self._tokenizer, is_chat=is_chat)
                    for index, choice in enumerate(choices):
                        text, logprobs = choice.text, choice.logprobs
                        if not parsed.is_beam_search:
                            text = text_stream.finish(choice.text)
                            logprobs = records.finish(response.final.beams[0].logprobs, parsed)
                        yield _event(
                            writer.chunk(index, text, choice.finish_reason, choice.extension(), logprobs)
                        )
                    if parsed.include_usage:
                        yield _event(writer.usage_chunk(response.final))
                    yield "data: [DONE]\n\n"
                    return
                response = await call.next()
            raise ServiceError(grpc.StatusCode.INTERNAL, f"{self._role}: the request ended without a result")
        except ServiceError as error:
            _, error_type = HTTP_STATUS.get(error.code, INTERNAL_ERROR)
            yield _event(error_body(error.message, error_type, None, error.code.name.lower()))
        finally:
            call.cancel()


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _json_body(request: Request, max_bytes: int) -> object:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLargeError(f"the request body is {int(declared)} bytes, over this server's {max_bytes}")
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():  # a chunked body has no length up front: count as it comes
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise BodyTooLargeError(f"the request body is over this server's {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OpenAIRequestError(None, f"the request body is not valid JSON: {error}") from None


def _service_error_response(error: ServiceError, parsed: CompletionRequest) -> JSONResponse:
    status, error_type = HTTP_STATUS.get(error.code, INTERNAL_ERROR)
    param = openai_param(error.message, parsed) if error.code == grpc.StatusCode.INVALID_ARGUMENT else None
    message = error.message
    if param is not None and not message.startswith(param):
        message = f"{param}: {message}"
    code = None if status == 400 else error.code.name.lower()
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


async def _request_error_response(request: Request, error: OpenAIRequestError) -> JSONResponse:
    return JSONResponse(
        error_body(error.message, "invalid_request_error", error.param, None), status_code=400
    )


async def _body_too_large_response(request: Request, error: BodyTooLargeError) -> JSONResponse:
    return JSONResponse(error_body(str(error), "invalid_request_error", None, None), status_code=413)


async def _framework_error_response(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's own validation (422 by default) answers 400 like every other bad field."""
    errors = error.errors()
    location = [str(part) for part in (errors[0].get("loc", ()) if errors else ()) if part != "body"]
    param = ".".join(location) or None
    message = f"{param or 'request'}: {errors[0].get('msg', 'invalid') if errors else 'invalid'}"
    return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)


async def _http_error_response(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Unknown route (404), wrong method (405): the OpenAI error shape too."""
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(
        error_body(message, "invalid_request_error", None, None),
        status_code=error.status_code,
        headers=error.headers,
    )


class HttpServer:
    """uvicorn on a thread beside the gRPC server; `stop` ends it within a bound."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: TlsConfig | None = None) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
            **(tls.uvicorn_options() if tls is not None else {}),
        )
        self._server = uvicorn.Server(config)
        self._socket = config.bind_socket()
        self.port = int(self._socket.getsockname()[1])
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="http-front", daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP front did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)


def start_http_front(
    front: OpenAIFront, host: str, port: int, tls: TlsConfig | None = None, auth_token: str | None = None
) -> HttpServer | None:
    """Port 0: no HTTP front (the flag's default). HTTPS with `tls`'s certificate; with `auth_token`
    every route answers 401 without it (docs/security.md)."""
    if not port:
        return None
    app = front.build_app()
    if auth_token:
        app.add_middleware(BearerTokenMiddleware, token=auth_token)
    server = HttpServer(app, host, port, tls)
    server.start()
    return server
