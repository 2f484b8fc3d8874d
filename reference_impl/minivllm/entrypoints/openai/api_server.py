"""The OpenAI-compatible HTTP server (vLLM's `vllm/entrypoints/openai/api_server.py`).

    python -m minivllm.entrypoints.openai.api_server --model DIR   # or: minivllm serve DIR

FastAPI routes each call to its `OpenAIServing*` object, which hands the
request to the one engine client and streams its outputs back; uvicorn
serves the app. Routes: POST /v1/completions, /v1/chat/completions,
/tokenize, /detokenize; GET /v1/models, /health, /metrics, /version.

The engine client (`EngineClient`, engine/protocol.py) is the classic
`AsyncLLMEngine`, or with --use-v1 (or MINIVLLM_USE_V1=1) V1's `AsyncLLM`,
whose engine core runs in a process of its own (`build_async_engine_client`,
as vLLM's). The serving code is the same for both; so is /metrics, whose
`PrometheusStatLogger` each engine feeds after every step. Unless
--disable-log-stats, a task also calls the engine's `do_log_stats` every
10 s while the server runs (vLLM's), so the gauges and the throughput line
move when no step runs.

Every error is OpenAI's JSON body {"error": {"message", "type", "param",
"code"}}: 400 for a request that is malformed or out of range (naming the
field), 401 without the API key (on /v1 routes, as vLLM), 404 for an
unknown route or model, 500 if the engine failed while running the request,
503 once it is dead. A refused request never reaches the engine's queues,
so it cannot disturb the others. Browser pages on other origins may call it
(CORS: every origin by default, as vLLM's; --allowed-origins and friends).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import minivllm
from minivllm import envs
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine
from minivllm.engine.metrics import PrometheusStatLogger
from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.openai.cli_args import make_arg_parser
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import OpenAIError, ServedModel
from minivllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

# Seconds uvicorn waits, on SIGINT/SIGTERM, for responses still streaming.
TIMEOUT_GRACEFUL_SHUTDOWN = 5
# Seconds between forced stats logs while the server runs (vLLM's 10 s).
FORCE_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class CorsOptions:
    """Which browser pages on other origins may call the server, as the
    `Access-Control-*` answers of FastAPI's CORS middleware give it (vLLM's
    --allowed-origins, --allow-credentials, --allowed-methods,
    --allowed-headers; by default every origin, method and header)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> CorsOptions:
        return cls(tuple(args.allowed_origins), args.allow_credentials,
                   tuple(args.allowed_methods), tuple(args.allowed_headers))


def build_app(
    served: ServedModel,
    api_key: str | None = None,
    cors: CorsOptions = CorsOptions(),
    log_stats: bool = False,
    request_id_headers: bool = False,
) -> FastAPI:
    """The app for one served model; `api_key` guards the /v1 routes;
    `log_stats`: force a stats log every `FORCE_LOG_INTERVAL_S` while it
    runs (see `_force_log`); `request_id_headers`: see XRequestIdMiddleware."""
    engine = served.engine
    completion = OpenAIServingCompletion(served)
    chat = OpenAIServingChat(served)
    tokenization = OpenAIServingTokenization(served)
    prometheus = PrometheusStatLogger(labels={"model_name": served.served_model_names[0]})
    engine.add_logger("prometheus", prometheus)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.do_log_stats()  # every gauge shows from the start
        force_log = asyncio.create_task(_force_log(engine), name="force_log") if log_stats else None
        try:
            yield
        finally:
            if force_log is not None:  # gone before the engine, whatever happened
                force_log.cancel()
                await asyncio.gather(force_log, return_exceptions=True)
        engine.shutdown()

    app = FastAPI(title="minivllm OpenAI-compatible server", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine can serve, 503 once its loop (classic) or its
        engine core (V1) has stopped."""
        if engine.is_stopped:
            cause = engine.dead_error
            reason = f"{type(cause).__name__}: {cause}" if cause else "it was shut down"
            message = f"The engine's loop has stopped: {reason}"
            return _error(OpenAIError(message, HTTPStatus.SERVICE_UNAVAILABLE))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": minivllm.__version__}

    @app.get("/v1/models")
    async def show_available_models() -> dict:
        return completion.show_available_models().model_dump()

    @app.post("/tokenize")
    async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        return tokenization.create_tokenize(request).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return tokenization.create_detokenize(request).model_dump()

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    _add_error_handlers(app)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.allowed_origins,
        allow_credentials=cors.allow_credentials,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
    )
    if api_key:  # added late, so it runs early; it lets preflights (OPTIONS) through
        _require_api_key(app, api_key)
    if request_id_headers:  # outermost: refused requests get their id too
        app.add_middleware(XRequestIdMiddleware)
    return app


class XRequestIdMiddleware:
    """--enable-request-id-headers (vLLM's): every HTTP response carries an
    `X-Request-Id` header, the one the request sent or a new random id, so a
    client or a proxy can match answers to requests in its logs. A plain
    ASGI middleware, as vLLM's: it only adds a header to the response's
    start, and leaves streams and disconnects alone."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("X-Request-Id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _force_log(engine: EngineClient) -> None:
    """vLLM's server task: `do_log_stats` every few seconds, so that the
    throughput line and the gauges also move when no step runs (an idle
    server would otherwise keep showing its last busy step)."""
    while True:
        await asyncio.sleep(FORCE_LOG_INTERVAL_S)
        await engine.do_log_stats()


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped. An error message may
    quote what the client sent, a lone surrogate ("\\ud800") included, which
    a JSON string can carry but UTF-8, Starlette's encoding, cannot: the
    error response itself would fail (a 500 and a dropped connection)."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error(error: OpenAIError) -> JSONResponse:
    return _AsciiJSONResponse(error.to_response().model_dump(), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        """pydantic's refusal as a 400 naming the field ('body' dropped)."""
        errors = exc.errors()
        params, lines = [], []
        for err in errors[:3]:
            path = _field_path(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "json_invalid":  # no field to name: loc holds a character position
                reason = err.get("ctx", {}).get("error", msg)
                path, msg = [], f"the body is not JSON: {reason} at character {err['loc'][-1]}"
            elif not path and err["type"] == "value_error":
                # A check of the whole request: its message starts with the field.
                first = msg.split()[0] if msg else ""
                path = [first] if first.isidentifier() else []
            params.append(path[0] if path else None)
            lines.append(f"{'.'.join(path)}: {msg}" if path else msg)
        message = "; ".join(lines) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")
        return _error(OpenAIError(message, param=params[0] if params else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404 for an unknown route, 405 for a wrong method, in OpenAI's shape."""
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return _error(OpenAIError(message, HTTPStatus(exc.status_code)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error in a request")
        return _error(OpenAIError(f"{type(exc).__name__}: {exc}", HTTPStatus(500)))


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location as the request's field path: without
    FastAPI's "body", and without the names pydantic gives the members of a
    union ("str", "list[int]", "TokenizeChatRequest")."""
    return [
        str(part)
        for part in loc
        if part != "body"
        and not (
            isinstance(part, str) and (part[:1].isupper() or "[" in part or part in _TYPE_TAGS)
        )
    ]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """/v1 routes need `Authorization: Bearer KEY` (vLLM guards those only;
    /health and /metrics stay open to probes and scrapers)."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authentication(request: Request, call_next):
        if request.method == "OPTIONS" or not request.url.path.startswith("/v1"):
            return await call_next(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _error(
                OpenAIError(
                    "Missing or wrong API key: send 'Authorization: Bearer KEY'.",
                    HTTPStatus.UNAUTHORIZED,
                    code="invalid_api_key",
                )
            )
        return await call_next(request)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the template given inline."""
    if value is None or os.path.isfile(value):
        return value if value is None else open(value).read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def served_model_names(args: argparse.Namespace, model_path: str) -> list[str]:
    """--served-model-name, else --model as given (vLLM's rule), else the
    shipped model's directory name."""
    return args.served_model_name or [args.model or os.path.basename(model_path)]


def init_app(engine: EngineClient, args: argparse.Namespace) -> FastAPI:
    model_path = engine.get_model_config().model
    served = ServedModel(
        engine=engine,
        served_model_names=served_model_names(args, model_path),
        root=model_path,
        chat_template=load_chat_template(args.chat_template),
        response_role=args.response_role,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    return build_app(served, api_key=args.api_key or envs.MINIVLLM_API_KEY,
                     cors=CorsOptions.from_cli_args(args), log_stats=not args.disable_log_stats,
                     request_id_headers=args.enable_request_id_headers)


@asynccontextmanager
async def build_async_engine_client(args: argparse.Namespace) -> AsyncIterator[EngineClient]:
    """The engine client the options ask for (vLLM's function of the same
    name): V1's `AsyncLLM` with --use-v1 or MINIVLLM_USE_V1=1, else the
    classic `AsyncLLMEngine`. It is shut down on the way out, whatever
    happened, so no engine core process outlives the server."""
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if engine_args.resolve_use_v1():
        from minivllm.v1.engine.async_llm import AsyncLLM

        engine: EngineClient = AsyncLLM.from_engine_args(engine_args)
    else:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        yield engine
    finally:
        engine.shutdown()


async def run_server(args: argparse.Namespace, **uvicorn_kwargs) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM (uvicorn's handlers:
    stop accepting, let responses finish for a few seconds, shut down)."""
    async with build_async_engine_client(args) as engine:
        await _serve(engine, args, **uvicorn_kwargs)


async def _serve(engine: EngineClient, args: argparse.Namespace, **uvicorn_kwargs) -> None:
    app = init_app(engine, args)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=TIMEOUT_GRACEFUL_SHUTDOWN,
        **uvicorn_kwargs,
    )
    names = served_model_names(args, engine.get_model_config().model)
    logger.info(
        "minivllm %s serves %s on http://%s:%d (%s)",
        minivllm.__version__,
        ", ".join(names),
        args.host,
        args.port,
        type(engine).__name__,
    )
    await uvicorn.Server(config).serve()


def serve(args: argparse.Namespace) -> None:
    """Run the server in this process (the `minivllm serve` command too)."""
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(run_server(args))
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has shut down
        pass
    except (ValueError, FileNotFoundError) as e:  # a bad option or model: say which
        raise SystemExit(f"error: {e}") from e


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="minivllm's OpenAI-compatible API server")
    serve(make_arg_parser(parser).parse_args(argv))


if __name__ == "__main__":
    main()
