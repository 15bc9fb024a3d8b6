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

from mlxspec.markup.output_parser import Answered
from mlxspec.server.answering import SSE_HEADERS, Answering
from mlxspec.server.errors import ApiError
from mlxspec.server.generations import checked_constraint, new_generation
from mlxspec.server.limits import ServerLimits
from mlxspec.server.openai.replies import Reply, sse
from mlxspec.server.openai.schemas import ChatRequest, CompletionRequest
from mlxspec.server.providers import ModelProvider, find_model
from mlxspec.server.request_body import GenerationRequest
from mlxspec.server.worker import Generation, Worker


def openai_router(provider: ModelProvider, worker: Worker, limits: ServerLimits) -> APIRouter:
    """The two completion routes (the app adds the /v1 prefix and the key check)."""
    router = APIRouter()

    @router.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        info = find_model(provider, body.model)
        conversation = body.conversation(info.defaults.chat_template_kwargs)
        constraint = await checked_constraint(body.answer_constraint)
        generation = new_generation(body, info, conversation, provider, limits, None, constraint)
        return await _respond(request, worker, generation, body, chat=True)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        info = find_model(provider, body.model)
        prompt, constraint = body.prompt_input(), await checked_constraint(body.answer_constraint)
        generation = new_generation(body, info, prompt, provider, limits, None, constraint)
        return await _respond(request, worker, generation, body, chat=False, echo=body.echoed())

    return router


async def _respond(
    request: Request,
    worker: Worker,
    generation: Generation,
    body: GenerationRequest,
    chat: bool,
    echo: str = "",
):
    """Queue the generation; answer with JSON, or stream (at once when it must wait)."""
    answering = await Answering.start(request, worker, generation, stream=body.stream)
    reply = Reply(chat=chat, model=generation.model, echo=echo)
    if body.stream:
        stream = _sse(answering, reply, body)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        answered = await answering.answered()
    finally:
        answering.release()
    done = answered.done
    return JSONResponse(reply.complete(done.record, done.text, answered.answer, done.logprobs))


async def _sse(answering: Answering, reply: Reply, body: GenerationRequest) -> AsyncIterator[str]:
    provenance = body.mlxspec.provenance
    try:
        async for comment in answering.waiting():
            yield comment
        opening = reply.opening_chunk()
        if opening is not None:
            yield sse(opening)
        event = None  # the last output event: it released the parts the end releases
        async for item in answering:
            if not isinstance(item, Answered):
                event = item.event
            for chunk in reply.output_chunks(item.parts, event, provenance, item.logprobs):
                yield sse(chunk)
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
