"""Prompts with tools, over real chat templates: the tools are in the prompt, an assistant's
calls and the tools' results are rendered, and a template without tool support gets all of
it as text in the fallback format, never dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import byte_tokenizer

from mlxspec.markup.chat_template import encode_chat, render_chat
from mlxspec.markup.conversation import Conversation
from mlxspec.settings import GenerationError

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Its name"}},
        },
    },
}
CALL = {
    "id": "call12345",  # nine characters: Mistral's template wants them so
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "18C, sunny"},
]


def rendered(template: str | None, messages=HISTORY, tools=(WEATHER,), **kwargs) -> str:
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.chat_template = (TEMPLATES / template).read_text() if template else None
    return render_chat(tokenizer, Conversation(messages, list(tools) or None, kwargs))


@pytest.mark.parametrize(
    "template, call, result",
    [
        (
            "qwen3.jinja",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>",
        ),
        (
            "hermes3.jinja",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<|im_start|>tool\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>",
        ),
        (
            "llama3.3.jinja",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            # (its `is iterable` holds for a string too: the result is written as JSON)
            '<|start_header_id|>ipython<|end_header_id|>\n\n"18C, sunny"<|eot_id|>',
        ),
        (
            "mistral-nemo.jinja",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "call12345"}]',
            '[TOOL_RESULTS]{"content": 18C, sunny, "call_id": "call12345"}[/TOOL_RESULTS]',
        ),
    ],
)
def test_templates_with_tools_get_the_tools_the_call_and_its_result(template, call, result):
    prompt = rendered(template)
    assert '"get_weather"' in prompt and "The weather in a city" in prompt
    assert call in prompt
    assert result in prompt


@pytest.mark.parametrize("template", ["smollm2.jinja", "deepseek-r1-distill.jinja", None])
def test_a_template_without_tool_support_gets_them_as_text_in_the_fallback_format(template):
    prompt = rendered(template)
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18C, sunny\n</tool_response>" in prompt


def test_the_fallback_describes_tools_in_the_system_turn_the_user_wrote():
    system = {"role": "system", "content": "Be brief."}
    prompt = rendered("smollm2.jinja", [system, *HISTORY])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert "You are a helpful AI assistant named SmolLM" not in prompt


def test_no_tools_leaves_the_prompt_as_it_was():
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.chat_template = (TEMPLATES / "smollm2.jinja").read_text()
    messages = [{"role": "user", "content": "hi"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert encode_chat(tokenizer, messages, generation_prompt=True) == expected
    assert encode_chat(tokenizer, Conversation(messages), generation_prompt=True) == expected


def test_template_arguments_reach_the_template():
    ask = HISTORY[:1]
    assert rendered("qwen3.jinja", ask, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rendered("qwen3.jinja", ask, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_a_template_that_refuses_the_messages_says_why():
    bad_id = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**CALL, "id": "call_1"}]}]
    with pytest.raises(GenerationError, match="Tool call IDs should be alphanumeric"):
        rendered("mistral-nemo.jinja", bad_id)
