"""llama.cpp's dialect: `/infill` (fill-in-the-middle: llama.vim, llama.vscode) and
`/completion` (a raw prompt: Tabby's llama.cpp backend), in and out of the one request
shape inside.

An infill becomes an `Infill` prompt, which the engine lays out with the model's own FIM
tokens, so speculation reads the code after the cursor and the editor's other files like any
prompt. Each keystroke re-sends nearly the same request: the prompt cache makes it cost what
changed, and a newer request of the same `id_slot` cancels the older at once, so a typist
never waits behind a suggestion nobody will see.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxspec.markup.output_parser import Answered
from mlxspec.server.answering import SSE_HEADERS, Answering
from mlxspec.server.errors import ApiError
from mlxspec.server.generations import new_generation
from mlxspec.server.limits import ServerLimits
from mlxspec.server.llamacpp.replies import chunk, final_result, picked, sse, warmed_up
from mlxspec.server.llamacpp.schemas import InfillRequest, LlamaCppRequest
from mlxspec.server.providers import ModelProvider, find_model
from mlxspec.server.worker import Generation, Worker


def llamacpp_router(provider: ModelProvider, worker: Worker, limits: ServerLimits) -> APIRouter:
    """`/infill`, `/completion` and its alias `/completions` (mounted without a prefix, as
    llama.cpp serves them)."""
    router = APIRouter()
    slots: dict[int, Answering] = {}  # the running request of each id_slot

    async def respond(body: LlamaCppRequest, request: Request):
        # llama.vim sends `"model": ""` unless told a name: the server's model, as llama.cpp
        info = find_model(provider, body.model or None)
        prompt = body.prompt_input()
        asked = body.model_copy(update={"n": 1, "max_tokens": body.granted_tokens()})
        generation = new_generation(asked, info, prompt, provider, limits, body.top_k)
        generation = _with_editor_stops(generation, body)
        if body.stream:
            if body.completions > 1:
                raise ApiError(400, "n_cmpl: more than one completion is not streamed here")
            answering = await _start(request, worker, generation, body, slots)
            return StreamingResponse(
                _stream(answering, body, slots), media_type="text/event-stream", headers=SSE_HEADERS
            )
        results = await asyncio.gather(
            *(
                _whole(request, worker, generation, body, slots, index)
                for index in range(body.completions)
            )
        )
        return JSONResponse(results[0] if len(results) == 1 else results)

    @router.post("/infill")
    async def infill(body: InfillRequest, request: Request):
        return await respond(body, request)

    @router.post("/completion")
    async def completion(body: LlamaCppRequest, request: Request):
        return await respond(body, request)

    @router.post("/completions")
    async def completions(body: LlamaCppRequest, request: Request):
        return await respond(body, request)

    return router


def _with_editor_stops(generation: Generation, body: LlamaCppRequest) -> Generation:
    """llama.cpp's n_indent and t_max_predict_ms as the engine's own ends of a completion."""
    settings = generation.settings
    line_seconds = body.t_max_predict_ms / 1000 if body.t_max_predict_ms else None
    return replace(
        generation,
        settings=replace(settings, min_indent=body.n_indent, line_seconds=line_seconds),
    )


async def _start(
    request: Request,
    worker: Worker,
    generation: Generation,
    body: LlamaCppRequest,
    slots: dict[int, Answering],
) -> Answering:
    """Queue the generation; a completion (not a warm-up) cancels the one its slot still
    runs, which was for text the user has since changed."""
    if body.id_slot >= 0 and not body.warm_up and body.id_slot in slots:
        slots.pop(body.id_slot).release()
    answering = await Answering.start(request, worker, generation, stream=body.stream)
    if body.id_slot >= 0 and not body.warm_up:
        slots[body.id_slot] = answering
    return answering


def _let_go(answering: Answering, body: LlamaCppRequest, slots: dict[int, Answering]) -> None:
    answering.release()
    if slots.get(body.id_slot) is answering:
        del slots[body.id_slot]


async def _whole(
    request: Request,
    worker: Worker,
    generation: Generation,
    body: LlamaCppRequest,
    slots: dict[int, Answering],
    index: int,
) -> dict:
    answering = await _start(request, worker, generation, body, slots)
    try:
        done = (await answering.answered()).done
    finally:
        _let_go(answering, body, slots)
    if body.warm_up:
        return picked(warmed_up(done.record, body.id_slot), body.response_fields)
    return picked(final_result(done.record, done.text, body.id_slot, index), body.response_fields)


async def _stream(
    answering: Answering, body: LlamaCppRequest, slots: dict[int, Answering]
) -> AsyncIterator[str]:
    try:
        async for item in answering:
            text = "".join(part.text for part in item.parts)
            if text:
                yield sse(chunk(text, body.id_slot))
            if isinstance(item, Answered):
                done = item.done
                result = final_result(done.record, done.text, body.id_slot, streamed=True)
                yield sse(picked(result, body.response_fields))
    except ApiError as err:  # too late for a status
        yield sse(err.body())
    finally:
        _let_go(answering, body, slots)
