"""Proposer, policy and text-stream behaviour that the lossless tests cannot see."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.policy import Acceptance, Policy, expected_tokens
from mlxspec.decoding.text import TextStream
from mlxspec.decoding.verify_cost import CALIBRATION_SIZES, VerifyCost, at_context, calibrate
from mlxspec.events import OUTPUT_EVENTS, Done, Rejected, Step
from mlxspec.proposers import Draft, PromptLookup, ProposalContext, Situation
from mlxspec.sampling import SamplingSettings, TokenScorer

CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05, 32: 3.22, 64: 5.71}, 0.05)
# SmolLM2 on this CPU behind 4,000 tokens (docs/memory.md), with a step twice as dear.
LONG_CPU_COST = VerifyCost(
    {1: 1.0, 2: 1.30, 4: 2.10, 8: 2.75, 16: 3.81, 32: 6.68, 64: 12.4}, 0.10, context=4000
)


def context(tokens):
    return ProposalContext(tokens, TokenScorer(SamplingSettings()), np.random.default_rng(0), None)


def lookup_draft(proposer, tokens, k=8):
    situation = proposer.situation(context(tokens))
    return None if situation is None else proposer.propose(context(tokens), k).tokens


def test_lookup_prefers_the_longest_then_most_recent_match():
    lookup = PromptLookup(ngram_max=3, ngram_min=1)
    # "7 8" occurs twice: the later occurrence (followed by 3) wins; "6 7 8" (longer) beats both.
    assert lookup_draft(lookup, [7, 8, 1, 7, 8, 3, 9, 7, 8], k=1) == [3]
    assert lookup_draft(
        PromptLookup(ngram_max=3, ngram_min=1), [6, 7, 8, 5, 7, 8, 3, 6, 7, 8], 1
    ) == [5]


def test_lookup_needs_a_match_of_at_least_ngram_min():
    lookup = PromptLookup(ngram_max=4, ngram_min=2)
    assert lookup_draft(lookup, [1, 2, 3, 9, 3]) is None  # only a 1-token match
    assert lookup_draft(lookup, [1, 2, 3, 9, 2, 3]) == [9, 2, 3]


def test_lookup_index_grows_incrementally_and_resets_when_the_text_changes():
    lookup = PromptLookup(ngram_max=2, ngram_min=2)
    tokens = [1, 2, 3, 4]
    assert lookup_draft(lookup, tokens) is None
    tokens += [1, 2]
    assert lookup_draft(lookup, tokens) == [3, 4, 1, 2]
    assert lookup_draft(lookup, [5, 6, 7, 5, 6]) == [7, 5, 6]  # a different conversation


class ReadCounting(list):
    """A context that counts the tokens a proposer reads out of it by slicing."""

    read = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice):
            ReadCounting.read += len(got)
        return got


def test_lookup_reads_a_bounded_part_of_a_long_context_each_round():
    lookup = PromptLookup(ngram_max=3, ngram_min=1)
    tokens = [i % 997 for i in range(20_000)]
    lookup_draft(lookup, ReadCounting(tokens))
    for step in range(5):
        tokens += [step, step + 1]
        ReadCounting.read = 0
        assert lookup_draft(lookup, ReadCounting(tokens)) is not None
        assert ReadCounting.read < 1_000  # the new tokens, the ends compared, the drafts


def test_lookup_labels_long_verbatim_matches():
    lookup = PromptLookup(ngram_max=2, ngram_min=2)
    text = list(range(40))
    situation = lookup.situation(context(text + [99] + text[:20]))
    assert situation.key == "match>=16"


def test_expected_tokens_and_cost_interpolation():
    assert expected_tokens(0.0, 5) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    assert expected_tokens(1.0, 4) == 5.0
    assert CPU_LIKE_COST(3) == (1.13 + 1.39) / 2
    assert CPU_LIKE_COST(128) > CPU_LIKE_COST(64)


class Named:
    def __init__(self, name, cost_hint=0.0):
        self.name, self.cost_hint = name, cost_hint


def test_a_chain_drafts_with_the_member_expected_to_be_fastest():
    """A weak lookup match must not shut out a head that is usually right, nor the
    head a long verbatim match."""
    policy = Policy(CPU_LIKE_COST)
    weak = Situation(Named("lookup"), "match>=2", prior=0.5)
    head = Situation(Named("head", cost_hint=0.06), "head", prior=0.5)
    for _ in range(20):
        policy.update(weak, 4, 0, 0.0)
        policy.update(head, 3, 2, 0.0)
    chosen, k = policy.choose_among([weak, head], 32)
    assert chosen is head and k >= 1
    strong = Situation(Named("lookup"), "match>=16", prior=0.95)
    chosen, k = policy.choose_among([strong, head], 32)
    assert chosen is strong and k > 4
    fixed = Policy(CPU_LIKE_COST, fixed_k=3)
    assert fixed.choose_among([weak, head], 32) == (weak, 3)  # fixed k: first member


def test_policy_drafts_long_when_acceptance_is_high_and_not_at_all_when_low():
    policy = Policy(CPU_LIKE_COST)
    good, bad = Situation(Named("copying"), "match>=16"), Situation(Named("chatting"), "match>=2")
    for _ in range(30):
        policy.update(good, 16, 16, 0.0)
        policy.update(bad, 4, 0, 0.0)
    assert policy.choose(good, 64) >= 16
    assert policy.choose(bad, 64) == 0


def test_a_verify_is_priced_between_the_short_and_the_long_curve_by_context_length():
    short = VerifyCost(CPU_LIKE_COST.points, 0.05, context=4)
    assert at_context(short, LONG_CPU_COST, 4, 8) == pytest.approx(short(8))
    assert at_context(short, LONG_CPU_COST, 4000, 8) == pytest.approx(LONG_CPU_COST(8))
    # Halfway, the seconds are halfway: (0.0775 + 0.275) / 2, the step (0.05 + 0.10) / 2.
    assert at_context(short, LONG_CPU_COST, 2002, 8) == pytest.approx(0.17625 / 0.075)
    assert at_context(short, LONG_CPU_COST, 8000, 8) > LONG_CPU_COST(8)  # extrapolated
    cheap = VerifyCost({1: 1.0, 8: 1.2}, 0.04, context=4000)  # timed in a calmer moment
    assert at_context(short, cheap, 8000, 8) >= 1.0


def test_policy_drafts_shorter_at_a_long_context_where_the_long_curve_says_so():
    """The same acceptance, two contexts: behind 4,000 tokens a 9-token pass costs 1.8x
    its short-context ratio, so the policy drafts less; with no long curve, as before."""
    copying = Situation(Named("copying"), "match>=8")
    chosen = {}
    for long_cost in (LONG_CPU_COST, None):
        policy = Policy(VerifyCost(CPU_LIKE_COST.points, 0.05, context=4), long_cost=long_cost)
        for _ in range(30):
            policy.update(copying, 4, 3, 0.0)
        for length in (4, 500, 6000):
            policy.context = length
            chosen[long_cost is not None, length] = policy.choose(copying, 64)
    assert chosen[True, 6000] < chosen[True, 500] <= chosen[True, 4], chosen
    assert chosen[False, 6000] == chosen[False, 4] == chosen[True, 4] > 1, chosen


def test_policy_never_probes_a_source_that_could_not_pay_at_any_acceptance():
    """A draft token dearer than a target step loses even if every draft is kept: no
    probe can teach the policy anything that turns it on, so none is made (each would
    cost a draft step and a wider verify)."""
    policy = Policy(CPU_LIKE_COST, explore_every=4)
    costly = Situation(Named("draft", cost_hint=2.0), "model")
    assert [policy.choose(costly, 8) for _ in range(200)] == [0] * 200


def test_a_verify_price_that_jumped_in_a_busy_moment_does_not_end_probing():
    """A wide pass timed in a busy moment re-prices every width at once; whether drafting
    could pay at all is asked of the calibrated curve, so probes go on and the next one
    finds the price back (asked of the observed one, the source was shut off for good)."""
    policy = Policy(CPU_LIKE_COST, explore_every=4)
    weak = Situation(Named("lookup"), "match>=2")
    for _ in range(10):
        policy.update(weak, 4, 0, 0.0)
    policy.observe_verify(1, 0.05)
    policy.observe_verify(2, 5.0)  # a 2-token pass took 100 steps
    for _ in range(3):
        policy.observe_verify(1, 0.05)  # the step re-timed: the jump stands
    assert policy.verify_cost(2) > 10
    assert 1 in [policy.choose(weak, 8) for _ in range(64)]


def rounds_to_probe(policy: Policy, situation: Situation, limit: int = 8) -> int:
    rounds = 1
    while policy.choose(situation, limit) == 0:
        rounds += 1
    return rounds


def test_policy_keeps_probing_a_source_that_might_pay_and_waits_longer_after_misses():
    policy = Policy(CPU_LIKE_COST, explore_every=4, probe_share=1.0)  # price: not the limit
    weak = Situation(Named("draft", cost_hint=0.3), "model")
    for _ in range(10):  # learned: it is rarely right, so plain decoding is chosen
        policy.update(weak, 4, 0, 0.06)
    assert policy.choose(weak, 8) == 0
    choices = [policy.choose(weak, 8) for _ in range(8)]
    assert choices.count(1) == 2  # one probe every 4 idle rounds
    waits = []
    for _ in range(4):  # every probe is rejected: the wait doubles
        waits.append(rounds_to_probe(policy, weak))
        policy.update(weak, 1, 0, 0.015)  # a draft token 0.3 target steps
    assert waits == [3, 8, 16, 32]  # (the first: 1 idle round left over from above)
    rounds_to_probe(policy, weak)
    policy.update(weak, 1, 1, 0.015)  # an accepted probe: back to the start
    policy.update(weak, 2, 0, 0.03)  # (and a miss, which ends its streak of full drafts)
    assert [policy.choose(weak, 8) for _ in range(8)].count(1) == 2
    acceptance = Acceptance()
    acceptance.update(4, 4, decay=0.5)
    assert acceptance.rate > 0.5


def test_a_probe_waits_until_its_price_is_a_small_share_of_the_rounds_it_waited():
    """A draft model off since the prompt must read all of it to probe: that catch-up
    is priced, and the probe waits until it is `probe_share` of the plain rounds before
    it, so probing a drafter that is wrong never costs more than that share."""
    waited = {}
    for behind in (1, 300):
        policy = Policy(CPU_LIKE_COST, explore_every=4)
        source = Named("draft", cost_hint=0.1)
        for _ in range(10):  # learned in step: rarely right, a draft step 0.1 target steps
            policy.update(Situation(source, "model"), 4, 0, 0.02)
        situation = Situation(source, "model", catch_up=behind)
        waited[behind] = rounds_to_probe(policy, situation, limit=8)
        catch_up = max(0.0, CPU_LIKE_COST(behind) - 1.0) if behind > 1 else 0.0
        price = 0.1 * (1 + catch_up) + CPU_LIKE_COST(2) - 1.0
        assert price <= policy.probe_share * waited[behind] < price + 2 * policy.probe_share
    assert waited[300] > 5 * waited[1]


def full_scan_plan(policy: Policy, situation: Situation, limit: int) -> tuple[int, float]:
    """`Policy._plan` as it was before it stopped early: every k from 1 to `limit`."""
    key = policy._key(situation)
    rate = policy.stats.setdefault(key, Acceptance.with_prior(situation.prior)).rate
    per_draft = policy.draft_cost.get(situation.source.name, situation.source.cost_hint)
    tokens = policy._expected_by_position(situation, key, limit) or policy._expected_from_evidence(
        situation, rate, limit
    )
    best_k, best_speed = 0, 1.0
    for k in range(1, limit + 1):
        cost = policy.verify_cost(k + 1) + k * per_draft
        speed = (tokens[k] if tokens else expected_tokens(rate, k)) / cost
        if speed > best_speed:
            best_k, best_speed = k, speed
    return best_k, best_speed


def test_the_policy_stops_its_search_over_k_early_only_where_no_longer_k_could_win():
    """The search over k ends once a k's cost alone leaves the most tokens a round can
    bring no faster than the best so far: the same choice as trying every k, on
    monotone curves (measured ones) and on a made-up curve that dips (searched whole)."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        sizes = sorted({1, *rng.choice(np.arange(2, 65), size=5, replace=False).tolist()})
        steps = rng.uniform(0.0, 0.8, size=len(sizes) - 1)
        points = dict(zip(sizes, np.concatenate([[1.0], 1.0 + np.cumsum(steps)]).tolist()))
        if trial % 10 == 0:  # a curve that dips: no early end may be taken on it
            last = sizes[-1]
            points[last] = 0.5 * points[sizes[-2]]
        curve = VerifyCost(points, 0.01, partial=bool(trial % 3 == 0))
        policy = Policy(curve)
        policy.extra_cost_scale = float(rng.uniform(0.25, 4.0))
        cost_hint = float(rng.choice([0.0, 0.0, 0.02, 0.3]))
        evidence = ()
        if trial % 4 == 1:
            evidence = tuple((int(rng.integers(1, 5)), 5) for _ in range(int(rng.integers(1, 12))))
        situation = Situation(Named("lookup", cost_hint), "match", float(rng.uniform()), evidence)
        for _ in range(int(rng.integers(0, 6))):
            drafted = int(rng.integers(1, 9))
            policy.update(situation, drafted, int(rng.integers(0, drafted + 1)), 0.0)
        limit = int(rng.integers(1, 65))
        assert policy._plan(situation, limit) == full_scan_plan(policy, situation, limit), trial


def test_text_stream_never_shows_a_stop_string_split_across_tokens():
    tokenizer = byte_tokenizer()
    stream = TextStream(tokenizer, stop=["END"])
    shown = ""
    for ch in "abcEN":
        stream.add("bonus", tokenizer.encode(ch)[0])
        shown += "".join(p.text for p in stream.release())
    assert shown == "abc"  # "EN" is held back: it may become END
    stream.add("bonus", tokenizer.encode("D")[0])
    shown += "".join(p.text for p in stream.release())
    assert shown == "abc" and stream.stopped and stream.text == "abc"


def test_text_stream_says_which_stop_string_ended_it():
    tokenizer = byte_tokenizer()
    stream = TextStream(tokenizer, stop=["zz", "b", "cd"])
    for ch in "abcdb":
        stream.add("bonus", tokenizer.encode(ch)[0])
    stream.release()
    assert stream.matched == "b" and stream.text == "a"  # the first to appear, not the first listed


def test_text_stream_releases_held_text_that_turned_out_harmless():
    tokenizer = byte_tokenizer()
    stream = TextStream(tokenizer, stop=["END"])
    for ch in "xEN!":
        stream.add("accepted", tokenizer.encode(ch)[0])
    assert "".join(p.text for p in stream.release()) == "xEN!"
    assert not stream.stopped


def engine_with_lookup(seed=0):
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=seed)
    return Engine(model, tokenizer, "llama", [PromptLookup()], verify_cost=CPU_LIKE_COST)


def test_events_rebuild_the_output_and_rejected_drafts_stay_out():
    engine = engine_with_lookup()
    prompt = [3, 4, 5, 6] * 6
    events = list(engine.stream(prompt, GenerationSettings(max_tokens=40, k=4), "prompt-lookup"))
    done = events[-1]
    assert isinstance(done, Done)
    output = [e for e in events if isinstance(e, OUTPUT_EVENTS)]
    assert "".join(e.text for e in output) == done.text
    assert tuple(t for e in output for t in e.tokens) == done.token_ids
    steps = [e for e in events if isinstance(e, Step)]
    assert sum(s.drafted for s in steps) == done.record.drafted > 0
    assert sum(s.accepted for s in steps) == done.record.accepted
    rejected = sum(len(e.tokens) for e in events if isinstance(e, Rejected))
    assert rejected == done.record.drafted - done.record.accepted


def round_ends(events) -> list[int]:
    """Output length (tokens) at the end of each round: a round yields accepted + 1."""
    ends, total = [], 0
    for step in (e for e in events if isinstance(e, Step)):
        total += step.accepted + 1
        ends.append(total)
    return ends


def test_stop_string_spanning_rounds_ends_the_answer_before_it():
    """A stop string whose first half one round produced and whose second half the next
    did: nothing of it is ever shown, and the answer ends right before it."""
    engine = engine_with_lookup(seed=2)
    prompt = list(b"the cat sat on the mat. the cat")
    settings = GenerationSettings(max_tokens=40, k=5)
    plain = list(engine.stream(prompt, GenerationSettings(max_tokens=40)))[-1]
    full = plain.text
    assert len(full) == len(plain.token_ids)  # one character per token: indexes agree
    spec = list(engine.stream(prompt, settings, "prompt-lookup"))
    steps = [e for e in spec if isinstance(e, Step)]
    # A boundary after a round that kept drafts, where a 4-character window first occurs.
    cut = next(
        end - 2
        for end, step in zip(round_ends(spec), steps)
        if step.accepted
        and 8 <= end <= len(full) - 2
        and full.index(full[end - 2 : end + 2]) == end - 2
    )
    stop = full[cut : cut + 4]
    events = list(
        engine.stream(prompt, GenerationSettings(max_tokens=40, stop=[stop], k=5), "prompt-lookup")
    )
    done = events[-1]
    assert any(cut < end < cut + len(stop) for end in round_ends(events))  # spans two rounds
    assert done.text == full[:cut]
    assert "".join(e.text for e in events if isinstance(e, OUTPUT_EVENTS)) == done.text
    assert done.record.finish_reason == "stop"
    # Token ids and counts end where the text does, not where generation stopped.
    assert done.token_ids == plain.token_ids[: len(done.token_ids)]
    assert len(done.token_ids) <= len(full[:cut].encode()) + 1
    assert done.record.completion_tokens == len(done.token_ids)


def test_record_is_truthful():
    engine = engine_with_lookup()
    done = list(
        engine.stream([1, 2, 3, 1, 2, 3, 1, 2], GenerationSettings(max_tokens=17), "prompt-lookup")
    )[-1]
    record = done.record.to_dict()
    assert record["completion_tokens"] == len(done.token_ids) <= 17
    assert record["speculative"] is True and record["proposer"] == "prompt-lookup"
    assert record["lossless"] is True and record["k_policy"] == "adaptive"
    assert record["acceptance_rate"] == round(record["accepted"] / max(record["drafted"], 1), 4)
    assert sum(record["accepted_by_position"]) == record["accepted"]
    assert sum(record["drafted_by_position"]) == record["drafted"]
    assert record["drafted_by_position"][0] == record["verify_steps"]
    assert all(0 <= p <= 1 for p in record["acceptance_by_position"])
    assert record["device"]["device"] in ("cpu", "metal", "cuda")
    plain = list(engine.stream([1, 2, 3], GenerationSettings(max_tokens=5)))[-1].record
    assert plain.speculative is False and plain.drafted == 0 and plain.k_policy == "off"


class HiddenReader:
    """Checks that the engine hands a drafter the hidden states of exactly the tokens the
    target cache took in since the last round, computed in the same pass (prefill or
    verify: no second forward); the last row predicted the pending token."""

    needs_hidden = True
    cost_hint = 0.0
    name, k_max = "hidden-reader", 2

    def __init__(self, prompt_len: int):
        self.prompt_len, self.seen, self.checked = prompt_len, 0, 0

    def observe(self, ctx):
        self.seen = len(ctx.tokens) - 1

    def situation(self, ctx):
        rows = 0 if ctx.hidden is None else ctx.hidden.shape[0]
        assert rows == len(ctx.tokens) - 1 - self.seen  # nothing missing, nothing twice
        self.seen = len(ctx.tokens) - 1
        if len(ctx.tokens) > self.prompt_len:  # the pending token is the target's own
            predicted = mx.argmax(ctx.target.decoder.head(ctx.hidden)[-1]).item()
            assert predicted == ctx.tokens[-1]
            self.checked += 1
        return Situation(self, "head")

    def propose(self, ctx, k):
        return Draft([ctx.tokens[-1]] * k)


def test_drafter_heads_receive_the_targets_hidden_state():
    engine = engine_with_lookup(seed=1)
    reader = HiddenReader(prompt_len=3)
    engine.add_proposer(reader)
    done = list(engine.stream([9, 8, 7], GenerationSettings(max_tokens=12, k=2), reader.name))[-1]
    assert reader.checked >= 3 and done.record.drafted > 0
    reader.prompt_len = 20  # a second turn: only the new tokens' states arrive
    follow = [9, 8, 7, *done.token_ids, 1, 2]
    list(engine.stream(follow, GenerationSettings(max_tokens=5, k=2), reader.name))
    assert reader.seen >= len(follow) - 1


def test_policy_corrects_the_calibrated_cost_from_observed_rounds():
    policy = Policy(CPU_LIKE_COST)
    copying = Situation(Named("copying"), "match>=16", prior=0.9)
    calm = policy.choose(copying, 64)
    for _ in range(60):  # the machine got busy: extra verified tokens cost 2.5x what was measured
        policy.observe_verify(1, 0.10)
        policy.observe_verify(9, 0.10 * (1 + 2.5 * (CPU_LIKE_COST(9) - 1)))
    assert 2.0 < policy.extra_cost_scale <= 2.5 + 1e-9  # moved a tenth of the way a round
    assert policy.choose(copying, 64) < calm


def test_calibration_keeps_true_costs_through_a_busy_spell():
    """A verify of m tokens truly costs 1 + 0.1 (m - 1) steps; for a spell of five
    consecutive timings the machine runs everything 1.5x slower. Sizes taking turns,
    each keeping its fastest time, the spell leaves the calibrated costs exact."""
    now, calls = [0.0], []

    def forward(m: int) -> None:
        busy = 1.5 if 1 <= len(calls) < 1 + 5 else 1.0  # after the warm-up: sizes 1, 2, 4...
        calls.append(m)
        now[0] += 0.1 * (1 + 0.1 * (m - 1)) * busy

    cost = calibrate(forward, lambda: None, repeats=3, clock=lambda: now[0], budget=None)
    assert len(calls) == 1 + len(CALIBRATION_SIZES) * 4  # a warm-up pass and 4 timed rounds
    for m in CALIBRATION_SIZES:
        assert cost(m) == pytest.approx(1 + 0.1 * (m - 1)), m
    assert cost.step_seconds == pytest.approx(0.1)


def test_a_calibration_kept_by_another_process_meanwhile_is_not_written_over(tmp_path, monkeypatch):
    """Two processes (chat and serve) calibrating different models at once: each adds
    its entry; neither loses the other's (the file is re-read under a lock)."""
    import json

    from mlxspec.decoding.verify_cost import VerifyCost, cached_verify_cost

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    other = VerifyCost({1: 1.0, 8: 2.0}, 0.1)

    def measure_while_another_process_keeps_its_own():
        cached_verify_cost("other model", lambda: other)
        return VerifyCost({1: 1.0, 8: 1.5}, 0.2)

    mine = cached_verify_cost("my model", measure_while_another_process_keeps_its_own)
    kept = json.loads((tmp_path / "calibration.json").read_text())
    assert set(kept) == {"my model", "other model"}
    assert cached_verify_cost("other model", lambda: None) == other
    assert cached_verify_cost("my model", lambda: None) == mine
