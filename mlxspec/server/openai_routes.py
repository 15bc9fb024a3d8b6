"""OpenAI's dialect: `/v1/chat/completions` and `/v1/completions`, in and out of the one
request shape inside.

A chat request becomes a `Conversation` (messages with tool calls and results, tools,
template arguments), a text completion a raw prompt; both a `Generation` for the worker.
Its answer's parts come back through `Answering` and leave as OpenAI's JSON or SSE chunks
(responses.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxspec.engine import GenerationError, GenerationSettings
from mlxspec.output_parser import Answered
from mlxspec.sampling import SamplingSettings
from mlxspec.server.answering import Answering
from mlxspec.server.errors import ApiError
from mlxspec.server.limits import ServerLimits
from mlxspec.server.providers import ModelInfo, ModelProvider, NotDownloaded, find_model
from mlxspec.server.responses import Reply, sse
from mlxspec.server.schemas import ChatRequest, CompletionRequest, GenerationRequest
from mlxspec.server.worker import Generation, Worker


def openai_router(provider: ModelProvider, worker: Worker, limits: ServerLimits) -> APIRouter:
    """The two completion routes (the app adds the /v1 prefix and the key check)."""
    router = APIRouter()

    @router.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        info = find_model(provider, body.model)
        conversation = body.conversation(info.defaults.chat_template_kwargs)
        generation = _generation(body, info, conversation, provider, limits)
        return await _respond(request, worker, generation, body, chat=True)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        info = find_model(provider, body.model)
        generation = _generation(body, info, body.prompt_input(), provider, limits)
        return await _respond(request, worker, generation, body, chat=False)

    return router


def _generation(
    body: GenerationRequest, info: ModelInfo, prompt, provider: ModelProvider, limits: ServerLimits
) -> Generation:
    """Check a request against the model and the limits; fill in the model's defaults."""
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
        )
    except (GenerationError, ValueError) as err:
        raise ApiError(400, str(err), code="invalid_value") from None


async def _respond(
    request: Request, worker: Worker, generation: Generation, body: GenerationRequest, chat: bool
):
    """Queue the generation; answer with JSON, or stream once its first output is in."""
    answering = await Answering.start(request, worker, generation)
    reply = Reply(chat=chat, model=generation.model)
    if body.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        stream = _sse(answering, reply, body)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    try:
        answered = await answering.answered()
    finally:
        answering.release()
    done = answered.done
    return JSONResponse(reply.complete(done.record, done.text, answered.answer))


async def _sse(answering: Answering, reply: Reply, body: GenerationRequest) -> AsyncIterator[str]:
    provenance = body.mlxspec.provenance
    try:
        opening = reply.opening_chunk()
        if opening is not None:
            yield sse(opening)
        event = None  # the last output event: it released the parts the end releases
        async for item in answering:
            if not isinstance(item, Answered):
                event = item.event
            for part in item.parts:
                yield sse(reply.part_chunk(part, event, provenance))
            if isinstance(item, Answered):
                record = item.done.record
                yield sse(reply.finishing_chunk(record, item.answer))
                if body.include_usage:
                    yield sse(reply.usage_chunk(record))
                yield sse("[DONE]")
    except ApiError as err:  # too late for a status
        yield sse(err.body())
    finally:
        answering.release()
