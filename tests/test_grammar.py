"""Structured output inside the speculative loop: with a grammar, the output equals
constrained plain decoding (greedy token for token, sampling in law), for every proposer,
trees and the batch; forbidden drafts never reach the verify pass; forced tokens are
drafted for free.

The reference is written here, independently of mlxspec's round loop: one token at a
time through an mlx-lm prompt cache, each step's logits masked by an llguidance matcher
of its own.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher
from lossless import assert_lossless
from mlx_lm.models.cache import make_prompt_cache
from test_lossless import CPU_LIKE_COST, Oracle
from test_sampling import Flattened, one_sample_chi_square
from tiny_models import VOCAB, byte_tokenizer, tiny_model

import mlxspec.structured.grammar
from mlxspec.batch.caches import BatchCaches
from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.single import SingleCaches
from mlxspec.decoding.engine import Engine, GenerationError, GenerationSettings
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.events import Done
from mlxspec.proposers import DraftModel, PromptLookup, SelfSpeculation, truncated_model
from mlxspec.sampling import SamplingSettings
from mlxspec.structured.grammar import Constraint, Grammar

WEATHER = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer"},
        "sure": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["answer", "sure", "tags"],
    "additionalProperties": False,
}
GRAMMARS = {
    "tool call": Grammar.json_schema(WEATHER),
    "answer": Grammar.json_schema(ANSWER),
    "json object": Grammar("json_object"),
    "regex": Grammar("regex", r"(yes|no), because [a-z ]{1,20}\."),
}
MAX_TOKENS = 64


def constrained_plain(model, tokenizer, prompt, grammar: Grammar, max_tokens: int) -> list[int]:
    """Constrained plain greedy decoding: at every step the argmax over the tokens the
    grammar allows, until EOS, the grammar's end or `max_tokens`."""
    eos = sorted(tokenizer.eos_token_ids)
    matcher = LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=eos), grammar.llguidance()
    )
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(mx.argmax(mx.where(allowed(matcher, logits.shape[-1]), logits, -mx.inf)))
        if token in eos:
            break
        out.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def allowed(matcher: LLMatcher, width: int) -> mx.array:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    mask = np.unpackbits(bits, bitorder="little")[:width].astype(bool)
    return mx.array(np.pad(mask, (0, width - mask.shape[0])))


def grammar_allows(tokenizer, grammar: Grammar, tokens: list[int]) -> bool:
    matcher = LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer._tokenizer), grammar.llguidance(), log_level=0
    )
    return matcher.validate_tokens(tokens) == len(tokens)


def last_done(events) -> Done:
    done = list(events)[-1]
    assert isinstance(done, Done)
    return done


@pytest.fixture(scope="module")
def setup():
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=3)
    engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST)
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8))
    engine.add_proposer(DraftModel(truncated_model(model, 2), name="draft", k_max=5))
    engine.add_proposer(SelfSpeculation(engine.target, layers=1, name="self-spec", k_max=4))
    prompt = tokenizer.encode('Call get_weather for Paris: {"name": "get_weather", "arg')
    references = {
        name: constrained_plain(model, tokenizer, prompt, grammar, MAX_TOKENS)
        for name, grammar in GRAMMARS.items()
    }
    return tokenizer, model, engine, prompt, references


@pytest.mark.parametrize("grammar_name", list(GRAMMARS))
def test_constrained_speculation_matches_constrained_plain_decoding(setup, grammar_name):
    """Every proposer, lines and trees, fixed and adaptive k, and an oracle drafting the
    reference with one token corrupted a round (often into one the grammar forbids)."""
    tokenizer, model, engine, prompt, references = setup
    grammar, reference = GRAMMARS[grammar_name], references[grammar_name]
    assert grammar_allows(tokenizer, grammar, reference)
    engine.add_proposer(Oracle(len(prompt), reference, k_max=6))
    pruned = 0
    for name in ["none", "lookup", "draft", "self-spec", "oracle"]:
        fixed = [(3, False)] if name == "oracle" else []  # rejections at every position
        for k, tree in [(None, False), (None, True), *fixed]:
            settings = GenerationSettings(max_tokens=MAX_TOKENS, k=k, tree=tree, grammar=grammar)
            done = last_done(engine.stream(prompt, settings, name))
            label = f"{grammar_name} proposer={name} k={k} tree={tree}"
            assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
            assert done.record.grammar == grammar.kind
            pruned += done.record.grammar_pruned
    assert pruned > 0, "no draft was ever refused: the pruning path did not run"


def test_a_finished_grammar_ends_the_request_without_another_pass(setup):
    """The tool call's JSON closes well before max_tokens: the request stops there (the
    grammar allows nothing but the end), and its text is valid JSON of the schema."""
    tokenizer, model, engine, prompt, references = setup
    settings = GenerationSettings(max_tokens=200, grammar=GRAMMARS["tool call"])
    done = last_done(engine.stream(prompt, settings, "lookup"))
    assert done.record.finish_reason == "stop"
    call = json.loads(done.text)
    assert call["name"] == "get_weather" and call["arguments"]["unit"] in ("celsius", "fahrenheit")
    assert list(done.token_ids) == constrained_plain(
        model, tokenizer, prompt, GRAMMARS["tool call"], 200
    )


def test_forced_tokens_are_drafted_for_free_and_counted_apart(setup):
    """The tool call's skeleton (`{"name": "get_weather", "arguments": {"city": "`...) is
    forced: drafted by the grammar and kept, in far fewer passes than tokens. Plain
    decoding (proposer none) drafts nothing: it is the reference."""
    tokenizer, model, engine, prompt, references = setup
    settings = GenerationSettings(max_tokens=200, grammar=GRAMMARS["tool call"])
    plain = last_done(engine.stream(prompt, settings, "none")).record
    assert plain.grammar_drafted == plain.drafted == 0
    record = last_done(engine.stream(prompt, settings, "lookup")).record
    skeleton = len(tokenizer.encode('{"name": "get_weather", "arguments": {"city": "'))
    assert record.grammar_accepted >= skeleton
    assert record.grammar_drafted >= record.grammar_accepted
    steps = [e for e in engine.stream(prompt, settings, "lookup") if type(e).__name__ == "Step"]
    assert len(steps) < record.completion_tokens / 2
    assert any(step.proposer == "grammar" for step in steps)


class Counting:
    """Wraps a cache's verify calls: every row the target verified."""

    def __init__(self, monkeypatch, caches_class):
        self.rows: list[list[int]] = []
        for name in ("verify", "verify_tree"):
            original = getattr(caches_class, name)

            def counted(caches, rows, *rest, _original=original):
                self.rows.extend(list(row) for row in rows)
                return _original(caches, rows, *rest)

            monkeypatch.setattr(caches_class, name, counted)


class Forbidding(Oracle):
    """The oracle, its corrupted token one that no JSON allows (a control byte)."""

    def __init__(self, tokenizer, prompt_len: int, reference: list[int]):
        super().__init__(prompt_len, reference, name="forbidding", k_max=6)
        self.control = tokenizer.encode("\x01")[0]

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        bad = self.corrupted[-1]
        if bad is not None:
            draft.tokens[bad] = self.control
        return draft


def verified_rows_allowed(tokenizer, grammar, prompt, produced, rows) -> bool:
    """Every verified row ([pending token, drafts...]) is allowed by the grammar from some
    point of the output where its pending token stands (the output is the reference, so
    every round's context is one of its prefixes)."""
    context = [*prompt, *produced]
    for row in rows:
        if not any(
            context[len(prompt) + i - 1] == row[0]
            and grammar_allows(tokenizer, grammar, produced[:i] + row[1:])
            for i in range(len(produced) + 1)
        ):
            return False
    return True


@pytest.mark.parametrize("proposer, tree", [("forbidding", False), ("lookup", True)])
def test_a_draft_the_grammar_forbids_never_reaches_the_verify_pass(
    setup, monkeypatch, proposer, tree
):
    """A proposer drafting the reference with one token corrupted a round (lines), and
    prompt lookup's trees: the drafts the grammar forbids are cut before the pass."""
    tokenizer, model, engine, prompt, references = setup
    grammar = GRAMMARS["answer"]
    engine.add_proposer(Forbidding(tokenizer, len(prompt), references["answer"]))
    seen = Counting(monkeypatch, SingleCaches)
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=5, tree=tree, grammar=grammar)
    done = last_done(engine.stream(prompt, settings, proposer))
    produced = list(done.token_ids)
    assert_lossless(model, prompt, references["answer"], produced, proposer, done.record)
    assert done.record.grammar_pruned > 0
    assert len(seen.rows) > 3
    assert verified_rows_allowed(tokenizer, grammar, prompt, produced, seen.rows)


def test_the_batch_serves_each_row_its_own_grammar(setup):
    """Eight clients with different grammars in one batch: each answer equals its
    constrained plain answer and matches its own grammar."""
    tokenizer, model, engine, prompt, references = setup
    scheduler = Scheduler(engine, max_batch=8)
    asked = {}
    for i, (name, grammar) in enumerate([*GRAMMARS.items(), *GRAMMARS.items()]):
        proposer = "lookup" if i % 2 else "none"
        settings = GenerationSettings(max_tokens=MAX_TOKENS, grammar=grammar)
        asked[scheduler.submit(prompt, settings, proposer)] = name
    done: dict[int, Done] = {}
    for out in scheduler.drain():
        done.update({i: events[-1] for i, events in out.items() if isinstance(events[-1], Done)})
    for request_id, name in asked.items():
        got = list(done[request_id].token_ids)
        assert_lossless(
            model, prompt, references[name], got, f"batch {name}", done[request_id].record
        )
        assert grammar_allows(tokenizer, GRAMMARS[name], got)
    assert sum(d.record.grammar_drafted for d in done.values()) > 0


def test_a_grammar_that_cannot_be_enforced_is_refused_in_one_line(setup):
    tokenizer, model, engine, prompt, references = setup
    for grammar in [
        Grammar("json_schema", "{not json"),
        Grammar("json_schema", json.dumps({"type": "object", "dependentSchemas": {"a": {}}})),
        Grammar("regex", "(unclosed"),
    ]:
        with pytest.raises(GenerationError) as caught:
            list(engine.stream(prompt, GenerationSettings(grammar=grammar), "lookup"))
        assert "\n" not in str(caught.value) and str(caught.value)


def test_sampling_under_a_grammar_follows_the_masked_target_law():
    """Temperature 1 with a draft model whose q ignores the grammar: its drafts are often
    refused before the pass (and still owe their rejection), the rest verified against
    the masked target. The first token, and the first two, follow the target's law
    renormalised over what the grammar allows (a one-sample chi-square each)."""
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=5, sharpness=8.0)
    draft = DraftModel(Flattened(tiny_model("llama", seed=5, sharpness=8.0), 0.35), k_max=3)
    engine = Engine(model, tokenizer, "llama", [draft], verify_cost=VerifyCost({1: 1.0}, 1.0))
    prompt = [40, 41, 42, 43]
    # Allowed: the target's likeliest letters at the first position. q (flattened,
    # unmasked) puts most of its mass on the forbidden rest, so most drafts are refused,
    # and more than p on the allowed tail, where the residual max(0, p - q) owed to a
    # refused draft differs most from p.
    logits = model(mx.array([prompt]))[0, -1]
    letters = {tokenizer.decode([t]): t for t in range(256) if tokenizer.decode([t]).isalpha()}
    ranked = [int(t) for t in np.argsort(-np.array(logits)) if int(t) in letters.values()]
    allowed_ids = np.array(ranked[:8])
    chars = "".join(tokenizer.decode([int(t)]) for t in allowed_ids)
    grammar = Grammar("regex", f"[{chars}]{{2}}")
    # 1000 runs: the first-token check's statistic is 51 (bound 26) when a refused draft's
    # rejection is skipped (the target's token drawn from p, not the residual); 37 at 600.
    runs, firsts, pairs, pruned = 1000, Counter(), Counter(), 0
    for seed in range(runs):
        settings = GenerationSettings(
            max_tokens=2,
            k=2,
            grammar=grammar,
            sampling=SamplingSettings(temperature=1.0, seed=seed),
        )
        done = last_done(engine.stream(prompt, settings, "draft-model"))
        firsts[done.token_ids[0]] += 1
        pairs[tuple(done.token_ids)] += 1
        pruned += done.record.grammar_pruned
    assert pruned > runs / 4, "the grammar rarely refused a draft: the residual path is untested"
    vocab = logits.shape[-1]

    def masked_law(rows: mx.array) -> np.ndarray:
        keep = np.zeros(vocab, bool)
        keep[allowed_ids] = True
        masked = mx.where(mx.array(keep), rows.astype(mx.float32), -mx.inf)
        return np.array(mx.softmax(masked, axis=-1))

    first = masked_law(logits)
    statistic, dof = one_sample_chi_square(firsts, first)
    assert dof >= 3
    assert statistic < dof + 4.5 * np.sqrt(2 * dof), ("first token", statistic, dof)
    after = mx.array([prompt + [int(a)] for a in allowed_ids])
    second = masked_law(model(after)[:, -1])
    law = np.zeros(vocab * vocab)
    for row, a in enumerate(allowed_ids):
        law[a * vocab : (a + 1) * vocab] = first[a] * second[row]
    seen = Counter({a * vocab + b: n for (a, b), n in pairs.items()})
    statistic, dof = one_sample_chi_square(seen, law)
    assert statistic < dof + 4.5 * np.sqrt(2 * dof), ("first two", statistic, dof)


def test_batch_caches_verify_no_forbidden_draft_either(setup, monkeypatch):
    """The batch's own caches (serve --max-batch): the same cut before the pass."""
    tokenizer, model, engine, prompt, references = setup
    grammar = GRAMMARS["tool call"]
    engine.add_proposer(Forbidding(tokenizer, len(prompt), references["tool call"]))
    seen = Counting(monkeypatch, BatchCaches)
    scheduler = Scheduler(engine, max_batch=2)
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=4, grammar=grammar)
    ids = [scheduler.submit(prompt, settings, "forbidding"), scheduler.submit(prompt, settings)]
    done = {}
    for out in scheduler.drain():
        done.update({i: events[-1] for i, events in out.items() if isinstance(events[-1], Done)})
    assert done[ids[0]].record.grammar_pruned > 0
    reference = references["tool call"]
    for request_id in ids:
        got = list(done[request_id].token_ids)
        assert_lossless(model, prompt, reference, got, "batch", done[request_id].record)
    assert verified_rows_allowed(tokenizer, grammar, prompt, reference, seen.rows)


@pytest.fixture
def slow_compiles(monkeypatch):
    """Compiling a regex grammar that starts with "slow" takes 0.6 s; the bound is 2 s,
    or 0.3 s where a test lowers it."""
    compile_quickly = mlxspec.structured.grammar.compile_grammar

    def compile_slowly(grammar, *rest):
        if grammar.kind == "regex" and grammar.source.startswith("slow"):
            time.sleep(0.6)
        return compile_quickly(grammar, *rest)

    monkeypatch.setattr(mlxspec.structured.grammar, "compile_grammar", compile_slowly)
    monkeypatch.setattr(mlxspec.structured.grammar, "COMPILE_SECONDS", 2.0)
    return monkeypatch


def drained(scheduler) -> tuple[list[int], dict[int, Done]]:
    """(request ids in the order of their first events, each request's Done)."""
    order, done = [], {}
    for out in scheduler.drain():
        for request_id, events in out.items():
            if request_id not in order:
                order.append(request_id)
            if isinstance(events[-1], Done):
                done[request_id] = events[-1]
    return order, done


def test_a_grammar_still_compiling_does_not_stall_the_batch(setup, slow_compiles):
    """Compiling runs off the round loop: a request whose grammar compiles waits in the
    queue while another request's rounds go on, then joins and is served constrained."""
    tokenizer, model, engine, prompt, references = setup
    scheduler = Scheduler(engine, max_batch=2)
    slow = Grammar("regex", "slow [a-z]{1,8}")
    waiting = scheduler.submit(prompt, GenerationSettings(max_tokens=12, grammar=slow), "none")
    going = scheduler.submit(prompt, GenerationSettings(max_tokens=12), "none")
    order, done = drained(scheduler)
    assert order == [going, waiting]  # the other request went first: nothing waited
    assert done[going].record.finish_reason == "length"
    assert done[waiting].text.startswith("slow ")


def test_a_grammar_over_the_compile_bound_fails_its_request_alone(setup, slow_compiles):
    tokenizer, model, engine, prompt, references = setup
    slow_compiles.setattr(mlxspec.structured.grammar, "COMPILE_SECONDS", 0.3)
    scheduler = Scheduler(engine, max_batch=2)
    slow = Grammar("regex", "slow [a-z]{1,8}")
    failing = scheduler.submit(prompt, GenerationSettings(max_tokens=12, grammar=slow), "none")
    going = scheduler.submit(prompt, GenerationSettings(max_tokens=12), "none")
    order, done = drained(scheduler)
    assert going in done and failing not in done
    error = scheduler.failed[failing]
    assert isinstance(error, GenerationError) and "did not compile within 0.3 s" in str(error)
    with pytest.raises(GenerationError, match="did not compile"):  # alone too
        list(engine.stream(prompt, GenerationSettings(grammar=slow), "none"))


def small_constraint(pattern: str) -> Constraint:
    tokenizer = byte_tokenizer()
    return Constraint(Grammar("regex", pattern), tokenizer, VOCAB)


def test_forced_tokens_are_at_most_the_rounds_room():
    """The forced tokens are drafted within the round's k: never one more."""
    constraint = small_constraint("abcdefgh")
    everything = constraint.forced(100)
    assert len(everything) >= 4
    assert [constraint.forced(n) for n in (0, 1, 3)] == [[], everything[:1], everything[:3]]


def test_a_drafted_end_is_kept_only_where_the_grammar_may_end():
    constraint = small_constraint("abc")
    eos = next(iter(constraint.eos))
    kept, masks, refused = constraint.prune([eos], [0])
    assert kept == [] and refused == 1 and masks.shape[0] == 1  # "abc" is not written yet
    constraint.take(byte_tokenizer().encode("abc", add_special_tokens=False))
    kept, _, refused = constraint.prune([eos], [0])
    assert kept == [1] and refused is None


def test_forced_tokens_carry_one_hot_rows_in_the_drafters_q(monkeypatch):
    """Sampling, a grammar that forces tokens, and a draft model that drafts on after them:
    the round's q has a row per drafted token, the forced ones' one-hot at their token
    (they were not drawn, they were the only choice), the drafter's after them. Rejection
    sampling reads q by position: a missing row shifts every law after it."""
    import mlxspec.batch.scheduler

    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=5, sharpness=8.0)
    draft = DraftModel(tiny_model("llama", seed=5, sharpness=8.0), k_max=4)
    engine = Engine(model, tokenizer, "llama", [draft], verify_cost=VerifyCost({1: 1.0}, 1.0))
    rounds = []
    original = mlxspec.batch.scheduler.draft_after

    def recorded(run, proposer, ctx, chosen, forced, k):
        situation, drafted = original(run, proposer, ctx, chosen, forced, k)
        if situation is not None:  # the drafter drafted on after the forced tokens
            rounds.append((list(forced), drafted))
        return situation, drafted

    monkeypatch.setattr(mlxspec.batch.scheduler, "draft_after", recorded)
    grammar = Grammar("regex", "abc[a-z]{2}xyz[a-z]{3}")
    for seed in range(3):
        sampling = SamplingSettings(temperature=1.0, seed=seed)
        settings = GenerationSettings(max_tokens=20, k=4, grammar=grammar, sampling=sampling)
        last_done(engine.stream([40, 41, 42, 43], settings, "draft-model"))
    assert rounds, "no round drafted after forced tokens: the path is untested"
    for forced, drafted in rounds:
        assert drafted.probs is not None
        assert drafted.probs.shape[0] == len(drafted.tokens)
        rows = np.array(drafted.probs[: len(forced)])
        assert (rows.argmax(axis=-1) == forced).all() and (rows.max(axis=-1) == 1).all()
        assert rows.sum() == len(forced)
