"""Target + draft-model pairs: plain decoding, the draft model, and prompt lookup then the
draft model, each run alone from a cold engine, interleaved, on this machine.

    python -m benchmarks.pairs --ratios 0.05 0.15 0.35 --acceptances 0.9 0.7 0.3 \
        --tokens 96 --repeats 2 [--smollm2] [--qwen-coder FOLDER --weights quantized auto]

Synthetic pairs: a tiny random llama target and a smaller random llama whose one-token
step is sized (measured here) to a share of the target's: 5 % is a 0.5B draft beside a
7B target on a Mac (Qwen2.5-Coder 7B + 0.5B, Qwen3 8B + 0.6B), 15 % a 1B beside an 8B
(Llama 3.1 8B + 3.2 1B), 35 % the 0.5B beside the 1.5B on this CPU. The draft model runs
its real passes (catch-ups and steps, so its cost is real), but the tokens it offers are
the target's own plain answer with each position replaced with probability 1 - A
(`proposers/synthetic.py`): a known per-token acceptance A. The policy is the engine's,
adaptive, pricing the draft by its step measured beside the target's (`DraftCost`).

`--smollm2`: the packaged SmolLM2-135M with its own draft (its first 10 of 30 layers, the
models.toml entry's `draft-model` and `auto`), on a code edit and open text.
`--qwen-coder FOLDER`: the same for the real pair Qwen2.5-Coder 1.5B + 0.5B (Q4_K_M GGUFs in
LM Studio's layout under FOLDER, fetched there by benchmarks/qwen_coder_pair.py), the
target held as `--weights` says, the draft in the form measured cheaper (draft_form.py).

Columns: decode tokens/s (the fastest of the repeats: other work on a shared machine only
slows a run) and its ratio to plain's; the run record's own estimate of its speedup, each
round priced in plain steps timed in that round (`speedup.py`: steadier under load); then
medians: per-token acceptance, tokens drafted, and the drafter's share of the run's time
(`drafter_seconds` of the run record over its wall time). Every run's tokens are checked
against plain greedy's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlxspec  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from tiny_models import VOCAB, byte_tokenizer  # noqa: E402

from mlxspec.decoding.draft_cost import (  # noqa: E402
    measure_draft_cost,
    one_token_steps,
    step_ratio,
)
from mlxspec.decoding.engine import Engine, GenerationSettings  # noqa: E402
from mlxspec.events import Done  # noqa: E402
from mlxspec.proposers import Chain, DraftModel, PromptLookup, Situation  # noqa: E402
from mlxspec.proposers.base import Draft  # noqa: E402
from mlxspec.proposers.synthetic import SyntheticAcceptance  # noqa: E402

TARGET = dict(hidden=1024, layers=8, intermediate=2816, heads=16, kv=8)
DRAFT_LAYERS = 4
DRAFT_WIDTHS = (128, 256, 384, 512, 640, 768, 896)
PROMPT = (
    "def moving_average(values, window):\n    total = 0\n    out = []\n"
    "    for i, value in enumerate(values):\n        total += value\n"
)
SMOLLM2_PROMPTS = {
    "code edit": "Rename `total` to `running` in this function and return the list:\n\n"
    "```python\n" + PROMPT + "        if i >= window:\n            total -= values[i - window]\n"
    "            out.append(total / window)\n    return out\n```",
    "open text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def random_llama(hidden: int, layers: int, intermediate: int, heads: int, kv: int, seed: int):
    mx.random.seed(seed)
    args = dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    model = llama.Model(llama.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    return model


def draft_of_width(width: int):
    return random_llama(width, DRAFT_LAYERS, width * 11 // 4, max(2, width // 64), 2, seed=7)


def sized_draft(target, ratio: float):
    """The draft width whose measured step is nearest `ratio` of the target's."""
    target_step = one_token_steps(target, VOCAB)
    best = None
    for width in DRAFT_WIDTHS:
        model = draft_of_width(width)
        measured = step_ratio(target_step, one_token_steps(model, VOCAB))
        if best is None or abs(measured - ratio) < abs(best[1] - ratio):
            best = (model, measured, width)
        if measured > ratio:
            break
    return best


class SyntheticDraftModel(DraftModel):
    """A draft model that pays for its passes but offers tokens of known acceptance."""

    def __init__(self, model, transcript: list[int], acceptance: float, own_cost, seed: int):
        super().__init__(model, name="draft-model", k_max=16, own_cost=own_cost)
        self.offer = SyntheticAcceptance(transcript, acceptance, VOCAB, seed=seed)

    def situation(self, ctx):
        if self.offer.situation(ctx) is None:
            return None
        return Situation(self, "model", catch_up=super().situation(ctx).catch_up)

    def propose(self, ctx, k: int) -> Draft:
        super().propose(ctx, k)  # the real passes: what drafting costs
        return self.offer.propose(ctx, k)


def timed(engine: Engine, prompt, proposer: str, tokens: int) -> dict:
    """One cold run (nothing kept from the previous one); its record's numbers."""
    engine.reset()
    start = time.perf_counter()
    settings = GenerationSettings(max_tokens=tokens)
    done = list(engine.stream(prompt, settings, proposer))[-1]
    wall = time.perf_counter() - start
    assert isinstance(done, Done)
    record = done.record
    return {
        "tokens": list(done.token_ids),
        "speed": record.tokens_per_second,
        "acceptance": record.acceptance_rate,
        "drafted": record.drafted,
        "share": record.drafter_seconds / wall,
        "estimated": record.speedup_estimate.value,
    }


def compare(engine: Engine, prompt, methods: list[str], tokens: int, repeats: int) -> dict:
    """Every method `repeats` times, interleaved; each checked against plain greedy."""
    runs = {method: [] for method in ["none", *methods]}
    for _ in range(repeats):
        for method in runs:
            runs[method].append(timed(engine, prompt, method, tokens))
    plain = runs["none"][0]["tokens"]
    for method, found in runs.items():
        for run in found:
            assert run["tokens"] == plain, f"{method}: not plain greedy's tokens"
    return {method: summary(found) for method, found in runs.items()}


def summary(found: list[dict]) -> dict:
    """The fastest run's speed (other work on the machine only ever slows a run), the
    medians of the rest."""
    medians = {
        name: statistics.median(run[name] for run in found)
        for name in ("acceptance", "drafted", "share", "estimated")
    }
    return {"speed": max(run["speed"] for run in found), **medians}


def rows_for(label: str, results: dict, names: dict[str, str]) -> list[str]:
    plain = results["none"]["speed"]
    lines = []
    for method, found in results.items():
        ratio = found["speed"] / plain if plain else 0.0
        lines.append(
            f"| {label} | {names.get(method, method)} | {found['speed']:.1f} | {ratio:.2f}x "
            f"| {found['estimated']:.2f}x | {found['acceptance']:.2f} | {found['drafted']:.0f} "
            f"| {100 * found['share']:.1f} % |"
        )
    return lines


def synthetic_pairs(ratios, acceptances, tokens: int, repeats: int) -> list[str]:
    target = random_llama(**{**TARGET, "seed": 0})
    tokenizer = byte_tokenizer()
    engine = Engine(target, tokenizer, "pairs-target-1024x8")
    prompt = list(PROMPT.encode())
    plain = timed(engine, prompt, "none", tokens)["tokens"]  # also calibrates and warms up
    transcript = [*prompt, *plain]
    lines = []
    for ratio in ratios:
        draft, measured, width = sized_draft(target, ratio)
        own_cost = measure_draft_cost(draft, target, VOCAB)
        print(
            f"# pair {ratio:.0%}: draft width {width} x {DRAFT_LAYERS} layers, step measured "
            f"{measured:.3f} (again: {own_cost.step_ratio:.3f}) of the target's",
            file=sys.stderr,
        )
        for acceptance in acceptances:
            proposer = SyntheticDraftModel(draft, transcript, acceptance, own_cost, seed=1)
            lookup = PromptLookup("lookup", 4, 2, 16)
            engine.add_proposer(proposer)
            engine.add_proposer(Chain([lookup, proposer], "lookup+draft"))
            results = compare(engine, prompt, ["draft-model", "lookup+draft"], tokens, repeats)
            label = f"{ratio:.0%} (measured {own_cost.step_ratio:.1%}), A = {acceptance}"
            lines += rows_for(label, results, {"none": "plain"})
            print("\n".join(lines[-3:]), file=sys.stderr)
    return lines


def registry_pair(entry, label: str, tokens: int, repeats: int) -> list[str]:
    """A models.toml entry's `draft-model` and `auto` (lookup, then the draft model)
    against plain decoding, on a code edit and open text."""
    from mlxspec.registry.runtime import open_runtime

    runtime = open_runtime(entry, notify=print)
    for name in ("draft-model", "auto"):
        runtime.proposer(name)
    engine = runtime.engine
    own = engine.proposers["draft-model"].own_cost
    print(f"# {label}: draft step {own.step_ratio:.3f} of the target's ({runtime.weights.reason})")
    lines = []
    for prompt_name, text in SMOLLM2_PROMPTS.items():
        prompt = engine.encode_chat([{"role": "user", "content": text}])
        results = compare(engine, prompt, ["draft-model", "auto"], tokens, repeats)
        names = {"none": "plain", "auto": "lookup+draft"}
        lines += rows_for(f"{label}, {prompt_name}", results, names)
        print("\n".join(lines[-3:]), file=sys.stderr)
    return lines


def smollm2_pair(tokens: int, repeats: int) -> list[str]:
    from mlxspec.registry.models_toml import load_registry

    entry = load_registry().get("smollm2-135m")
    return registry_pair(entry, "SmolLM2 + own 10 layers", tokens, repeats)


def qwen_coder_pair(folder: Path, weights: str, tokens: int, repeats: int) -> list[str]:
    """Qwen2.5-Coder 1.5B drafted by its 0.5B, Q4_K_M GGUFs kept as LM Studio keeps them
    (fetched by benchmarks/qwen_coder_pair.py), the target's weights in `weights`."""
    import os
    import tempfile

    from benchmarks.qwen_coder_pair import pair
    from mlxspec.registry.models_toml import load_registry

    target, draft = pair(folder)
    models = Path(tempfile.mkdtemp()) / "models.toml"
    models.write_text(
        f'[models.qwen-coder]\ntarget = "{target}"\n[models.qwen-coder.defaults]\n'
        f'weights = "{weights}"\n[models.qwen-coder.proposers.draft-model]\n'
        f'draft = "{draft}"\n[models.qwen-coder.proposers.auto]\nkind = "chain"\n'
        'members = ["prompt-lookup", "draft-model"]\n'
    )
    os.environ["MLXSPEC_MODELS"] = str(models)
    entry = load_registry().get("qwen-coder")
    return registry_pair(entry, f"Qwen2.5-Coder 1.5B + 0.5B, {weights}", tokens, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.05, 0.15, 0.35])
    parser.add_argument("--acceptances", type=float, nargs="+", default=[0.9, 0.7, 0.3])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2 and its own draft")
    parser.add_argument(
        "--qwen-coder",
        type=Path,
        metavar="FOLDER",
        help="also the real Qwen2.5-Coder 1.5B + 0.5B pair, kept (or fetched) under FOLDER",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["quantized"],
        help="the real pair's target weights: quantized (a Mac's form), auto, or both",
    )
    args = parser.parse_args()
    lines = synthetic_pairs(args.ratios, args.acceptances, args.tokens, args.repeats)
    if args.smollm2:
        lines += smollm2_pair(args.tokens, args.repeats)
    for weights in args.weights if args.qwen_coder else []:
        lines += qwen_coder_pair(args.qwen_coder, weights, args.tokens, args.repeats)
    print(
        "| pair | method | tok/s | vs plain | estimated | acceptance | drafted | drafter's time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
