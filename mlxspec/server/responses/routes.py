"""The Responses dialect: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, in and
out of the one request shape inside (the translations are translate.py's).

A request's input items (after the stored conversation of `previous_response_id`, where it
names one) become a `Conversation` and a `Generation` for the worker; its answer's parts
come back through `Answering` and leave as a response object or as the Responses stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import mlxspec.server.responses.translate as responses
from mlxspec.markup.output_parser import Answered
from mlxspec.server.answering import SSE_HEADERS, Answering, dialect_events, dropped_header
from mlxspec.server.errors import ApiError
from mlxspec.server.generations import checked_constraint, new_generation
from mlxspec.server.limits import ServerLimits
from mlxspec.server.providers import ModelProvider, find_model
from mlxspec.server.responses.schemas import ResponsesRequest
from mlxspec.server.responses.store import ResponseStore
from mlxspec.server.worker import Worker


def responses_router(
    provider: ModelProvider, worker: Worker, limits: ServerLimits, store: ResponseStore
) -> APIRouter:
    """The Responses routes (the app adds the /v1 prefix and the key check)."""
    router = APIRouter()

    @router.post("/responses")
    async def create(body: ResponsesRequest, request: Request):
        info = find_model(provider, body.model)
        earlier: list[dict] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(
                    404,
                    f"previous_response_id: no response {body.previous_response_id!r} is kept "
                    f"here (this server keeps the last {store.max_responses} stored responses, "
                    "in memory, until it restarts)",
                    code="previous_response_not_found",
                    param="previous_response_id",
                )
            earlier = list(stored.items)
        new_items = responses.input_items(body)
        offered = responses.tools(body)
        kwargs = responses.template_kwargs(body, info.defaults.chat_template_kwargs)
        conversation = responses.conversation(
            earlier + new_items, body.instructions, offered.for_template, kwargs
        )
        constraint = await checked_constraint(
            lambda: responses.answer_constraint(body, offered), "text.format"
        )
        asked = responses.generation_request(body, limits.max_tokens)
        generation = new_generation(asked, info, conversation, provider, limits, None, constraint)
        headers = dropped_header(offered.dropped)
        answering = await Answering.start(request, worker, generation, stream=body.stream)
        envelope = responses.Envelope(responses.new_id("resp"), info.name, body)
        conversation_so_far = earlier + new_items

        def keep(response: dict) -> None:
            if body.store:
                store.put(response, conversation_so_far + response["output"])

        if body.stream:
            stream = responses.ResponseStream(envelope, offered)
            events = _events(answering, stream, keep)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
            )
        try:
            answered = await answering.answered()
        finally:
            answering.release()
        record, answer = answered.done.record, answered.answer
        output = responses.output_items(answer, offered)
        response = envelope.response(responses.status_of(record, answer), output, record)
        keep(response)
        return JSONResponse(response, headers=headers)

    @router.get("/responses/{response_id}")
    async def read(response_id: str) -> dict:
        return _stored(store, response_id).response

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        _stored(store, response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router


def _stored(store: ResponseStore, response_id: str):
    found = store.get(response_id)
    if found is None:
        raise ApiError(
            404, f"no response {response_id!r} is kept here", code="not_found", param="response_id"
        )
    return found


def _events(
    answering: Answering, stream: responses.ResponseStream, keep: Callable[[dict], None]
) -> AsyncIterator[str]:
    def closing(answered: Answered) -> list[str]:
        events = stream.closing(answered.done.record, answered.answer)
        keep(stream.final)
        return events

    async def opening() -> list[str]:
        return stream.opening()

    return dialect_events(answering, opening, stream.part, closing, stream.failing)
