"""Conversations as token ids, through the model's own chat template.

A `Conversation`'s tools, assistant tool calls and tool results go to the template in the
form Hugging Face templates expect. A template that knows nothing of tools (its text never
says `tools`, as SmolLM2's) would drop them in silence, so there they are written into the
conversation as text first, in one fallback format (Hermes-style, as LM Studio does): the
tools described in the system turn, a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in the assistant's turn, and a result as `<tool_response>...</tool_response>` in a user
turn. The output parser (output_parser.py) reads calls in the same format back.

An assistant turn's earlier reasoning is its `reasoning_content`, the name most templates
read (Qwen's, Gemma 4's); gpt-oss's reads `thinking`, and refuses a call turn that has both
text and reasoning, so there the text joins the reasoning: its template writes either into
the same analysis message. Its template renders only an assistant turn's first call, and
names each result after the last call, so there a turn of several calls (another model's
parallel calls) becomes one turn per call, each followed by its own result.
"""

from __future__ import annotations

import json
from typing import Any

from mlxspec.markup.conversation import Conversation
from mlxspec.settings import GenerationError

FALLBACK_CALL_START, FALLBACK_CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"
THINKING_FIELD = "message.thinking"  # gpt-oss's template reads earlier reasoning there


def encode_chat(
    tokenizer, conversation: Conversation | list[dict], *, generation_prompt: bool
) -> list[int]:
    """Token ids of a conversation (or bare messages, {"role", "content"}); with
    `generation_prompt`, ready for the assistant's answer."""
    text = render_chat(tokenizer, conversation, generation_prompt=generation_prompt)
    if template_text(tokenizer) is None:
        return tokenizer.encode(text)
    # A template writes the special tokens (BOS included) itself, as HF's does when it
    # tokenizes: nothing may be added here.
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(
    tokenizer, conversation: Conversation | list[dict], *, generation_prompt: bool = True
) -> str:
    """The prompt's text. Models without a template get the contents on lines (tools and
    calls in the fallback format); a template's own error (a role it refuses, a tool call id
    it finds malformed) is the request's fault: GenerationError, with the template's words."""
    if not isinstance(conversation, Conversation):
        conversation = Conversation(conversation)
    template = template_text(tokenizer)
    if template is None:
        return "\n".join(m["content"] or "" for m in _in_fallback_form(conversation).messages)
    if "tools" not in template:
        conversation = _in_fallback_form(conversation)
    if THINKING_FIELD in template:
        conversation = _with_thinking(_one_call_per_turn(conversation))
    # Tools only where there are some: a tokenizer's own renderer may not take the argument.
    tools = {"tools": conversation.tools} if conversation.tools else {}
    try:
        return tokenizer.apply_chat_template(
            conversation.messages,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **tools,
            **conversation.template_kwargs,
        )
    except Exception as err:  # jinja's TemplateError from raise_exception, a TypeError...
        raise GenerationError(f"the model's chat template refused the messages: {err}") from None


def template_text(tokenizer) -> str | None:
    """The chat template's source (named templates, as some tokenizers hold, together);
    None for a model without one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(template.values())
    return template or None


def _with_thinking(conversation: Conversation) -> Conversation:
    """Each assistant turn's reasoning as `thinking` too; in a call turn, its text joined."""
    messages = []
    for message in conversation.messages:
        reasoning = message.get("reasoning_content")
        if reasoning and message["role"] == "assistant":
            message = {**message, "thinking": reasoning}
            if message.get("tool_calls") and message.get("content"):
                message["thinking"] = f"{reasoning}\n\n{message['content']}"
                message["content"] = ""
        messages.append(message)
    return Conversation(messages, conversation.tools, conversation.template_kwargs)


def _one_call_per_turn(conversation: Conversation) -> Conversation:
    """Each assistant turn of several calls as one turn per call, each followed by the
    results that answer it (the turn's text and reasoning stay with its first call)."""
    messages, pending = [], list(conversation.messages)
    while pending:
        message = pending.pop(0)
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or len(calls) < 2:
            messages.append(message)
            continue
        results = []
        while pending and pending[0]["role"] == "tool":
            results.append(pending.pop(0))
        for index, call in enumerate(calls):
            turn = {**message, "tool_calls": [call]} if index == 0 else {}
            messages.append(turn or {"role": "assistant", "content": "", "tool_calls": [call]})
            answers = [r for r in results if r.get("tool_call_id") == call.get("id")]
            messages += answers
            results = [r for r in results if r not in answers]
        messages += results  # results that name no call here stay, in order
    return Conversation(messages, conversation.tools, conversation.template_kwargs)


def _has_tool_parts(conversation: Conversation) -> bool:
    """Whether the conversation has tools, tool calls or tool results to render."""
    return bool(conversation.tools) or any(
        m.get("tool_calls") or m["role"] == "tool" for m in conversation.messages
    )


def _in_fallback_form(conversation: Conversation) -> Conversation:
    """The conversation with tools, calls and results written as text in the fallback
    format, so a template without tool support renders all of it."""
    if not _has_tool_parts(conversation):
        return conversation
    messages: list[dict[str, Any]] = []
    for message in conversation.messages:
        if message["role"] == "tool":
            response = f"{RESPONSE_START}\n{message['content']}\n{RESPONSE_END}"
            if messages and messages[-1].get("tool_results"):  # results of one turn: one turn
                messages[-1]["content"] += "\n" + response
            else:
                messages.append({"role": "user", "content": response, "tool_results": True})
        elif message.get("tool_calls"):
            calls = [_fallback_call_text(call["function"]) for call in message["tool_calls"]]
            text = "\n".join(filter(None, [message.get("content") or "", *calls]))
            messages.append({"role": "assistant", "content": text})
        else:
            messages.append(dict(message))
    for message in messages:
        message.pop("tool_results", None)
    if conversation.tools:
        described = _tools_description(conversation.tools)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{described}"
        else:
            messages.insert(0, {"role": "system", "content": described})
    return Conversation(messages, None, conversation.template_kwargs)


def _fallback_call_text(function: dict[str, Any]) -> str:
    """One call in the fallback format (`function`: {"name", "arguments": dict})."""
    call = {"name": function["name"], "arguments": function.get("arguments") or {}}
    return f"{FALLBACK_CALL_START}\n{json.dumps(call, ensure_ascii=False)}\n{FALLBACK_CALL_END}"


def _tools_description(tools: list[dict[str, Any]]) -> str:
    """What the system turn says of the tools in the fallback format."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = _fallback_call_text({"name": "<function-name>", "arguments": {"<arg>": "<value>"}})
    return (
        "You can call functions to help answer. Their signatures, one JSON object a line, are "
        f"within <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call one, answer with a JSON object of its name and arguments within "
        f"{FALLBACK_CALL_START}{FALLBACK_CALL_END} tags, one call per tag:\n{example}\n"
        f"A function's result comes back within {RESPONSE_START}{RESPONSE_END} tags."
    )
