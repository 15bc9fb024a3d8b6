"""Speculation and KV quantization as the context grows: the quick bench's copy prompts
and an agent's replayed turn placed behind 1k, 4k and 8k tokens of real code (this
machine's Python standard library), SmolLM2, plain vs prompt lookup, float vs 8-bit vs
4-bit KV; with `--tiny`, random models of each cache kind (plain KV, sliding window,
recurrent hybrid) behind 16k and 32k tokens, where SmolLM2's 8k context ends.

    python benchmarks/long_context.py                          # 1000 4000 7600, 64 tokens
    python benchmarks/long_context.py --context 1000 --tokens 32 --kv float 8
    python benchmarks/long_context.py --tiny --repeats 3       # 16000 32000, 64 tokens
    python benchmarks/long_context.py --render benchmarks/long-context.json

The agent's turn is Claude Code's first request (tests/data/agents/, its system prompt
slimmed as benchmarks/agent_replay.py slims it, shorter still so the 1k row stays near
1k), an answer, and the code as the tool result it read: what the agent sends next.

Per context and KV form: plain greedy runs first, cold (the prompt cache cleared), for
time to first token; prompt lookup then answers the same prompt, its prefill reused
(the target keeps its cache), so its row's TTFT is not a cold one. With `--repeats N`,
N-1 more of each follow, warm, and a row keeps the best decode of its tries (all listed
in the JSON): single decodes swing several-fold on a shared machine. Decode tokens/s is
completion tokens over decode time (after the first token); peak memory is
`mx.get_peak_memory()` over the run. Every lookup answer is compared with plain's under
the same KV form (they must be equal); the KV bytes a token takes in each form are read
off the loaded model (`kv_token_bytes`). Rows go to stdout as a markdown table and to
`--json` (default benchmarks/long-context.json, or long-context-tiny.json). A tiny run
also reads the KV bytes the target's cache holds at the end of each session (all layers,
as allocated) and their ratio to float16's: float16 is what a Mac holds, while the
float32 models here hold twice that. Each prompt and KV form's "speedup kept" line is
lookup's speedup over plain at the longest context over that at the shortest.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
AGENT = "agent-turn"  # Claude Code's next request after it read a file (see above)
AGENT_SYSTEM_CHARS = 1200  # of its system prompt and tools: ~300 tokens
# Random models of each cache kind (tests/tiny_models.py's families, wider windows and
# positions for 32k tokens), small enough that a 32k-token prefill takes seconds here.
# One head of 64 wide, as real models' heads are: 8-bit KV quantizes groups of 64 values.
ONE_HEAD = {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64}
TINY = {
    "llama": {**ONE_HEAD, "num_hidden_layers": 2},  # KVCache in every layer
    "gemma3_text": {**ONE_HEAD, "sliding_window": 512, "max_position_embeddings": 40000},
    "qwen3_5": {**ONE_HEAD, "max_position_embeddings": 40000},  # Gated DeltaNet + KV
}


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


def agent_turn(code: str) -> list[dict]:
    """Claude Code's next request after reading a file: its first request, an answer,
    and `code` as the tool result."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import agent_replay

    system, user = agent_replay.first_request("claude-code")
    system["content"] = system["content"][:AGENT_SYSTEM_CHARS]
    return [
        system,
        user,
        {"role": "assistant", "content": "I'll read the file first."},
        {"role": "user", "content": f"Tool result:\n```python\n{code}\n```"},
    ]


def session_kv_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes, float16 bytes) of the KV the target's cache holds now: every layer with a
    growing history, as allocated; float16's is its element count at 2 bytes (a
    quantized layer's elements counted as the float ones it stands for)."""
    held = half = 0
    for layer in engine.target.cache:
        keys = getattr(layer, "keys", None)
        if keys is None:
            continue
        held += layer.nbytes
        if isinstance(keys, (list, tuple)):  # quantized: (packed, scales, biases)
            words = keys[0].size * 32 // layer.bits  # values a uint32 word packs
            half += 2 * 2 * words
        else:
            half += 2 * (keys.size + layer.values.size)
    return held, half


def run(
    engine: Engine, messages: list[dict] | str, proposer: str, tokens: int, context: int
) -> tuple[Done, int]:
    mx.reset_peak_memory()
    settings = GenerationSettings(max_tokens=tokens, context=context)
    done = list(engine.stream(messages, settings, proposer))[-1]
    assert isinstance(done, Done)
    return done, mx.get_peak_memory()


def measure(
    engine: Engine, asked: list[dict] | str, tokens: int, limit: int, repeats: int
) -> tuple[dict[str, list[tuple[Done, int]]], tuple[int, int]]:
    """Plain cold (its prefill from nothing), then lookup on the prefill it left, then
    `repeats - 1` more of each, warm: method -> [(answer, peak bytes)], and the KV the
    cache held after the cold plain run (`session_kv_bytes`)."""
    engine.reset()  # cold: nothing of an earlier prompt kept
    tries = {"plain": [run(engine, asked, "none", tokens, limit)]}
    held = session_kv_bytes(engine)
    tries["prompt-lookup"] = [run(engine, asked, "prompt-lookup", tokens, limit)]
    for _ in range(repeats - 1):
        for method, runs in tries.items():
            runs.append(run(engine, asked, "none" if method == "plain" else method, tokens, limit))
    return tries, held


def rate(done: Done) -> float:
    """Decode tokens/s: the tokens after the first over the time after it."""
    record = done.record
    return max(record.completion_tokens - 1, 1) / max(record.decode_seconds, 1e-9)


def row(context: int, kv: KVForm, method: str, done: Done, peak: int) -> dict:
    record = done.record
    return {
        "context": context,
        "prompt_tokens": record.prompt_tokens,
        "kv": kv.key,
        "method": method,
        "tokens_per_s": round(rate(done), 2),
        "ttft_s": round(record.time_to_first_token, 2),
        "peak_gb": round(peak / (1 << 30), 3),
        "accepted": f"{record.accepted}/{record.drafted}",
    }


def tiny_models() -> dict:
    """name -> (model, tokenizer): tests/tiny_models.py's random models of each cache kind,
    its byte tokenizer (a token a byte: 32k tokens of code are 32k bytes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import FAMILIES, byte_tokenizer, tiny_model

    tokenizer = byte_tokenizer()
    return {
        f"tiny-{family}": (tiny_model(family, config={**FAMILIES[family], **changes}), tokenizer)
        for family, changes in TINY.items()
    }


def smollm2() -> dict:
    entry = load_registry().get("smollm2-135m")
    runtime = open_runtime(entry, notify=lambda line: print(line, file=sys.stderr))
    return {"smollm2-135m": (runtime.loaded.model, runtime.loaded.tokenizer)}


def prompts(tokenizer, code: str, wanted: list[str], raw: bool) -> dict:
    """prompt id -> what the engine is asked: chat messages, or (a tokenizer without a
    chat template) the same text raw."""
    asks = {p.id: p.text for p in load_suite("code") if p.id in wanted}
    out = {
        prompt_id: [{"role": "user", "content": f"```python\n{code}\n```\n\n{ask}"}]
        for prompt_id, ask in asks.items()
    }
    if AGENT in wanted:
        out[AGENT] = agent_turn(code)
    if raw:
        out = {k: "\n\n".join(m["content"] for m in v) for k, v in out.items()}
    return out


def speedups_kept(rows: list[dict]) -> list[str]:
    """Per model, prompt and KV form: lookup's speedup over plain at the longest context
    over that at the shortest (the goal: >= 0.7 from 1k to 8k)."""
    speed = {}
    for r in rows:
        key = (r["model"], r["prompt"], r["kv"])
        speed.setdefault(key, {}).setdefault(r["context"], {})[r["method"]] = r["tokens_per_s"]
    lines = []
    for (model, prompt, kv), by_context in speed.items():
        low, high = min(by_context), max(by_context)
        if low == high:
            continue
        first, last = (
            by_context[c]["prompt-lookup"] / max(by_context[c]["plain"], 1e-9) for c in (low, high)
        )
        lines.append(
            f"speedup kept at {high} vs {low}: {model} {prompt} {kv}: "
            f"{last:.2f}x / {first:.2f}x = {last / max(first, 1e-9):.2f}"
        )
    return lines


def table(rows: list[dict]) -> str:
    """One markdown row per model, prompt, context and KV form: plain and lookup side by
    side; "vs float" is plain's tokens/s over plain's with float KV on the same prompt."""
    pairs: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["prompt"], r["context"], r["kv"])
        pairs.setdefault(key, {})[r["method"]] = r
    lines = [
        "| model | prompt tokens | prompt | KV | plain tok/s | lookup tok/s | speedup "
        "| TTFT s | peak GB | drafts kept | KV MB held | vs float16 | tok/s vs float | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, prompt, context, kv), pair in pairs.items():
        plain, lookup = pair.get("plain"), pair.get("prompt-lookup")
        if plain is None or lookup is None:
            continue
        base = pairs.get((model, prompt, context, "kv float"), {}).get("plain")
        versus = f"{plain['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        lines.append(
            f"| {model} | {plain['prompt_tokens']} | {prompt} | {kv.removeprefix('kv ')} "
            f"| {plain['tokens_per_s']} | {lookup['tokens_per_s']} "
            f"| {lookup['tokens_per_s'] / max(plain['tokens_per_s'], 1e-9):.2f}x "
            f"| {plain['ttft_s']} | {max(plain['peak_gb'], lookup['peak_gb'])} "
            f"| {lookup['accepted']} | {plain['kv_bytes'] / 1e6:.1f} "
            f"| {plain['kv_bytes'] / max(plain['kv_bytes_float16'], 1):.3f} | {versus} "
            f"| {'yes' if lookup['equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def interleaved(models: dict, forms: list[KVForm], context: int, args) -> dict:
    """Plain decode tokens/s of each KV form, the forms taking turns: each form's engine
    prefills the same prompt once, then `args.interleave` rounds decode it warm, one form
    after the other, so a burst of the machine's other work falls on every form alike.
    Per model and form: the median of the rounds and its ratio to float's; every answer
    compared with that form's first."""
    out = {}
    for name, (model, tokenizer) in models.items():
        code = standard_library_code(tokenizer, context)
        raw = not getattr(tokenizer, "chat_template", None)
        asked = prompts(tokenizer, code, ["code-rename"], raw)["code-rename"]
        limit = context * 5 // 4 + 4096 + args.tokens if args.tiny else 8192
        engines, firsts, rates, equal = {}, {}, {}, True
        for kv in forms:
            engines[kv.key] = Engine(model, tokenizer, name, kv=kv)
            firsts[kv.key] = run(engines[kv.key], asked, "none", args.tokens, limit)[0].token_ids
            rates[kv.key] = []
        for _ in range(args.interleave):
            for key, engine in engines.items():
                done, _ = run(engine, asked, "none", args.tokens, limit)
                rates[key].append(round(rate(done), 1))
                equal = equal and done.token_ids == firsts[key]
        medians = {key: statistics.median(r) for key, r in rates.items()}
        out[name] = {
            key: {
                "tries": rates[key],
                "median": medians[key],
                "vs_float": round(medians[key] / medians["kv float"], 2),
            }
            for key in rates
        }
        out[name]["equal"] = equal
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    return out


def render(path: str) -> None:
    """The tables of a saved run (a partial one too: its finished rows)."""
    saved = json.loads(Path(path).read_text())
    print(table(saved["rows"]))
    for line in saved.get("speedup_kept") or speedups_kept(saved["rows"]):
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, nargs="+")
    parser.add_argument("--kv", nargs="+", default=["float", "8", "4"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", nargs="+", help="default: all; --tiny: code-rename")
    parser.add_argument("--tiny", action="store_true", help="random models at 16k and 32k")
    parser.add_argument("--repeats", type=int, default=1, help="decode tries, best kept")
    parser.add_argument(
        "--interleave", type=int, metavar="ROUNDS", help="only KV forms' plain decode, in turns"
    )
    parser.add_argument("--json")
    parser.add_argument("--render", metavar="JSON", help="print a saved run's tables")
    args = parser.parse_args()
    if args.render:
        return render(args.render)
    contexts = args.context or ([16000, 32000] if args.tiny else [1000, 4000, 7600])
    default_json = "long-context-tiny.json" if args.tiny else "long-context.json"
    out = Path(args.json or Path(__file__).with_name(default_json))

    wanted = args.prompts or (["code-rename"] if args.tiny else [*COPY_PROMPTS, AGENT])
    models = tiny_models() if args.tiny else smollm2()
    # The context a request may fill: SmolLM2's 8192; the random models' positions reach
    # past the longest context asked for.
    limit = max(contexts) * 5 // 4 + 4096 + args.tokens if args.tiny else 8192
    forms = [FLOAT if name == "float" else kv_form(int(name)) for name in args.kv]
    if args.interleave:
        found = interleaved(models, forms, max(contexts), args)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "interleaved": found}, indent=1))
        for name, by_form in found.items():
            print(name, {k: v if k == "equal" else v["vs_float"] for k, v in by_form.items()})
        return
    rows, kv_bytes, unequal = [], {}, 0
    for name, (model, tokenizer) in models.items():
        raw = not getattr(tokenizer, "chat_template", None)
        for kv in forms:
            kv_bytes[f"{name} {kv.key}"] = kv_token_bytes(model, kv)
            engine = Engine(model, tokenizer, name, kv=kv)
            engine.add_proposer(PromptLookup("prompt-lookup", 4, 2, 32))
            for context in contexts:
                code = standard_library_code(tokenizer, context)
                for prompt_id, asked in prompts(tokenizer, code, wanted, raw).items():
                    tries, held = measure(engine, asked, args.tokens, limit, args.repeats)
                    plain = tries["plain"][0][0]
                    answers = [done.token_ids for runs in tries.values() for done, _ in runs]
                    equal = all(answer == plain.token_ids for answer in answers)
                    if not equal:
                        unequal += 1
                        print(f"UNEQUAL: {name} {kv.key} {context} {prompt_id}", file=sys.stderr)
                    for method, runs in tries.items():
                        # The best decode of the tries; the cold try's time to first token.
                        best = max(runs, key=lambda t: rate(t[0]))[0]
                        r = row(context, kv, method, best, max(peak for _, peak in runs))
                        r["ttft_s"] = round(runs[0][0].record.time_to_first_token, 2)
                        r["tokens_per_s_tries"] = [round(rate(done), 2) for done, _ in runs]
                        rows.append({"model": name, "prompt": prompt_id, **r})
                        rows[-1].update(kv_bytes=held[0], kv_bytes_float16=held[1], equal=equal)
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    out.write_text(json.dumps({"rows": rows, "partial": True}, indent=1))
        # What a token's KV takes where the weights are float16, as on a Mac (the model
        # is done with: cast in place). Quantized groups then keep float16 scales.
        model.set_dtype(mx.float16)
        for kv in forms:
            kv_bytes[f"{name} float16 weights {kv.key}"] = kv_token_bytes(model, kv)
    kept = speedups_kept(rows)
    out.write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "rows": rows,
                "kv_token_bytes": kv_bytes,
                "unequal": unequal,
                "speedup_kept": kept,
            },
            indent=1,
        )
    )
    print(table(rows))
    print(f"KV bytes a token: {kv_bytes}; lookup answers unequal to plain's: {unequal}")
    for line in kept:
        print(line)


if __name__ == "__main__":
    main()
