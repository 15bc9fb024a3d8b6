"""Editors' and agents' real clients against the real server: a request shaped as Claude
Code sends it, through the official `anthropic` client's beta route; Simon Willison's
`llm` CLI, pointed at the server by its extra-openai-models.yaml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import anthropic
import llm
import pytest
from test_server import ECHO, TinyProvider, serving, tiny_engine

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Done
from mlxspec.server.anthropic.translate import MessagesRequest, generation_request

# Room for a prompt with Claude Code's tools in the fallback format (the tiny llamas have
# no chat template).
CONTEXT = 2048


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(TinyProvider(context=CONTEXT), api_key="sesame", preload="tiny") as url:
        yield url


# --- Claude Code against /v1/messages --------------------------------------------------
#
# The shape of Claude Code's requests, as recorded from its traffic (claude-cli 2.0.36,
# tianzecn/myclaudecode mcp/claudish/ai_docs/CLAUDE_CODE_PROTOCOL_COMPLETE.md, "Request
# Body Structure" and "Critical Headers"): POST /v1/messages?beta=true (Claude Code's
# gateway docs, code.claude.com/docs/en/llm-gateway-protocol: "requests arrive as
# /v1/messages?beta=true"), the headers anthropic-version, anthropic-beta and x-api-key
# (ANTHROPIC_API_KEY; ANTHROPIC_AUTH_TOKEN sends a bearer token), `system` as text blocks
# with cache_control, cache_control on message blocks and on the last tool, tools with
# JSON Schemas, metadata.user_id, max_tokens 32000, stream true, temperature 1, and a
# thinking budget. Newer versions add context_management beside thinking (Wei-Shaw/sub2api,
# "mirror real CLI behavior"). The model is what ANTHROPIC_MODEL names: one of the server's.

EPHEMERAL = {"type": "ephemeral"}
CLAUDE_CODE_BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
]
CLAUDE_CODE_TOOLS = [
    {
        "name": "Bash",
        "description": "Executes a given bash command in a persistent shell session.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                "timeout": {"type": "number", "description": "Optional timeout in ms"},
            },
            "required": ["command"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
    },
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "number"}},
            "required": ["file_path"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
        "cache_control": EPHEMERAL,
    },
]


def claude_code_request(system_padding: str = "") -> dict:
    """A turn of Claude Code's tool loop: the user's ask, a Read call, its result."""
    system = [
        {
            "type": "text",
            "text": "You are Claude Code, Anthropic's official CLI for Claude.",
            "cache_control": EPHEMERAL,
        },
        {"type": "text", "text": "Answer briefly." + system_padding, "cache_control": EPHEMERAL},
    ]
    read = {"file_path": "/repo/notes.txt"}
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>CLAUDE.md: none</system-reminder>"},
                {"type": "text", "text": "Repeat notes.txt.", "cache_control": EPHEMERAL},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "I'll read it."},
                {"type": "tool_use", "id": "toolu_01A", "name": "Read", "input": read},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01A",
                    "content": ECHO,
                    "cache_control": EPHEMERAL,
                }
            ],
        },
    ]
    return {
        "model": "tiny",
        "max_tokens": 32000,
        "system": system,
        "messages": messages,
        "tools": CLAUDE_CODE_TOOLS,
        "metadata": {"user_id": "user_3f2a_account__session_9c1e"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
    }


NEWER_FIELDS = {
    "temperature": 1,  # the SDK takes it in extra_body, as it does unknown fields
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}


def claude_code_client(base_url: str, sent: list) -> anthropic.Anthropic:
    """The official client with Claude Code's headers (its key as x-api-key, as
    ANTHROPIC_API_KEY sends it; this SDK would send a bearer token), keeping each request
    it sends, to show the shape went out."""
    http = anthropic.DefaultHttpxClient(event_hooks={"request": [sent.append]}, timeout=60)
    headers = {"x-api-key": "sesame", "anthropic-version": "2023-06-01"}
    return anthropic.Anthropic(
        base_url=base_url, default_headers=headers, http_client=http, max_retries=0
    )


def assert_well_formed(events: list) -> None:
    """Anthropic's stream grammar: message_start; content blocks numbered from 0, each
    start, deltas of its own kind, stop, never two open; message_delta; message_stop
    (pings anywhere)."""
    events = [event for event in events if event.type != "ping"]
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    delta_of = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
    open_block, opened = None, 0
    for event in events[1:-2]:
        if event.type == "content_block_start":
            assert open_block is None and event.index == opened
            open_block, opened = event.content_block.type, opened + 1
        elif event.type == "content_block_delta":
            assert event.index == opened - 1 and event.delta.type == delta_of[open_block]
        else:
            assert event.type == "content_block_stop", event.type
            assert open_block is not None and event.index == opened - 1
            open_block = None
    assert open_block is None


def test_a_claude_code_request_streams_through(base_url, monkeypatch):
    """Its max_tokens (32000) is clamped, here to the context's room, not refused; its
    unknown fields (cache_control, metadata, context_management) are ignored."""
    for key in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):  # the client would send them
        monkeypatch.delenv(key, raising=False)
    sent: list = []
    client = claude_code_client(base_url, sent)
    body = claude_code_request()
    counted = client.beta.messages.count_tokens(
        model="tiny",
        system=body["system"],
        messages=body["messages"],
        tools=body["tools"],
        extra_query={"beta": "true"},
    )
    room = 24
    padded = claude_code_request("x" * (CONTEXT - room - counted.input_tokens))  # 1 byte, 1 token
    events = list(
        client.beta.messages.create(
            **padded,
            stream=True,
            betas=CLAUDE_CODE_BETAS,
            extra_body=NEWER_FIELDS,
            extra_query={"beta": "true"},  # Claude Code's; this SDK does not add it
        )
    )
    request = sent[-1]
    assert request.url.path == "/v1/messages" and request.url.params["beta"] == "true"
    assert request.headers["anthropic-beta"] == ",".join(CLAUDE_CODE_BETAS)
    assert request.headers["x-api-key"] == "sesame" and "authorization" not in request.headers
    sent_body = json.loads(request.content)
    assert sent_body["system"][0]["cache_control"] == EPHEMERAL and sent_body["temperature"] == 1
    assert_well_formed(events)
    start, delta = events[0], next(event for event in events if event.type == "message_delta")
    assert start.message.usage.input_tokens == CONTEXT - room
    record = delta.x_mlxspec
    assert record["max_tokens"] == room and record["sampling"]["temperature"] == 1
    assert delta.usage.output_tokens == record["completion_tokens"] <= room
    assert delta.delta.stop_reason == (
        "max_tokens" if record["finish_reason"] == "length" else "end_turn"
    )


def test_anthropic_max_tokens_is_clamped_to_the_servers_limit():
    body = MessagesRequest.model_validate(claude_code_request())
    assert generation_request(body, max_tokens_limit=4096).max_tokens == 4096
    assert generation_request(body, max_tokens_limit=64_000).max_tokens == 32000


# --- The llm CLI (Simon Willison's) ----------------------------------------------------


@pytest.fixture()
def llm_home(tmp_path, base_url, monkeypatch) -> dict[str, str]:
    """An LLM_USER_PATH that names the server's model as the docs say (docs/serving.md),
    with the server's key saved as `llm keys set mlxspec` saves it; the environment to
    run the CLI in."""
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: mlxspec-tiny\n"
        f"  model_name: tiny\n"
        f"  api_base: {base_url}/v1\n"
        f"  api_key_name: mlxspec\n"
    )
    (tmp_path / "keys.json").write_text(json.dumps({"mlxspec": "sesame"}))
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    return {**os.environ, "LLM_USER_PATH": str(tmp_path), "PYTHONIOENCODING": "utf-8"}


def plain_greedy(content: str, max_tokens: int) -> str:
    """The target alone, greedy (the tiny models' default), no drafts."""
    messages = [{"role": "user", "content": content}]
    events = tiny_engine("tiny").stream(messages, GenerationSettings(max_tokens=max_tokens), "none")
    return next(event for event in events if isinstance(event, Done)).text


def test_the_llm_cli_gets_plain_greedys_answer(llm_home):
    """The CLI as a user runs it (streamed), then the library without streaming."""
    plain = plain_greedy(ECHO, 24)
    command = [sys.executable, "-m", "llm", "-m", "mlxspec-tiny", "-o", "max_tokens", "24"]
    ran = subprocess.run(
        [*command, "--no-log", ECHO], env=llm_home, capture_output=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr.decode()
    assert ran.stdout.decode() == plain + "\n"
    response = llm.get_model("mlxspec-tiny").prompt(ECHO, stream=False, max_tokens=24)
    assert response.text() == plain
