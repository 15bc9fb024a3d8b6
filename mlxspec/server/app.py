"""The FastAPI app: OpenAI-compatible routes over one generation worker.

Handlers validate a request, turn it into a `Generation`, queue it, and relay the
worker's events: collected into one JSON answer, or as server-sent events. A client
that goes away cancels its generation (see `_cancel_on_disconnect`).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

import mlxspec
from mlxspec.batch.width import ROW_FLOOR
from mlxspec.engine import GenerationError, GenerationSettings
from mlxspec.events import Done
from mlxspec.processes import stop_signals
from mlxspec.sampling import SamplingSettings
from mlxspec.server.batch_worker import BatchedWorker
from mlxspec.server.errors import ApiError, install_error_handlers
from mlxspec.server.providers import ModelInfo, ModelProvider, NotDownloaded
from mlxspec.server.responses import Reply, sse
from mlxspec.server.schemas import ChatRequest, CompletionRequest, GenerationRequest
from mlxspec.server.worker import Generation, Job, Worker

if TYPE_CHECKING:
    from mlxspec.distributed.rank import RankSession


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # per request; longer prompts are bounded by the model's context
    max_waiting: int = 16  # requests queued behind the running one; more get 429
    max_batch: int = 1  # requests generating together (continuous batching when > 1)
    # The least share of its plain speed a request keeps while others' drafts widen the
    # shared pass (mlxspec.batch.width.choose_width).
    row_floor: float = ROW_FLOOR
    # GB of KV a batch may hold (None: a share of the device's memory; 0: no bound).
    kv_memory: float | None = None


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


BEARER = HTTPBearer(auto_error=False)  # module level: FastAPI resolves annotations here


def bearer_check(api_key: str):
    async def check(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
    ) -> None:
        given = credentials.credentials.encode() if credentials else b""
        if not secrets.compare_digest(given, api_key.encode()):
            raise ApiError(
                401,
                "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def create_app(
    provider: ModelProvider,
    *,
    api_key: str | None = None,
    limits: ServerLimits = ServerLimits(),
    preload: str | None = None,
    ranks: RankSession | None = None,
) -> FastAPI:
    """An app serving `provider`'s models; `preload` loads one before the first request.
    `ranks`: this is rank 0 of a sharded target (the other ranks follow its requests)."""
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

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="mlxspec", version=mlxspec.__version__, lifespan=lifespan)
    app.state.worker = worker
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    guarded = [Depends(bearer_check(api_key))] if api_key else []
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
            "kv_memory": getattr(worker, "kv_memory_use", None),
        }

    @api.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(info) for info in provider.models.values()]}

    @api.get("/models/{name}")
    async def get_model(name: str) -> dict:
        return _model_card(_model_info(provider, name))

    @api.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages = [message.for_template() for message in body.messages]
        generation = _generation(body, messages, provider, limits)
        return await _respond(request, worker, generation, body, chat=True)

    @api.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        generation = _generation(body, body.prompt_input(), provider, limits)
        return await _respond(request, worker, generation, body, chat=False)

    app.include_router(api)
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


def _model_info(provider: ModelProvider, name: str | None) -> ModelInfo:
    info = provider.models.get(provider.default if name is None else name)
    if info is None:
        raise ApiError(
            404,
            f"unknown model {name!r}; this server has: {', '.join(provider.models)}",
            code="model_not_found",
            param="model",
        )
    return info


def _model_card(info: ModelInfo) -> dict:
    return {
        "id": info.name,
        "object": "model",
        "created": 0,
        "owned_by": "mlxspec",
        "x_mlxspec": {"description": info.description, "proposers": list(info.proposers)},
    }


def _generation(
    body: GenerationRequest, prompt, provider: ModelProvider, limits: ServerLimits
) -> Generation:
    """Check a request against the model and the limits; fill in the model's defaults."""
    info = _model_info(provider, body.model)
    if body.n not in (None, 1):
        raise ApiError(
            400, f"n: only n=1 is supported, got {body.n}", code="invalid_value", param="n"
        )
    proposer = body.mlxspec.proposer
    if proposer is not None and proposer not in info.proposers:
        raise ApiError(
            400,
            f"unknown proposer {proposer!r} for {info.name}; choose one of: "
            + ", ".join(info.proposers),
            code="invalid_proposer",
            param="mlxspec.proposer",
        )
    try:
        provider.check(info.name, proposer)
    except NotDownloaded as err:
        raise ApiError(404, str(err), code="not_downloaded", param="model") from None
    return Generation(info.name, prompt, _settings(body, info, limits), proposer)


def _settings(body: GenerationRequest, info: ModelInfo, limits: ServerLimits) -> GenerationSettings:
    asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = getattr(body, asked) or min(info.defaults.max_tokens, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise ApiError(
            400,
            f"{asked}: {max_tokens} is over this server's limit of {limits.max_tokens}",
            code="invalid_value",
            param=asked,
        )
    defaults = info.defaults
    try:
        return GenerationSettings(
            max_tokens=max_tokens,
            sampling=SamplingSettings(
                temperature=defaults.temperature if body.temperature is None else body.temperature,
                top_p=defaults.top_p if body.top_p is None else body.top_p,
                top_k=defaults.top_k,
                seed=body.seed,
            ),
            stop=body.stop_strings,
            k=body.mlxspec.k,
            context=defaults.context,
            tree=defaults.tree if body.mlxspec.tree is None else body.mlxspec.tree,
            tree_nodes=defaults.tree_nodes,
            history=defaults.history and body.mlxspec.history is not False,
            logprobs=body.alternatives(),
        )
    except (GenerationError, ValueError) as err:
        raise ApiError(400, str(err), code="invalid_value") from None


async def _respond(
    request: Request, worker: Worker, generation: Generation, body: GenerationRequest, chat: bool
):
    """Queue the generation; answer with JSON, or stream once its first event is in."""
    job = worker.submit(generation)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))

    def release() -> None:
        job.cancel()  # a no-op once the job has ended
        watcher.cancel()

    reply = Reply(chat=chat, model=generation.model)
    try:
        # Errors found before any output (a bad proposer, a prompt too long) get a
        # real HTTP status, even for streams.
        first = _raise_failure(await job.next())
    except BaseException:
        release()
        raise
    if body.stream:
        stream = _sse(job, first, reply, body, release)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    try:
        done = await _until_done(job, first)
    finally:
        release()
    return JSONResponse(reply.complete(done.record, done.text, done.logprobs))


def _cancelled() -> ApiError:
    """A job that ended without an answer: its client left, or the server is stopping."""
    return ApiError(503, "the request was cancelled", code="cancelled", type="server_error")


def _raise_failure(item: object) -> object:
    if isinstance(item, ApiError):
        raise item
    if item is None:
        raise _cancelled()
    return item


async def _until_done(job: Job, item: object) -> Done:
    while not isinstance(item, Done):
        item = _raise_failure(await job.next())
    return item


async def _sse(
    job: Job, item: object, reply: Reply, body: GenerationRequest, release
) -> AsyncIterator[str]:
    try:
        opening = reply.opening_chunk()
        if opening is not None:
            yield sse(opening)
        while True:
            if item is None or isinstance(item, ApiError):  # too late for a status
                yield sse((item or _cancelled()).body())
                return
            if isinstance(item, Done):
                yield sse(reply.finishing_chunk(item.record))
                if body.include_usage:
                    yield sse(reply.usage_chunk(item.record))
                yield sse("[DONE]")
                return
            if item.text or item.logprobs:  # a token may add no text yet (part of a character)
                yield sse(reply.text_chunk(item, body.mlxspec.provenance))
            item = await job.next()
    finally:
        release()


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """The body has been read, so the next message comes when the client leaves (or the
    response is complete, when cancelling is a no-op)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()
