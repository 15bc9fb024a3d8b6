"""Ollama's dialect: `/api/version`, `/api/tags`, `/api/show`, `/api/ps`, `/api/chat` and
`/api/generate`, in and out of the one request shape inside (schemas.py in, replies.py
out, model_facts.py for what the model endpoints say).

A chat becomes a `Conversation`; a generate with a `suffix` an `Infill` (the model's own
FIM tokens lay it out), with `raw` the prompt as it is, else the user's turn of the chat
template. Answers stream as NDJSON unless `"stream": false`, as Ollama's do. A stream
starts once the first output is in: NDJSON has no comment line to say "waiting", and an
error found before any output keeps its HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxspec.markup.output_parser import Answered
from mlxspec.server.answering import Answering, dialect_events
from mlxspec.server.generations import checked_constraint, new_generation
from mlxspec.server.limits import ServerLimits
from mlxspec.server.ollama import model_facts
from mlxspec.server.ollama.replies import NDJSON, Reply, error_body, line
from mlxspec.server.ollama.schemas import Asking, ChatRequest, GenerateRequest, ShowRequest
from mlxspec.server.providers import ModelInfo, ModelProvider, find_model
from mlxspec.server.worker import Worker

# Ollama names a model `name:tag`; a client that adds the default tag means the name.
DEFAULT_TAG = ":latest"


def ollama_router(provider: ModelProvider, worker: Worker, limits: ServerLimits) -> APIRouter:
    """The /api routes (the app adds the key check and Ollama's error shape)."""
    router = APIRouter(prefix="/api")
    since = datetime.now(UTC)  # what `modified_at` says: the models were served from then
    facts = model_facts.ModelFacts()
    serving = _Serving(provider, worker, limits)

    def look() -> None:
        """Read the facts of the model in memory now (once per load)."""
        resident = worker.resident
        facts.seen(resident, worker.resident_engine(resident) if resident else None)

    @router.get("/version")
    async def version() -> dict:
        return {"version": model_facts.OLLAMA_VERSION}

    @router.get("/tags")
    async def tags() -> dict:
        look()
        listed = provider.models.values()
        return {
            "models": [model_facts.listing(info, facts.of(info.name), since) for info in listed]
        }

    @router.get("/ps")
    async def running() -> dict:
        look()
        resident = worker.resident
        if resident is None or worker.resident_engine(resident) is None:
            return {"models": []}
        info = provider.models[resident]
        return {"models": [model_facts.running(info, facts.of(resident))]}

    @router.post("/show")
    async def show(body: ShowRequest) -> dict:
        look()
        info = _model(provider, body.asked)
        return model_facts.shown(info, facts.of(info.name), since)

    @router.post("/chat")
    async def chat(body: ChatRequest, request: Request):
        info = _model(provider, body.model)
        reply = Reply(info.name, chat=True)
        if not body.messages:
            loaded = await serving.load(request, body, info, reply)
            look()
            return loaded
        conversation = body.conversation(info.defaults.chat_template_kwargs)
        return await serving.answer(request, body, info, conversation, reply)

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        info = _model(provider, body.model)
        reply = Reply(info.name, chat=False)
        if body.loads_only:
            loaded = await serving.load(request, body, info, reply)
            look()
            return loaded
        prompt = body.prompt_input(info.defaults.chat_template_kwargs)
        return await serving.answer(request, body, info, prompt, reply)

    return router


def _model(provider: ModelProvider, name: str | None) -> ModelInfo:
    if name is not None and name not in provider.models:
        name = name.removesuffix(DEFAULT_TAG)
    return find_model(provider, name)


@dataclass(frozen=True)
class _Serving:
    """What the answering routes share: where models come from, who runs them, the limits."""

    provider: ModelProvider
    worker: Worker
    limits: ServerLimits

    async def answer(self, request: Request, body: Asking, info: ModelInfo, prompt, reply: Reply):
        """Queue the generation; answer with one object, or stream its lines."""
        asked = body.generation_request()
        constraint = await checked_constraint(asked.answer_constraint, "format")
        generation = new_generation(
            asked, info, prompt, self.provider, self.limits, body.top_k(), constraint
        )
        answering = await Answering.start(request, self.worker, generation)  # errors keep a status
        if body.streamed:
            return StreamingResponse(_lines(answering, reply), media_type=NDJSON)
        try:
            answered = await answering.answered()
        finally:
            answering.release()
        return JSONResponse(reply.whole(answered.answer, answered.done.record))

    async def load(self, request: Request, body: Asking, info: ModelInfo, reply: Reply):
        """An empty request loads the model, as Ollama's does (editors warm it up so): the
        worker opens it to make one token of a one-token prompt."""
        update = {"max_tokens": 1, "response_format": None}
        asked = body.generation_request().model_copy(update=update)
        generation = new_generation(asked, info, [0], self.provider, self.limits)
        answering = await Answering.start(request, self.worker, generation)
        try:
            await answering.answered()
        finally:
            answering.release()
        return JSONResponse(reply.loaded())


def _lines(answering: Answering, reply: Reply):
    """The answer's parts as lines, then the closing ones; an error once the stream has
    begun is too late for a status, so it is the stream's last line, as Ollama sends it."""

    async def opening() -> list[str]:
        return []

    def part(answer_part) -> list[str]:
        body = reply.part(answer_part)
        return [] if body is None else [line(body)]

    def closing(answered: Answered) -> list[str]:
        return [line(body) for body in reply.closing(answered.answer, answered.done.record)]

    return dialect_events(answering, opening, part, closing, lambda err: [line(error_body(err))])
