"""Every error the API returns, in its route's dialect: OpenAI's shape
{"error": {message, type, param, code}} unless a dialect's routes ask for their own
(Anthropic's, see `install_error_handlers`).

Clients (the `openai` and `anthropic` packages, editors) read that shape to show the user a
reason, so nothing may leave the server as a bare 422 list or a 500 with a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mlxspec.settings import DoesNotFit, GenerationError, PromptTooLong

log = logging.getLogger("mlxspec.server")


class ApiError(HTTPException):
    """A request the server refuses, with the status and reason the client will see.

    An HTTPException, so that raising it while FastAPI reads the body (the size limit)
    reaches the handlers below instead of becoming a generic 400.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status_code=status, detail=message, headers=headers)
        self.message, self.code, self.param, self.type = message, code, param, type

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, shape: ErrorShape | None = None) -> JSONResponse:
        """The JSON response, in OpenAI's shape or `shape`'s."""
        body = self.body() if shape is None else shape(self)
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


ErrorShape = Callable[[ApiError], dict]  # an error as a dialect's JSON body


class ContextExceeded(ApiError):
    """A prompt the model's context cannot hold, with its numbers: OpenAI's clients read
    `context_length_exceeded`, Anthropic's "prompt is too long" (Claude Code compacts its
    conversation on it), each dialect's shape says it its way."""

    def __init__(self, prompt_tokens: int, context: int):
        super().__init__(
            400,
            f"This model's maximum context length is {context} tokens. However, your request "
            f"has {prompt_tokens} input tokens. Please reduce the length of the input.",
            code="context_length_exceeded",
        )
        self.prompt_tokens, self.context = prompt_tokens, context


def refused(err: GenerationError) -> ApiError:
    """A request the engine refused, as the client hears it (400)."""
    if isinstance(err, PromptTooLong):
        return ContextExceeded(err.prompt_tokens, err.context)
    if isinstance(err, DoesNotFit):
        return ApiError(400, str(err), code="insufficient_memory")
    return ApiError(400, str(err), code="invalid_request")


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union that failed ('str', 'list[TextPart]'...)."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part.startswith("constrained-")
    )


def _dotted(location: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    text = ""
    for part in location[1:] if location[:1] == ("body",) else location:
        if not _is_union_tag(part):
            text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")


def validation_error(exc: RequestValidationError) -> ApiError:
    """The most specific problem pydantic found (the deepest), as one readable line."""
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "cannot parse it")
        return ApiError(400, f"the body is not valid JSON: {reason}", code="invalid_json")
    deepest = max(errors, key=lambda error: len(error["loc"]))
    param = _dotted(tuple(deepest["loc"]))
    reason = deepest["msg"]
    if deepest["type"] == "value_error":  # our own validators: drop pydantic's prefix
        reason = str(deepest.get("ctx", {}).get("error", reason))
    if not param:
        return ApiError(400, f"the body must be a JSON object: {reason}", code="invalid_body")
    return invalid_value(param, reason)


def invalid_value(param: str, reason: str) -> ApiError:
    """A 400 naming the field a request got wrong, and why (every dialect's shape)."""
    return ApiError(400, f"{param}: {reason}", code="invalid_value", param=param)


def shape_finder(shapes: Mapping[str, ErrorShape]) -> Callable[[str], ErrorShape | None]:
    """`shapes`: a path prefix -> the shape of errors on its routes; gives a path's shape
    (None: OpenAI's)."""

    def shape(path: str) -> ErrorShape | None:
        return next((found for prefix, found in shapes.items() if path.startswith(prefix)), None)

    return shape


def install_error_handlers(app: FastAPI, shape_of: Callable[[str], ErrorShape | None]) -> None:
    """Every error as JSON, each route's in the shape `shape_of(path)` gives."""

    def shape(request: Request) -> ErrorShape | None:
        return shape_of(request.url.path)

    @app.exception_handler(ApiError)
    async def refused(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(shape(request))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(shape(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own: unknown path (404), wrong method (405).
        code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code
        )
        message = f"{exc.detail}: {request.method} {request.url.path}"
        refusal = ApiError(exc.status_code, message, code=code, headers=exc.headers)
        return refusal.response(shape(request))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        message = "internal error; the server log has the details"
        failure = ApiError(500, message, code="internal_error", type="server_error")
        return failure.response(shape(request))
