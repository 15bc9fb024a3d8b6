"""Speculation and KV quantization as the context grows: the quick bench's copy prompts
placed behind 1k, 4k and 8k tokens of real code (this machine's Python standard library),
SmolLM2, plain vs prompt lookup, float vs 8-bit vs 4-bit KV.

    python benchmarks/long_context.py                          # 1000 4000 7600, 64 tokens
    python benchmarks/long_context.py --context 1000 --tokens 32 --kv float 8

Per context and KV form: plain greedy runs first, cold (the prompt cache cleared), for
time to first token; prompt lookup then answers the same prompt, its prefill reused
(the target keeps its cache), so its row's TTFT is not a cold one. Decode tokens/s is
completion tokens over decode time (after the first token); peak memory is
`mx.get_peak_memory()` over the run. Every lookup answer is compared with plain's under
the same KV form (they must be equal); the KV bytes a token takes in each form are read
off the loaded model (`kv_token_bytes`). Rows go to stdout as a markdown table and to
`--json` (default benchmarks/long-context.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import mlxspec  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

# isort: split
import mlx.core as mx

from mlxspec.bench.suites import load_suite
from mlxspec.decoding.engine import Engine
from mlxspec.events import Done
from mlxspec.models.kv_form import FLOAT, KVForm, kv_form, kv_token_bytes
from mlxspec.proposers import PromptLookup
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import open_runtime
from mlxspec.settings import GenerationSettings

COPY_PROMPTS = ("code-rename", "code-fix")  # the quick bench's copy-heavy edits


def standard_library_code(tokenizer, tokens: int) -> str:
    """`tokens` tokens of this machine's standard library, whole files in name order."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    text, have = "", 0
    for path in sorted(folder.glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        text += f"# {path.name}\n{source}\n"
        have += len(tokenizer.encode(source))
        if have > tokens * 1.2:
            break
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


def run(engine: Engine, messages: list[dict], proposer: str, tokens: int) -> tuple[Done, int]:
    mx.reset_peak_memory()
    settings = GenerationSettings(max_tokens=tokens)
    done = list(engine.stream(messages, settings, proposer))[-1]
    assert isinstance(done, Done)
    return done, mx.get_peak_memory()


def row(context: int, kv: KVForm, method: str, done: Done, peak: int) -> dict:
    record = done.record
    decoded = max(record.completion_tokens - 1, 1)
    return {
        "context": context,
        "prompt_tokens": record.prompt_tokens,
        "kv": kv.key,
        "method": method,
        "tokens_per_s": round(decoded / max(record.decode_seconds, 1e-9), 2),
        "ttft_s": round(record.time_to_first_token, 2),
        "peak_gb": round(peak / (1 << 30), 3),
        "accepted": f"{record.accepted}/{record.drafted}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=[1000, 4000, 7600])
    parser.add_argument("--kv", nargs="+", default=["float", "8", "4"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", nargs="+", default=list(COPY_PROMPTS))
    parser.add_argument("--json", default=str(Path(__file__).with_name("long-context.json")))
    args = parser.parse_args()

    entry = load_registry().get("smollm2-135m")
    runtime = open_runtime(entry, notify=lambda line: print(line, file=sys.stderr))
    model, tokenizer = runtime.loaded.model, runtime.loaded.tokenizer
    forms = [FLOAT if name == "float" else kv_form(int(name)) for name in args.kv]
    asks = {p.id: p.text for p in load_suite("code") if p.id in args.prompts}
    rows, kv_bytes, unequal = [], {}, 0
    for kv in forms:
        kv_bytes[kv.key] = kv_token_bytes(model, kv)
        engine = Engine(model, tokenizer, "smollm2-135m", kv=kv)
        engine.add_proposer(PromptLookup("prompt-lookup", 4, 2, 32))
        for context in args.context:
            code = standard_library_code(tokenizer, context)
            for prompt_id, ask in asks.items():
                messages = [{"role": "user", "content": f"```python\n{code}\n```\n\n{ask}"}]
                engine.reset()  # cold: nothing of an earlier prompt kept
                plain, plain_peak = run(engine, messages, "none", args.tokens)
                lookup, lookup_peak = run(engine, messages, "prompt-lookup", args.tokens)
                if lookup.token_ids != plain.token_ids:
                    unequal += 1
                    print(f"UNEQUAL: {kv.key} {context} {prompt_id}", file=sys.stderr)
                for method, done, peak in (
                    ("plain", plain, plain_peak),
                    ("prompt-lookup", lookup, lookup_peak),
                ):
                    rows.append({"prompt": prompt_id, **row(context, kv, method, done, peak)})
                    print(json.dumps(rows[-1]), file=sys.stderr)
    Path(args.json).write_text(
        json.dumps({"rows": rows, "kv_token_bytes": kv_bytes, "unequal": unequal}, indent=1)
    )
    print("| context | prompt | KV | method | tokens/s | TTFT s | peak GB | accepted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['prompt_tokens']} | {r['prompt']} | {r['kv']} | {r['method']} | "
            f"{r['tokens_per_s']} | {r['ttft_s']} | {r['peak_gb']} | {r['accepted']} |"
        )
    print(f"KV bytes a token: {kv_bytes}; lookup answers unequal to plain's: {unequal}")


if __name__ == "__main__":
    main()
