"""Conversations on disk: one JSON file each under <data dir>/conversations/, and markdown.

A conversation's messages are what the engine is sent ({"role", "content"}); assistant
messages also carry their provenance segments and run record, so a reopened chat shows
what speculation did, and the model's reasoning apart (`reasoning`, and the segments
marked as its): an assistant's content is its answer alone, so the history sent back to
the model holds no reasoning.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxspec.paths import data_dir

VERSION = 1
TITLE_LENGTH = 60


class StoreError(ValueError):
    """A conversation file that cannot be read: one line naming it."""


def conversations_dir() -> Path:
    return data_dir() / "conversations"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2))
    title: str = "New chat"
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return conversations_dir() / f"{self.id}.json"

    def add_user(self, content: str) -> None:
        if not self.messages:
            self.title = " ".join(content.split())[:TITLE_LENGTH]
        self.messages.append({"role": "user", "content": content})

    def add_assistant(self, content: str, model: str, details: dict[str, Any]) -> None:
        self.messages.append({"role": "assistant", "content": content, "model": model, **details})

    def engine_messages(self) -> list[dict[str, str]]:
        """The chat as the engine takes it: roles and contents only."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def save(self) -> Path:
        """Write atomically (a crash never leaves half a file)."""
        self.updated = _now()
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".part-{os.getpid()}")
        partial.write_text(json.dumps({"version": VERSION, **vars(self)}, indent=1))
        os.replace(partial, path)
        return path

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", "", f"_{self.created}_", ""]
        for message in self.messages:
            if message["role"] == "user":
                lines += ["## You", "", message["content"], ""]
                continue
            lines += [f"## {message.get('model', 'assistant')}", "", message["content"], ""]
            if message.get("cancelled"):
                lines += ["_(cancelled)_", ""]
            if message.get("error"):
                lines += [f"_(failed: {message['error']})_", ""]
        return "\n".join(lines)

    def export_markdown(self) -> Path:
        path = self.path.with_suffix(".md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_markdown())
        return path


def load(path: Path) -> Conversation:
    try:
        data = json.loads(path.read_text())
        return Conversation(
            id=path.stem,  # the file name wins: a renamed file saves to its new name
            title=data["title"],
            created=data["created"],
            updated=data["updated"],
            messages=[{**m, "role": m["role"], "content": m["content"]} for m in data["messages"]],
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreError(f"cannot read conversation {path}: {err}") from None


def saved() -> list[Conversation]:
    """Saved conversations, most recently updated first; unreadable files are skipped."""
    found = []
    for path in conversations_dir().glob("*.json"):
        try:
            found.append(load(path))
        except StoreError:
            continue
    return sorted(found, key=lambda c: c.updated, reverse=True)
