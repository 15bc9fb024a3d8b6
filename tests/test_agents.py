"""What the coding agents send, replayed against the real server: the requests recorded from
the agent CLIs themselves (tests/data/agents/, recorded by benchmarks/agents/run.py), so a
change that would refuse what an agent sends fails here, without npm.

Each recorded request is far over a tiny model's context (a 15-20k-token system prompt and
tools): it must get the one error the agent acts on, in its dialect, at once. Slimmed to fit
(the agent's own fields kept, its prompt and tools cut), it must be answered in the shape
the agent reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import TinyProvider, serving

from mlxspec.server import ServerLimits
from mlxspec.server.anthropic.translate import CountTokensRequest, conversation, dropped_tools

AGENTS = Path(__file__).parent / "data" / "agents"


def recorded(name: str) -> dict:
    return json.loads((AGENTS / name).read_text())


CLAUDE_CODE = recorded("claude-code-2.1.332.messages.json")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # the server's own output limit below what agents ask for (32,000)
    with serving(TinyProvider(), preload="tiny", limits=ServerLimits(max_tokens=64)) as url:
        yield url


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


# --- Claude Code ------------------------------------------------------------------------


def test_claude_codes_request_reads_as_one_system_prompt_and_the_tools_it_can_run():
    body = CountTokensRequest.model_validate(CLAUDE_CODE["body"])
    chat = conversation(body, {})
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    system = chat.messages[0]["content"]
    assert "You are a Claude agent" in system  # the `system` field
    assert "# Environment" in system  # the system turn among the messages, after it
    assert system.index("You are a Claude agent") < system.index("# Environment")
    names = [tool["function"]["name"] for tool in chat.tools]
    assert "Bash" in names and "DeferredToolPlaceholder" not in names
    assert dropped_tools(body) == ["DeferredToolPlaceholder"]


def test_claude_codes_request_over_the_context_is_anthropics_prompt_too_long(base_url):
    """Claude Code compacts its conversation on "prompt is too long"; asked 32,000 tokens,
    it is not refused for that."""
    body = {**CLAUDE_CODE["body"], "model": "tiny"}
    refused = httpx.post(
        f"{base_url}/v1/messages?beta=true", json=body, headers=CLAUDE_CODE["headers"], timeout=30
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("prompt is too long: ")
    assert error["error"]["message"].endswith(" tokens > 1024 maximum")
    assert refused.elapsed.total_seconds() < 5


def slim_claude_code() -> dict:
    body = json.loads(json.dumps(CLAUDE_CODE["body"]))
    body["model"] = "tiny"
    body["system"] = [
        {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}
    ]
    body["messages"][0]["content"] = [{"type": "text", "text": "Reply with the single word: pong"}]
    body["messages"][1]["content"] = [{"type": "text", "text": "# Environment\nLinux."}]
    body["tools"] = [
        {**tool, "description": tool["name"], "input_schema": {"type": "object"}}
        for tool in body["tools"]
        if tool["name"] in ("Bash", "DeferredToolPlaceholder")
    ]
    return body


def test_claude_codes_request_slimmed_to_fit_is_answered_as_it_streams_them(base_url):
    with httpx.stream(
        "POST",
        f"{base_url}/v1/messages?beta=true",
        json=slim_claude_code(),
        headers=CLAUDE_CODE["headers"],
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-mlxspec-dropped-tools"] == "DeferredToolPlaceholder"
        events = sse_events(streamed)
    kinds = [event["type"] for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    delta = next(event for event in events if event["type"] == "message_delta")
    # 32,000 asked, the server's 64 granted
    assert delta["x_mlxspec"]["max_tokens"] == 64
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn")


# --- The chat-completions agents: Qwen Code, opencode (its title request and its turn),
# Continue CLI ----------------------------------------------------------------------------

CHAT_AGENTS = [
    "qwen-code-0.24.4.chat.json",
    "opencode-1.18.33.title.chat.json",
    "opencode-1.18.33.chat.json",
    "continue-cli-1.5.47.chat.json",
]


@pytest.mark.parametrize("name", CHAT_AGENTS)
def test_a_chat_agents_request_over_the_context_is_context_length_exceeded(base_url, name):
    body = {**recorded(name)["body"], "model": "tiny"}
    refused = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert "maximum context length is 1024 tokens" in error["message"]


def slim_chat(body: dict) -> dict:
    """The agent's request with its own fields (max_tokens, stream_options, tools, parts
    as lists) kept, its texts cut to fit a 1,024-byte context."""
    body = json.loads(json.dumps(body))
    body["model"] = "tiny"
    for message in body["messages"]:
        if isinstance(message["content"], list):
            message["content"] = [
                {**part, "text": part["text"][:40]} for part in message["content"]
            ]
        else:
            message["content"] = message["content"][:40]
    body["tools"] = [
        {
            "type": "function",
            "function": {**tool["function"], "description": "", "parameters": {"type": "object"}},
        }
        for tool in body.get("tools", [])[:2]
    ] or None
    return {key: value for key, value in body.items() if value is not None}


@pytest.mark.parametrize("name", CHAT_AGENTS)
def test_a_chat_agents_request_slimmed_to_fit_is_answered(base_url, name):
    body = slim_chat(recorded(name)["body"])
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    if body.get("stream_options", {}).get("include_usage"):
        assert chunks[-1]["usage"]["completion_tokens"] > 0
    finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finished and finished[-1]["x_mlxspec"]["max_tokens"] <= 64
