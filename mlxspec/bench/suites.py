"""Prompts for the bench: the shipped suites and the user's own JSONL file.

Shipped prompts live in `prompts/*.jsonl`, one `{"id", "class", "prompt"}` object per
line, the same format `--prompts` reads (there `id` is optional). Each prompt is one
user message, put through the model's chat template by the engine. A prompt may carry
`"schema"` (a JSON schema object) or `"regex"`: its answer is then constrained to it, in
every row (mlx-lm's plain loop through a logits processor), and `@free` rows run it
unconstrained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mlxspec.bench import BenchError
from mlxspec.structured.grammar import Grammar

SUITE_FILES = {
    "code": "code.jsonl",
    "chat": "chat.jsonl",
    "summarize": "summarize.jsonl",
    "agent": "agent.jsonl",
    "structured": "structured.jsonl",
}
# Suites replayed in order, with the model's history (suffix decoding) building up from
# one request to the next: sessions of similar requests, as an agent or editor sends.
REPLAYED = ("agent",)
# Suites of their own, never in `all`: constrained answers (forced tool calls, small
# JSON) measure the grammar's cost and its free drafts, not the prompts' kinds.
APART = ("structured",)
# Two copy-heavy edits, one summary with quotes, one question over a document, one open
# question: each kind of work once, small enough for a few minutes on a laptop CPU.
QUICK = ("code-rename", "code-fix", "summarize-council", "qa-handbook", "chat-habits")
SUITES = ("quick", *SUITE_FILES, "all")
KEYS = ("id", "class", "prompt", "schema", "regex")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    kind: str  # the prompt class: code-edit, code-new, summarize, doc-qa, chat, or the user's
    text: str
    grammar: Grammar | None = None  # what the answer must match


def load_suite(name: str) -> list[BenchPrompt]:
    """The prompts of a shipped suite."""
    if name not in SUITES:
        raise BenchError(f"unknown suite {name!r}; choose one of: {', '.join(SUITES)}")
    independent = [file for suite, file in SUITE_FILES.items() if suite not in (*REPLAYED, *APART)]
    files = independent if name in ("quick", "all") else [SUITE_FILES[name]]
    prompts = []
    for file in files:
        source = resources.files("mlxspec.bench") / "prompts" / file
        prompts += parse_prompts(source.read_text(encoding="utf-8"), file)
    if name == "quick":
        by_id = {prompt.id: prompt for prompt in prompts}
        return [by_id[prompt_id] for prompt_id in QUICK]
    return prompts


def read_prompts(path: Path) -> list[BenchPrompt]:
    """The user's prompts file; any problem is one BenchError naming the file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BenchError(f"cannot read prompts file {path}: {err}") from None
    return parse_prompts(text, str(path))


def parse_prompts(text: str, source: str) -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt(line, f"{source} line {number}", f"line{number}"))
    if not prompts:
        raise BenchError(f'{source}: no prompts; write one {{"prompt": ..., "class": ...}} a line')
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.id in seen:
            raise BenchError(f"{source}: prompt id {prompt.id!r} appears twice; ids must differ")
        seen.add(prompt.id)
    return prompts


def _prompt(line: str, where: str, default_id: str) -> BenchPrompt:
    shape = '{"prompt": "...", "class": "..."}'
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise BenchError(f"{where}: not valid JSON ({err.msg}); write {shape}") from None
    if not isinstance(data, dict):
        raise BenchError(f"{where}: expected a JSON object like {shape}")
    unknown = [key for key in data if key not in KEYS]
    if unknown:
        raise BenchError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(KEYS)}")
    prompt, kind = data.get("prompt"), data.get("class", "custom")
    prompt_id = data.get("id", default_id)
    if not isinstance(prompt, str) or not prompt.strip():
        raise BenchError(f"{where}: 'prompt' must be a non-empty string")
    for key, value in (("class", kind), ("id", prompt_id)):
        if not isinstance(value, str) or not value.strip():
            raise BenchError(f"{where}: {key!r} must be a non-empty string")
    return BenchPrompt(prompt_id, kind, prompt, _grammar(data, where))


def _grammar(data: dict, where: str) -> Grammar | None:
    """The prompt's `schema` (an object) or `regex` (a string), one at most."""
    schema, regex = data.get("schema"), data.get("regex")
    if schema is not None and regex is not None:
        raise BenchError(f"{where}: give 'schema' or 'regex', not both")
    if schema is not None:
        if not isinstance(schema, dict):
            raise BenchError(f"{where}: 'schema' must be a JSON schema object")
        return Grammar.json_schema(schema)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise BenchError(f"{where}: 'regex' must be a non-empty string")
        return Grammar("regex", regex)
    return None
