"""Anthropic's dialect: `/v1/messages` and `/v1/messages/count_tokens`, in and out of the
one request shape inside (the translations are anthropic.py's).

A request becomes a `Conversation` and a `Generation` for the worker; its answer's parts
come back through `Answering` and leave as a message or as Anthropic's stream of events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import mlxspec.server.anthropic.translate as anthropic
from mlxspec.decoding.engine import GenerationError
from mlxspec.markup.conversation import Conversation
from mlxspec.server.answering import SSE_HEADERS, Answering, dialect_events, dropped_header
from mlxspec.server.errors import ApiError, refused
from mlxspec.server.generations import checked_constraint, new_generation
from mlxspec.server.limits import ServerLimits
from mlxspec.server.providers import ModelProvider, find_model
from mlxspec.server.worker import Worker


def anthropic_router(provider: ModelProvider, worker: Worker, limits: ServerLimits) -> APIRouter:
    """The two Messages routes (the app adds the /v1 prefix, the key check and Anthropic's
    error shape)."""
    router = APIRouter()

    @router.post("/messages")
    async def messages(body: anthropic.MessagesRequest, request: Request):
        info = find_model(provider, body.model)
        conversation = anthropic.conversation(body, info.defaults.chat_template_kwargs)
        asked = anthropic.generation_request(body, limits.max_tokens)
        constraint = await checked_constraint(
            lambda: anthropic.answer_constraint(body), "output_config.format"
        )
        generation = new_generation(
            asked, info, conversation, provider, limits, body.top_k, constraint
        )
        headers = dropped_header(anthropic.dropped_tools(body))
        answering = await Answering.start(request, worker, generation, stream=body.stream)
        message_id = anthropic.new_id("msg")
        if body.stream:
            # message_start says the prompt's size, before the run record can: counted
            # once the model is at work (a stream that waits in line starts before).
            stream = anthropic.MessageStream(message_id, info.name, 0)
            events = _events(
                answering, stream, lambda: _prompt_tokens(worker, info.name, conversation)
            )
            return StreamingResponse(
                events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
            )
        try:
            answered = await answering.answered()
        finally:
            answering.release()
        record = answered.done.record
        message = anthropic.message(message_id, info.name, answered.answer, record)
        return JSONResponse(message, headers=headers)

    @router.post("/messages/count_tokens")
    async def count_tokens(body: anthropic.CountTokensRequest) -> dict:
        info = find_model(provider, body.model)
        conversation = anthropic.conversation(body, info.defaults.chat_template_kwargs)
        return {"input_tokens": await _prompt_tokens(worker, info.name, conversation)}

    return router


async def _prompt_tokens(worker: Worker, model: str, conversation: Conversation) -> int:
    """How many tokens the model's chat template makes of the conversation, counted with
    the tokenizer of the model in memory (loading one is the worker's job, not the loop's)."""
    engine = worker.resident_engine(model)
    if engine is None:
        raise ApiError(
            503,
            f"{model} is not loaded now, and tokens are counted with a loaded model's chat "
            "template; a message to it loads it",
            code="model_not_loaded",
            type="server_error",
        )
    try:
        return len(await asyncio.to_thread(engine.encode_chat, conversation))
    except GenerationError as err:
        raise refused(err) from None


def _events(
    answering: Answering,
    stream: anthropic.MessageStream,
    count: Callable[[], Awaitable[int]] | None = None,
) -> AsyncIterator[str]:
    """The stream's events; `count` (None: `stream` has it) the prompt's tokens."""

    async def opening() -> list[str]:
        if count is not None:
            stream.input_tokens = await count()
        return stream.opening()

    return dialect_events(
        answering,
        opening,
        stream.part,
        lambda answered: stream.closing(answered.done.record),
        lambda err: [anthropic.error_event(err)],
    )
