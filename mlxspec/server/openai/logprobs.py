"""Logprobs in OpenAI's two shapes: chat's `logprobs.content` entries, and text
completions' legacy parallel lists.

Each entry comes from the engine (`mlxspec.logprobs.TokenLogprob`): the model's own
log-probability of an emitted token (before temperature, top-p and top-k) and its
likeliest alternatives. A token's text is the token decoded alone, and its `bytes` that
text in UTF-8: a token holding part of a multi-byte character shows as U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxspec.logprobs import TokenLogprob

MAX_COMPLETION_LOGPROBS = 5  # the legacy `logprobs` of text completions: at most 5


def rendered_logprobs(entries: Sequence[TokenLogprob] | None, chat: bool) -> dict | None:
    """A choice's `logprobs` for these tokens (None where the request did not ask)."""
    if entries is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries)


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                **_token(entry.text, entry.logprob),
                "top_logprobs": [_token(a.text, a.logprob) for a in entry.top],
            }
            for entry in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """Per token: its text, logprob, the likeliest alternatives and the chosen token (so up
    to N + 1 of them, as OpenAI's legacy API), and where its text starts in the answer."""
    return {
        "tokens": [entry.text for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            {**{a.text: a.logprob for a in entry.top}, entry.text: entry.logprob}
            for entry in entries
        ],
        "text_offset": [entry.offset for entry in entries],
    }


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
