"""`mlxspec bench --from-history`: each proposer's acceptance on the user's own chats.

Teacher-forced replay, so it is fast: the saved assistant answers were the target's
own output, so they stand in for what the target would say. For every answer the
replay walks it as generation would: the proposer drafts from the real context (with
the adaptive policy choosing k, as in a live run), is credited with the drafted tokens
that match the answer, and the walk advances past them plus one target token. Only
the proposers run; the target is not needed, so self-speculation (which drafts with
the target's own cache) is left out. Estimated speedup = answer tokens / the cost of
the rounds in target steps, from this machine's calibrated verify cost.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlxspec.bench import BenchError
from mlxspec.decoding.policy import Policy
from mlxspec.proposers import ProposalContext
from mlxspec.proposers.base import candidates
from mlxspec.registry.runtime import Runtime
from mlxspec.sampling import SamplingSettings, TokenScorer

REPLAYABLE_KINDS = ("prompt-lookup", "draft-model", "chain")


def read_history(directory: Path) -> list[list[dict[str, str]]]:
    """The message lists of the saved conversations that have an assistant answer."""
    if not directory.is_dir():
        raise BenchError(f"no saved conversations: {directory} does not exist (chat first)")
    chats = []
    for path in sorted(directory.glob("*.json")):
        try:
            messages = json.loads(path.read_text())["messages"]
            chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        except (OSError, ValueError, KeyError, TypeError):
            raise BenchError(f"cannot read saved conversation {path}") from None
        if any(m["role"] == "assistant" for m in chat):
            chats.append(chat)
    if not chats:
        raise BenchError(f"no saved conversation with an answer in {directory}")
    return chats


def answer_turns(runtime: Runtime, chats: list[list[dict[str, str]]]) -> list[tuple[list, list]]:
    """(prompt tokens, answer tokens) for every assistant message, chat-templated."""
    engine, turns = runtime.engine, []
    for chat in chats:
        for i, message in enumerate(chat):
            if message["role"] != "assistant" or i == 0:
                continue
            prompt = engine.encode_chat(chat[:i])
            answer = engine.tokenizer.encode(message["content"], add_special_tokens=False)
            if answer:
                turns.append((prompt, answer))
    return turns


def replay(runtime: Runtime, proposer: str, turns: list[tuple[list, list]]) -> dict[str, Any]:
    engine = runtime.engine
    name = runtime.proposer(proposer)
    source = engine.proposers[name]
    policy = Policy(engine.verify_cost)
    scorer, rng = TokenScorer(SamplingSettings()), np.random.default_rng(0)
    tokens_total = drafted = accepted = rounds = 0
    cost = 0.0  # in target steps
    for prompt, answer in turns:
        position = 0
        while position < len(answer):
            ctx = ProposalContext(
                prompt + answer[:position], scorer, rng, engine.target, prompt_length=len(prompt)
            )
            situation, k = policy.choose_among(
                candidates(source, ctx), len(answer) - position - 1
            )  # as the engine chooses: a chain's best member
            draft, started = [], time.perf_counter()
            if k:
                draft = situation.source.propose(ctx, k).tokens[:k]
            draft_seconds = time.perf_counter() - started
            n = 0
            while n < len(draft) and draft[n] == answer[position + n]:
                n += 1
            if draft:
                policy.update(situation, len(draft), n, draft_seconds)
                drafted, accepted, rounds = drafted + len(draft), accepted + n, rounds + 1
            per_draft = policy.draft_cost.get(situation.source.name, 0.0) if draft else 0.0
            cost += policy.verify_cost(len(draft) + 1) + len(draft) * per_draft
            position += n + 1
        tokens_total += len(answer)
    return {
        "proposer": name,
        "answers": len(turns),
        "answer_tokens": tokens_total,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_length": round(accepted / rounds, 3) if rounds else 0.0,
        "estimated_speedup": round(tokens_total / cost, 3) if cost else 1.0,
    }


def replay_history(runtime: Runtime, directory: Path, notify) -> dict[str, Any]:
    turns = answer_turns(runtime, read_history(directory))
    runtime.engine.verify_cost  # noqa: B018  (calibrate before replaying)
    rows = []
    for config in runtime.entry.proposers.values():
        if config.kind not in REPLAYABLE_KINDS:
            continue
        notify(f"replaying {len(turns)} answers with {config.name}")
        rows.append(replay(runtime, config.name, turns))
    return {"model": runtime.entry.name, "history": str(directory), "rows": rows}


def history_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"## mlxspec bench --from-history: {result['model']} ({result['history']})",
        "",
        "| proposer | answers | tokens | accept | acc len | est. speedup |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['proposer']} | {row['answers']} | {row['answer_tokens']} | "
            f"{row['acceptance_rate']:.0%} | {row['mean_accepted_length']:.2f} | "
            f"{row['estimated_speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
