"""The FastAPI app: each API dialect's routes over one generation worker.

The app picks the worker (one at a time, batched, sharded), and serves health and the
model list; a dialect's routes (openai/, anthropic/, responses/, ollama/, llamacpp/)
validate a request, turn it into a `Generation`, and relay its answer's parts through
`Answering` (answering.py), which cancels a generation whose client went away.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

import mlxspec
from mlxspec.processes import stop_signals
from mlxspec.server.anthropic.routes import anthropic_router
from mlxspec.server.anthropic.translate import error_body
from mlxspec.server.batch_worker import BatchedWorker
from mlxspec.server.errors import ApiError, install_error_handlers, shape_finder
from mlxspec.server.limits import ServerLimits
from mlxspec.server.llamacpp import llamacpp_router
from mlxspec.server.lone_surrogates import SurrogateRepair
from mlxspec.server.ollama.replies import error_body as ollama_error
from mlxspec.server.ollama.routes import ollama_router
from mlxspec.server.openai.routes import openai_router
from mlxspec.server.origin_guard import OriginGuard
from mlxspec.server.providers import ModelInfo, ModelProvider, find_model
from mlxspec.server.responses.routes import responses_router
from mlxspec.server.responses.store import ResponseStore
from mlxspec.server.worker import Worker

if TYPE_CHECKING:
    from mlxspec.distributed.rank import RankSession


class BodyLimit:
    """ASGI middleware: refuse a body over `max_bytes` (413) while it is still arriving."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise ApiError(413, f"the body is over {self.max_bytes} bytes", code="too_large")
            return message

        return await self.app(scope, limited_receive, send)


DEFAULT_LIMITS = ServerLimits()

# Module level: FastAPI resolves annotations here.
BEARER = HTTPBearer(auto_error=False)  # OpenAI's clients
X_API_KEY = APIKeyHeader(name="x-api-key", auto_error=False)  # Anthropic's


def key_check(api_key: str):
    """A dependency that lets a request in when either header carries the key."""

    async def check(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
        x_api_key: Annotated[str | None, Depends(X_API_KEY)],
    ) -> None:
        given = [credentials.credentials if credentials else "", x_api_key or ""]
        if not any(secrets.compare_digest(key.encode(), api_key.encode()) for key in given):
            raise ApiError(
                401,
                "missing or wrong API key; send the header 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def create_app(
    provider: ModelProvider,
    *,
    api_key: str | None = None,
    limits: ServerLimits = DEFAULT_LIMITS,
    preload: str | None = None,
    ranks: RankSession | None = None,
    allowed_hosts: Sequence[str] = (),
    cors_origins: Sequence[str] = (),
) -> FastAPI:
    """An app serving `provider`'s models; `preload` loads one before the first request.
    `ranks`: this is rank 0 of a sharded target (the other ranks follow its requests).
    `allowed_hosts`, `cors_origins`: names and web origins served besides the server's own
    address (origin_guard.py)."""
    if ranks is not None:
        from mlxspec.server.sharded import ShardedBatchedWorker, ShardedWorker

        preload = preload or provider.default
        if limits.max_batch > 1:
            worker = ShardedBatchedWorker(
                provider,
                limits.max_waiting,
                ranks,
                preload,
                limits.max_batch,
                limits.row_floor,
                limits.kv_memory,
            )
        else:
            worker = ShardedWorker(provider, limits.max_waiting, ranks, preload)
    elif limits.max_batch > 1:
        worker = BatchedWorker(
            provider,
            limits.max_waiting,
            limits.max_batch,
            preload,
            limits.row_floor,
            limits.kv_memory,
        )
    else:
        worker = Worker(provider, limits.max_waiting, preload)

    worker.max_queue_wait = limits.max_queue_wait

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="mlxspec", version=mlxspec.__version__, lifespan=lifespan)
    app.state.worker = worker
    shape = shape_finder({"/v1/messages": error_body, "/api/": ollama_error})
    install_error_handlers(app, shape)
    app.add_middleware(SurrogateRepair)  # inside the limit: it reads the body whole
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    # Added last, so it runs first: a request the user did not send is refused unread.
    app.add_middleware(
        OriginGuard, allowed_hosts=allowed_hosts, cors_origins=cors_origins, shape=shape
    )
    guarded = [Depends(key_check(api_key))] if api_key else []
    api = APIRouter(prefix="/v1", dependencies=guarded)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "model": worker.resident,
            "busy": worker.busy,
            "active": worker.active,
            "tokens_per_second": round(worker.tokens_per_second, 2),
            "waiting": worker.waiting,
            # what a request queued now would wait (null until the pace is measured)
            "expected_wait_s": _rounded(worker.expected_wait()),
            "max_queue_wait_s": worker.max_queue_wait,
            "kv_memory": getattr(worker, "kv_memory_use", None),
        }

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def ollama_probe() -> PlainTextResponse:
        """Ollama's clients probe the bare address for this text before anything else."""
        return PlainTextResponse("Ollama is running")

    @api.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(info) for info in provider.models.values()]}

    @api.get("/models/{name}")
    async def get_model(name: str) -> dict:
        return _model_card(find_model(provider, name))

    api.include_router(openai_router(provider, worker, limits))
    api.include_router(anthropic_router(provider, worker, limits))
    api.include_router(responses_router(provider, worker, limits, ResponseStore()))
    app.include_router(api)
    # llama.cpp's own paths have no /v1 (llama.vim, llama.vscode, Tabby call /infill)
    app.include_router(llamacpp_router(provider, worker, limits), dependencies=guarded)
    # Ollama's API has no /v1: its clients add /api/... to the bare address (port 11434)
    app.include_router(ollama_router(provider, worker, limits), dependencies=guarded)
    return app


SHUTDOWN_SECONDS = 5.0  # what a running request gets to finish once the server is stopped
CUT_SECONDS = 2.0  # for the requests cut at that point to hear so and their connections to close


def run_server(
    app: FastAPI,
    host: str,
    port: int,
    sock: socket.socket | None = None,
    shutdown_timeout: float = SHUTDOWN_SECONDS,
) -> None:
    """Run `app` with uvicorn until SIGINT, SIGTERM or SIGHUP, then stop cleanly: no new
    connections or requests, queued requests end with a 503 at once, running ones get
    `shutdown_timeout` seconds to finish and then end with a 503 (a final SSE error event
    for a stream), and this returns once the port is free (so the command exits 0). A
    second signal ends the running requests at once. `sock`: a socket already bound to
    host:port (see listen.py), else uvicorn binds one."""
    worker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Not uvicorn's own: it raises the signal again once stopped, so the process
            # would die of it instead of exiting 0.
            if self.should_exit:
                worker.shutdown()
                self.force_exit = True
            else:
                worker.shutdown(shutdown_timeout)
                self.should_exit = True

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=shutdown_timeout + CUT_SECONDS,
    )
    server = Server(config)
    with stop_signals(lambda signum: server.handle_exit(signum, None)):  # uvicorn: no SIGHUP
        server.run(sockets=[sock] if sock is not None else None)
    worker.stop(CUT_SECONDS)  # after a second signal, uvicorn left it running


def _model_card(info: ModelInfo) -> dict:
    return {
        "id": info.name,
        "object": "model",
        "created": 0,
        "owned_by": "mlxspec",
        # What a client sizes itself by (LM Studio's and vLLM's names for it)
        "context_length": info.defaults.context,
        "max_model_len": info.defaults.context,
        "x_mlxspec": {"description": info.description, "proposers": list(info.proposers)},
    }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)
