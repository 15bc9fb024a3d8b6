"""A client's mistake is a 4xx in its dialect, never a 500: a forced tool whose schema does
not compile (named by its field), a grammar that fails only once the request runs in the
batch, and text that is not Unicode (a lone UTF-16 surrogate: read as U+FFFD, one rule for
every dialect). A real uvicorn server over test_server's tiny llamas."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import TinyProvider, serving

import mlxspec.server.generations
import mlxspec.structured.grammar
from mlxspec.server import ServerLimits
from mlxspec.server.errors import ApiError
from mlxspec.server.generations import checked_constraint
from mlxspec.server.lone_surrogates import replace_lone_surrogates
from mlxspec.settings import GrammarError

NOT_A_SCHEMA = {"type": "object", "properties": {"city": "string"}}  # "string" is no schema
HI = [{"role": "user", "content": "hi"}]
FORCED_WITH_A_BAD_SCHEMA = {
    "chat": (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "max_tokens": 8,
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "w", "parameters": NOT_A_SCHEMA}}],
            "tool_choice": {"type": "function", "function": {"name": "w"}},
        },
        "tools[0].function.parameters",
    ),
    "responses": (
        "/v1/responses",
        {
            "model": "tiny",
            "max_output_tokens": 8,
            "input": "hi",
            "tools": [
                {"type": "function", "name": "v", "parameters": {"type": "object"}},
                {"type": "function", "name": "w", "parameters": NOT_A_SCHEMA},
            ],
            "tool_choice": "required",
        },
        "tools[1].parameters",
    ),
    "anthropic": (
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 8,
            "messages": HI,
            "tools": [{"name": "w", "input_schema": NOT_A_SCHEMA}],
            "tool_choice": {"type": "tool", "name": "w"},
        },
        "tools[0].input_schema",
    ),
}


@pytest.fixture(scope="module")
def provider() -> TinyProvider:
    return TinyProvider(max_tokens=4)


@pytest.fixture(scope="module")
def base_url(provider):
    with serving(provider, limits=ServerLimits(max_batch=4)) as url:
        yield url


def message_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


@pytest.mark.parametrize("dialect", FORCED_WITH_A_BAD_SCHEMA)
def test_a_forced_tool_whose_schema_does_not_compile_is_a_400_naming_it(base_url, dialect):
    path, body, field = FORCED_WITH_A_BAD_SCHEMA[dialect]
    response = httpx.post(base_url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert message_of(response).startswith(f"{field}: ")
    assert "schema" in message_of(response)
    if dialect != "anthropic":  # Anthropic's error shape has no param
        assert response.json()["error"]["param"] == field


def test_a_grammar_that_fails_in_the_batch_is_a_400(base_url, monkeypatch):
    """A grammar that compiles past the scheduler's quick wait and then fails (over
    budget, too slow) fails inside the batch's round: still the client's 400."""

    def slow_failure(*args, **kwargs):
        time.sleep(mlxspec.structured.grammar.QUICK_SECONDS + 0.3)
        raise GrammarError("the grammar is over its budget")

    monkeypatch.setattr(mlxspec.structured.grammar, "compile_grammar", slow_failure)
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": HI,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "maxProperties": 3}},
        },
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert "over its budget" in message_of(response)


def test_a_check_that_waits_for_a_thread_is_not_timed_for_it(monkeypatch):
    """Under a crowd every thread of the pool may be busy: the schema check's time bound
    counts from when it runs, so a request is not refused for the server's queue (a soak
    of 256 clients had one without any schema refused so). A check over the bound is."""
    monkeypatch.setattr(mlxspec.server.generations, "COMPILE_SECONDS", 0.3)

    async def checked_behind_a_busy_pool(check_seconds: float):
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        busy = loop.run_in_executor(None, time.sleep, 0.7)  # the pool's one thread
        try:
            return await checked_constraint(lambda: time.sleep(check_seconds))
        finally:
            await busy

    assert asyncio.run(checked_behind_a_busy_pool(0.0)) is None
    with pytest.raises(ApiError, match="took over 0.3 s"):
        asyncio.run(checked_behind_a_busy_pool(0.7))


LONE = '"a\\ud800b"'  # a JSON string with half a surrogate pair in it
SAID = f'[{{"role": "user", "content": {LONE}}}]'
SURROGATE_BODIES = {
    "chat": ("/v1/chat/completions", f'{{"max_tokens": 2, "messages": {SAID}}}'),
    "text": ("/v1/completions", f'{{"max_tokens": 2, "prompt": {LONE}}}'),
    "responses": ("/v1/responses", f'{{"max_output_tokens": 2, "input": {LONE}}}'),
    "anthropic": ("/v1/messages", f'{{"model": "tiny", "max_tokens": 2, "messages": {SAID}}}'),
    "count_tokens": ("/v1/messages/count_tokens", f'{{"model": "tiny", "messages": {SAID}}}'),
}


def input_tokens(base_url: str, path: str, body: str) -> int:
    """The prompt's length as the dialect's answer reports it (a 200 asserted)."""
    response = httpx.post(
        base_url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    usage = answer.get("usage", answer)
    return usage.get("prompt_tokens", usage.get("input_tokens"))


@pytest.mark.parametrize("dialect", SURROGATE_BODIES)
def test_a_lone_surrogate_is_read_as_the_replacement_character(base_url, dialect):
    """Served, and its prompt is the one with U+FFFD in its place (3 bytes: 3 tokens of
    the byte tokenizer, where a dropped character would be none)."""
    path, body = SURROGATE_BODIES[dialect]
    replaced = body.replace("\\ud800", "\\ufffd")
    assert replaced != body
    assert input_tokens(base_url, path, body) == input_tokens(base_url, path, replaced)


@pytest.mark.parametrize(
    "body, expected",
    [
        (rb'"a\ud800b"', rb'"a\ufffdb"'),  # a high half alone
        (rb'"\udc00"', rb'"\ufffd"'),  # a low half alone
        (rb'"\uD83D\uDE00"', rb'"\uD83D\uDE00"'),  # a pair: an emoji, kept
        (rb'"\ude00\ud83d"', rb'"\ufffd\ufffd"'),  # the halves the wrong way round
        (rb'"\\ud800"', rb'"\\ud800"'),  # an escaped backslash, then text: kept
        (rb'"\\\ud800"', rb'"\\\ufffd"'),  # a backslash, then a lone half
        (rb'"\u00e9\n"', rb'"\u00e9\n"'),  # other escapes, kept
    ],
)
def test_only_escaped_lone_surrogates_are_replaced(body, expected):
    repaired = replace_lone_surrogates(body)
    assert repaired == expected
    json.loads(repaired).encode()  # valid UTF-8 text now
