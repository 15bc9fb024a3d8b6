"""The JSON-Schema-Test-Suite's schemas (tests/data/json_schema_suite.json: the first schema
of each keyword's file, drafts 2020-12 and 7) sent to a server as each dialect asks for JSON,
and what came back judged: an answer valid against the schema that was sent, a 4xx naming
what cannot be enforced, or an answer cut at max_tokens (not judged: it never finished).
A 5xx or a finished answer the schema rejects is a failure. Used by tests/test_schema_suite.py
(a tiny model) and benchmarks/json_schema_suite.py (the whole suite on a real one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs

SUITE = json.loads((Path(__file__).parent / "data" / "json_schema_suite.json").read_text())
SCHEMAS: dict[str, Any] = SUITE["schemas"]
# Each dialect's way to ask for JSON, and a forced tool call's arguments.
FORMS = ("chat", "responses", "messages", "tool")
PROMPT = [{"role": "user", "content": "Answer with JSON."}]
TOOL = "answer"
ENFORCED, REFUSED, CUT, INVALID, SERVER_ERROR = "enforced", "refused", "cut", "invalid", "5xx"


@dataclass(frozen=True)
class Outcome:
    kind: str  # ENFORCED, REFUSED, CUT, INVALID or SERVER_ERROR
    detail: str  # the answer, or the error's message


def tool_parameters(schema: Any) -> dict[str, Any]:
    """A tool's parameters for `schema`: itself where it is an object schema, else it as
    the one property `value` of one (its definitions kept at the root, where `$ref`s look)."""
    if isinstance(schema, dict) and schema.get("type") == "object":
        return schema
    inner = dict(schema) if isinstance(schema, dict) else schema
    root: dict[str, Any] = {}
    if isinstance(inner, dict):
        for key in ("$schema", "$defs", "definitions"):
            if key in inner:
                root[key] = inner.pop(key)
    return {
        **root,
        "type": "object",
        "properties": {"value": inner},
        "required": ["value"],
        "additionalProperties": False,
    }


def request(form: str, schema: Any, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(the route, the body) asking for an answer matching `schema` the `form` way."""
    common = {"model": model, "temperature": 0}
    if form == "chat":
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        return "/v1/chat/completions", {
            **common,
            "messages": PROMPT,
            "max_tokens": max_tokens,
            "response_format": response_format,
        }
    if form == "responses":
        text_format = {"type": "json_schema", "name": "s", "schema": schema}
        return "/v1/responses", {
            **common,
            "input": PROMPT,
            "max_output_tokens": max_tokens,
            "text": {"format": text_format},
        }
    if form == "messages":
        return "/v1/messages", {
            **common,
            "messages": PROMPT,
            "max_tokens": max_tokens,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        }
    function = {"name": TOOL, "parameters": tool_parameters(schema)}
    return "/v1/chat/completions", {
        **common,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "tools": [{"type": "function", "function": function}],
        "tool_choice": {"type": "function", "function": {"name": TOOL}},
    }


def sent_schema(form: str, schema: Any) -> Any:
    """The schema the answer must be valid against, as it was sent."""
    return tool_parameters(schema) if form == "tool" else schema


def answer(form: str, body: dict[str, Any]) -> tuple[str | None, bool]:
    """(the JSON text the reply holds, whether it finished) from a 2xx reply's body."""
    if form == "responses":
        texts = [
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        ]
        return "".join(texts), body["status"] == "completed"
    if form == "messages":
        texts = [block["text"] for block in body["content"] if block["type"] == "text"]
        return "".join(texts), body["stop_reason"] != "max_tokens"
    choice = body["choices"][0]
    finished = choice["finish_reason"] != "length"
    if form == "chat":
        return choice["message"]["content"], finished
    calls = choice["message"].get("tool_calls") or []
    return (calls[0]["function"]["arguments"] if calls else None), finished


def judged(name: str, form: str, schema: Any, response: httpx.Response) -> Outcome:
    """What one reply was, checked against the schema with a JSON Schema validator (formats
    as annotations, as the `jsonschema` library has them by default)."""
    if response.status_code >= 500:
        return Outcome(SERVER_ERROR, response.text[:300])
    if response.status_code >= 400:
        body = response.json()
        return Outcome(REFUSED, body["error"]["message"])
    text, finished = answer(form, response.json())
    if not finished:
        return Outcome(CUT, text or "")
    try:
        value = json.loads(text or "")
    except ValueError:
        return Outcome(INVALID, f"not JSON: {text!r}")
    validator_class = jsonschema_rs.Draft7Validator if name.startswith("draft7/") else None
    expected = sent_schema(form, schema)
    if validator_class is None:
        validator = jsonschema_rs.validator_for(expected, validate_formats=False)
    else:
        validator = validator_class(expected, validate_formats=False)
    errors = [error.message for error in validator.iter_errors(value)]
    return Outcome(INVALID, f"{text}: {errors[0]}") if errors else Outcome(ENFORCED, text)


def run(client: httpx.Client, name: str, form: str, model: str, max_tokens: int) -> Outcome:
    schema = SCHEMAS[name]
    route, body = request(form, schema, model, max_tokens)
    return judged(name, form, schema, client.post(route, json=body))
