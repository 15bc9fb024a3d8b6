"""Eight clients with different JSON schemas in one batch (`serve --max-batch 8`'s round
loop): every answer valid against its own schema and equal to its constrained plain
answer (the request alone, no drafts); aggregate tokens/s batched vs one at a time.

    python benchmarks/structured_batch.py --model smollm2-135m --proposer prompt-lookup

The schemas are the structured bench suite's, and variations of them (each row its own
grammar). Recorded results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema_rs

from mlxspec.batch.scheduler import Scheduler
from mlxspec.bench.suites import load_suite
from mlxspec.events import Done
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import open_runtime
from mlxspec.settings import GenerationSettings
from mlxspec.structured.grammar import Grammar


def requests() -> list[tuple[str, dict]]:
    """Eight (prompt, schema) pairs, no two schemas alike."""
    schemas = [p for p in load_suite("structured") if p.grammar.kind == "json_schema"]
    found = [(p.text, json.loads(p.grammar.source)) for p in schemas]
    variants = []
    for text, schema in found:
        loose = {**schema, "additionalProperties": True}  # another grammar, same prompt
        variants.append((text, loose))
    return (found + variants)[:8]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--proposer", default="prompt-lookup")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    runtime = open_runtime(load_registry().get(args.model), print)
    engine = runtime.engine
    proposer = runtime.proposer(args.proposer)
    asked = requests()

    def settings(schema: dict) -> GenerationSettings:
        return GenerationSettings(max_tokens=args.max_tokens, grammar=Grammar.json_schema(schema))

    def chat(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    alone, start = [], time.perf_counter()
    for text, schema in asked:
        engine.reset()
        done = list(engine.stream(chat(text), settings(schema), "none"))[-1]
        alone.append(done)
    alone_seconds = time.perf_counter() - start

    scheduler = Scheduler(engine, max_batch=8)
    ids = [scheduler.submit(chat(text), settings(schema), proposer) for text, schema in asked]
    batched: dict[int, Done] = {}
    start = time.perf_counter()
    for out in scheduler.drain():
        batched.update({i: e[-1] for i, e in out.items() if isinstance(e[-1], Done)})
    batch_seconds = time.perf_counter() - start

    tokens = 0
    for (_, schema), plain, request_id in zip(asked, alone, ids):
        done = batched[request_id]
        tokens += len(done.token_ids)
        valid = done.record.finish_reason == "stop" and jsonschema_rs.is_valid(
            schema, json.loads(done.text)
        )
        same = done.token_ids == plain.token_ids
        print(
            f"{'ok' if valid and same else 'FAIL'}  valid={valid} equal={same} "
            f"grammar drafts {done.record.grammar_accepted}/{done.record.grammar_drafted}  "
            f"{done.text[:70]!r}"
        )
    plain_tokens = sum(len(d.token_ids) for d in alone)
    print(
        f"batch of 8 ({args.proposer}): {tokens / batch_seconds:.1f} tok/s; "
        f"one at a time, plain constrained: {plain_tokens / alone_seconds:.1f} tok/s; "
        f"ratio {tokens / batch_seconds / (plain_tokens / alone_seconds):.2f}x"
    )


if __name__ == "__main__":
    main()
