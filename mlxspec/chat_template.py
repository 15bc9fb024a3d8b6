"""Conversations as token ids, through the model's own chat template."""

from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    """Token ids of `messages` ({"role", "content"}); with `generation_prompt`, ready for
    the assistant's answer. Models without a template get the contents on lines."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode("\n".join(m["content"] for m in messages))
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True
        )
    )
