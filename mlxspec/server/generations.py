"""A request's `Generation`: what every dialect's routes check against the model and the
server's limits, with the model's defaults filled in. The fields are read in the shape of
OpenAI's request (`GenerationRequest`); other dialects translate into it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mlxspec.decoding.engine import GenerationError, GenerationSettings
from mlxspec.sampling import SamplingSettings
from mlxspec.server.errors import ApiError
from mlxspec.server.limits import ServerLimits
from mlxspec.server.providers import ModelInfo, ModelProvider, NotDownloaded
from mlxspec.server.request_body import GenerationRequest
from mlxspec.server.worker import Generation
from mlxspec.structured.answer import AnswerConstraint
from mlxspec.structured.grammar import COMPILE_SECONDS


def new_generation(
    body: GenerationRequest,
    info: ModelInfo,
    prompt,
    provider: ModelProvider,
    limits: ServerLimits,
    top_k: int | None = None,
    constraint: AnswerConstraint | None = None,
) -> Generation:
    """Check a request against the model and the limits; fill in the model's defaults.
    `top_k`: a dialect's own (Anthropic's; None: the model's); `constraint`: what the
    answer must match (the worker makes it the grammar of the model's markup)."""
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
    settings = _settings(body, info, limits, top_k)
    return Generation(info.name, prompt, settings, proposer, constraint)


def _settings(
    body: GenerationRequest, info: ModelInfo, limits: ServerLimits, top_k: int | None
) -> GenerationSettings:
    # A larger ask is clipped, not refused: agents ask for 32,000 whatever the model (Qwen
    # Code, Claude Code), and the engine clips again to what the context leaves. The run
    # record's max_tokens says what was granted; finish_reason "length" where it was used.
    asked = body.max_completion_tokens or body.max_tokens
    max_tokens = min(asked or info.defaults.max_tokens, limits.max_tokens)
    defaults = info.defaults
    try:
        return GenerationSettings(
            max_tokens=max_tokens,
            sampling=SamplingSettings(
                temperature=_given(body.temperature, defaults.temperature),
                top_p=_given(body.top_p, defaults.top_p),
                top_k=_given(top_k, defaults.top_k),
                presence_penalty=_given(body.presence_penalty, defaults.presence_penalty),
                frequency_penalty=_given(body.frequency_penalty, defaults.frequency_penalty),
                presence_context_size=body.presence_context_size,
                frequency_context_size=body.frequency_context_size,
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


def _given(asked: float | None, default: float) -> float:
    """What the request asked for, else the model's default (0 is an answer, not a gap)."""
    return default if asked is None else asked


async def checked_constraint(
    check: Callable[[], AnswerConstraint | None], param: str = "response_format"
) -> AnswerConstraint | None:
    """A request's answer constraint, checked off the event loop: checking a large schema
    takes a second (a 20,000-value enum), which would hold every other client's stream;
    one that takes longer than a grammar may take to compile is refused (400). The time
    counts from when the check starts: under a crowd, the wait for a free thread is the
    server's, not the schema's (256 clients once had a request with no schema refused)."""
    began: list[float] = []

    def timed() -> AnswerConstraint | None:
        began.append(time.monotonic())
        return check()

    checking = asyncio.ensure_future(asyncio.to_thread(timed))
    while True:
        ran = time.monotonic() - began[0] if began else 0.0
        done, _ = await asyncio.wait({checking}, timeout=max(COMPILE_SECONDS - ran, 0.0))
        if done:
            return checking.result()
        if began and time.monotonic() - began[0] >= COMPILE_SECONDS:
            checking.cancel()
            raise ApiError(
                400,
                f"{param}: the schema took over {COMPILE_SECONDS:g} s to check; simplify it",
                code="invalid_value",
                param=param,
            )
