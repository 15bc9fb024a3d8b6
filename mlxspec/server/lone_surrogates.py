"""One rule for text that is not Unicode: a lone UTF-16 surrogate becomes U+FFFD.

A JavaScript client that cuts a string inside an emoji sends half a surrogate pair, as the
JSON escape `\\ud83d` with no low half after it. Python's JSON reader keeps it as a lone
surrogate, which no tokenizer encodes and no JSON answer can echo (UTF-8 has no spelling
for it). As most servers (and browsers' TextDecoder) do, it is read as U+FFFD, the
replacement character, for every dialect and every field, before any route reads the
body: the escape `\\ud83d` is rewritten `\\ufffd` in the bytes (the same length, so
`Content-Length` stays true). Raw UTF-8 cannot hold a surrogate, so escapes are the only
way one arrives.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Every escape in turn, so that `\\\\ud800` (an escaped backslash, then text) is never read
# as one: a surrogate pair (kept), a lone surrogate (replaced), any other escape (kept).
ESCAPE = re.compile(
    rb"\\(?:(?P<pair>u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?P<lone>u[dD][89a-fA-F][0-9a-fA-F]{2})|.)",
    re.DOTALL,
)
REPLACEMENT = rb"\ufffd"


def replace_lone_surrogates(body: bytes) -> bytes:
    """`body` (JSON) with each escaped lone surrogate spelled U+FFFD's escape."""
    if b"\\u" not in body:
        return body
    return ESCAPE.sub(lambda found: REPLACEMENT if found["lone"] else found[0], body)


class SurrogateRepair:
    """ASGI middleware: the request body, whole, with lone surrogates replaced. The body
    is read when the route first asks for it, so a body-size refusal raised while it
    arrives still reaches the error handlers."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_read = False

        async def repaired() -> Message:
            nonlocal body_read
            if body_read:  # after the body: a disconnect, which streams listen for
                return await receive()
            body_read = True
            chunks = []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            body = replace_lone_surrogates(b"".join(chunks))
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, repaired, send)
