"""Where suffix decoding gains and loses tokens against prompt lookup, round by round.

    python benchmarks/suffix_rounds.py --suite agent [-n 128] [--rounds ID,ID] [--seed] [--oracle-k]
        [--requests]
    python benchmarks/suffix_rounds.py --prompts benchmarks/agent-heldout.jsonl  # replayed

A teacher-forced replay of a suite's plain greedy answers (recorded once with the
model, then kept in the cache dir): every proposer drafts each round as the engine
does (the same adaptive policy, fresh per request as in `mlxspec bench`; the first
round at the prompt's end; the history built up request by request as `bench` does for
a replayed suite, empty otherwise) and keeps the drafted tokens the answer has.
Greedy output is lossless, so that is what the target would have kept. Draft time is
counted as nothing, so the replay is deterministic and rules compare exactly; rounds
are priced with this machine's calibrated verify cost (the "est." of `bench`).

Per suffix round it also drafts, at the same position and length (at least 1), what
prompt lookup and the request's own line (suffix without history) would have, so a
loss shows where it happens: which source drafted, its match, what it kept, what the
others would have kept. `--seed`: suffix reads the shipped seed history too (as
`seed = true` does). `--oracle-k`: each round drafts exactly as many tokens as
will be kept (an upper bound on what any choice of draft length could give).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import Counter
from pathlib import Path

from mlxspec.bench.runners import run_plain_mlx_lm
from mlxspec.bench.suites import REPLAYED, BenchPrompt, load_suite, read_prompts
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.verify_cost import cached_verify_cost, calibration_key
from mlxspec.paths import cache_dir
from mlxspec.proposers import PromptLookup, ProposalContext
from mlxspec.proposers.base import candidates
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.registry.models_toml import load_registry
from mlxspec.suffix.store import HistoryStore

MODEL = "smollm2-135m"


def record_answers(name: str, prompts: list[BenchPrompt], max_tokens: int) -> dict[str, dict]:
    """{prompt id: {class, prompt, answer}}: plain greedy answers, as bench's plain row."""
    path = cache_dir() / f"suffix-rounds-{MODEL}-{name}-{max_tokens}.json"
    if path.exists():
        return json.loads(path.read_text())
    from mlxspec.registry.runtime import open_runtime

    runtime = open_runtime(load_registry().get(MODEL))
    engine, answers = runtime.engine, {}
    for prompt in prompts:
        tokens = engine.encode_chat([{"role": "user", "content": prompt.text}])
        loaded = runtime.loaded
        answer = run_plain_mlx_lm(loaded.model, loaded.tokenizer, tokens, max_tokens).tokens
        answers[prompt.id] = {"class": prompt.kind, "prompt": tokens, "answer": answer}
        print(f"recorded {prompt.id}: {len(answer)} tokens", flush=True)
    path.write_text(json.dumps(answers))
    return answers


def lookup_as_configured() -> PromptLookup:
    """Prompt lookup with the model entry's options (k_max included), as bench runs it."""
    options = load_registry().get(MODEL).proposer("prompt-lookup").options
    return PromptLookup(
        "prompt-lookup", options["ngram_max"], options["ngram_min"], options["k_max"]
    )


def suffix_as_configured(store: HistoryStore | None = None, seed=None) -> SuffixProposer:
    """Suffix with the model entry's options, reading `store` and `seed` as its history."""
    options = load_registry().get(MODEL).proposer("suffix").options
    return SuffixProposer(
        "suffix", store, options["k_max"], options["spec_factor"], options["min_match"], seed=seed
    )


def kept(draft: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def replay(
    kind: str,
    answers: dict,
    replayed: bool,
    max_tokens: int,
    oracle_k: bool,
    seed=None,
    evidence: bool = True,
) -> tuple:
    """Per request {class, tokens, rounds, kept, est}; and for suffix every round's log."""
    cost = cached_verify_cost(calibration_key(MODEL), _uncalibrated)
    with tempfile.TemporaryDirectory() as folder:
        store = HistoryStore(Path(folder))
        make = {
            "prompt-lookup": lambda: lookup_as_configured(),
            "suffix": lambda: suffix_as_configured(store, seed),
        }
        proposer, results, log = make[kind](), {}, []
        for prompt_id, item in answers.items():
            prompt, answer = item["prompt"], item["answer"]
            getattr(proposer, "reset", lambda: None)()
            policy = Policy(cost, read_evidence=evidence)
            position, rounds, drafting, total, steps = 0, 0, 0, 0, 0.0
            while position < min(len(answer), max_tokens):
                ctx = ProposalContext(
                    prompt + answer[:position], None, None, None, prompt_length=len(prompt)
                )
                truth = answer[position:]
                situation, k = policy.choose_among(
                    candidates(proposer, ctx), max_tokens - position - 1
                )
                if oracle_k and situation is not None:
                    k = min(
                        kept(situation.source.propose(ctx, 32).tokens, truth),
                        max_tokens - position - 1,
                    )
                draft = situation.source.propose(ctx, k).tokens[:k] if k else []
                n = kept(draft, truth)
                if draft:
                    policy.update(situation, len(draft), n, 0.0)
                    drafting, total = drafting + 1, total + n
                if kind == "suffix":
                    log.append(_round(prompt_id, position, k, proposer, ctx, draft, n, truth))
                steps += policy.verify_cost(len(draft) + 1)
                position, rounds = position + n + 1, rounds + 1
            if replayed:
                store.add(prompt + answer)
            produced = min(len(answer), max_tokens)
            results[prompt_id] = {
                "class": item["class"],
                "tokens": produced,
                "rounds": rounds,
                "drafting": drafting,
                "kept": total,
                "est": produced / steps,
            }
    return results, log


def _round(prompt_id, position, k, proposer, ctx, draft, n, truth) -> dict:
    """One suffix round, with what lookup and the request's own line would have kept."""
    length = max(k, 1)
    others = {}
    for name, other in (("lookup", lookup_as_configured()), ("request", suffix_as_configured())):
        alone = ProposalContext(ctx.tokens, None, None, None, history=False)
        found = other.situation(alone) is not None
        others[name] = kept(other.propose(alone, length).tokens[:length], truth) if found else None
    match = proposer._match
    return {
        "id": prompt_id,
        "position": position,
        "k": k,
        "kept": n,
        "drafted": len(draft),
        "origin": match.origin if match else None,
        "match": match.length if match else 0,
        "lookup_kept": others["lookup"],
        "request_kept": others["request"],
    }


def _uncalibrated():
    raise SystemExit("no verify-cost calibration cached: run `mlxspec bench` once first")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(results: dict[str, dict], log: list[dict], answers: dict) -> None:
    classes = sorted({item["class"] for item in answers.values()})
    print("| method | " + " | ".join(f"{c}: est. / kept a drafting round" for c in classes) + " |")
    print("|---|" + "---|" * len(classes))
    for kind, rows in results.items():
        cells = []
        for c in classes:
            mine = [r for r in rows.values() if r["class"] == c]
            per_round = sum(r["kept"] for r in mine) / max(1, sum(r["drafting"] for r in mine))
            cells.append(f"{geomean([r['est'] for r in mine]):.3f}x / {per_round:.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    for c in classes:
        counts: Counter[str] = Counter()
        for entry in (e for e in log if answers[e["id"]]["class"] == c):
            lookup, request, mine = entry["lookup_kept"] or 0, entry["request_kept"], entry["kept"]
            if lookup > mine:
                counts[f"lookup keeps more (suffix k={'0' if entry['k'] == 0 else '>0'})"] += 1
                counts["lookup keeps more: tokens"] += lookup - mine
            if mine > lookup:
                counts[f"suffix keeps more (from {entry['origin']})"] += 1
                counts["suffix keeps more: tokens"] += mine - lookup
            if entry["origin"] == "history" and request is not None and request > mine:
                counts["history drafted, the request's line would have kept more"] += 1
        print(f"\n{c}, suffix rounds vs the same position and length:", dict(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="agent")
    parser.add_argument("--prompts", type=Path, help="a JSONL stream instead, replayed")
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", default="", help="print every suffix round of these ids")
    parser.add_argument("--oracle-k", action="store_true")
    parser.add_argument("--seed", action="store_true")
    parser.add_argument("--requests", action="store_true", help="a row per request too")
    parser.add_argument(
        "--no-evidence",
        action="store_true",
        help="the policy ignores the match's own counts: one rate for every position "
        "(suffix's draft length before they were read)",
    )
    args = parser.parse_args()
    if args.prompts:
        name, prompts, replayed = args.prompts.stem, read_prompts(args.prompts), True
    else:
        name, prompts, replayed = args.suite, load_suite(args.suite), args.suite in REPLAYED
    answers = record_answers(name, prompts, args.max_tokens)
    seed = None
    if args.seed:
        from mlxspec.models.loading import load_model
        from mlxspec.suffix.seed import seed_index

        target = load_registry().get(MODEL).target
        index = seed_index(target, load_model(target).tokenizer)
        seed = lambda: index  # noqa: E731
    results, log = {}, []
    for kind in ("prompt-lookup", "suffix"):
        results[kind], rounds = replay(
            kind, answers, replayed, args.max_tokens, args.oracle_k, seed, not args.no_evidence
        )
        log += rounds
    summary(results, log, answers)
    if args.requests:
        print("\n| request | class | prompt-lookup est. | suffix est. |\n|---|---|---|---|")
        for prompt_id, item in answers.items():
            lookup, suffix = (results[kind][prompt_id]["est"] for kind in results)
            print(f"| {prompt_id} | {item['class']} | {lookup:.3f}x | {suffix:.3f}x |")
    for prompt_id in filter(None, args.rounds.split(",")):
        print(f"\n{prompt_id}:")
        for entry in (e for e in log if e["id"] == prompt_id and e["origin"]):
            print(json.dumps({k: v for k, v in entry.items() if k != "id"}))


if __name__ == "__main__":
    main()
