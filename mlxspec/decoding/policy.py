"""Adaptive draft length: pick the k that maximises expected tokens per second.

With per-token acceptance a, a draft of k yields E(k) = (1 - a^(k+1)) / (1 - a)
tokens per round (accepted drafts + the target's own), and costs
T(k) = verify(k+1) + k * draft_cost, in units of one plain target step, plus, for a
drafter that was off, its share of the pass that catches it up on what the target
accepted meanwhile (`Situation.catch_up`), spread over the tokens the request has left.
k = 0 is plain decoding (E = T = 1): a draft is only made when it is expected to pay, and
a drafter at k = 0 does no work at all.

`verify(m)` is measured on the running machine (verify_cost.py), and priced at the round's
context length where a curve behind a long context was measured too (`Policy.calibrated`):
on a CPU a 17-token pass costs about 4 steps behind 4,000 tokens, 2.3 behind 500. Acceptance is
estimated per (proposer, case) from decayed counts, where a case is what the proposer
saw (e.g. prompt lookup's match length) plus whether that proposer's last draft was fully
accepted (verbatim copies are sticky).
Block drafters, whose slots differ, get E(k) from an estimate per draft position
instead, and their one pass is priced per round rather than per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxspec.decoding.verify_cost import VerifyCost, at_context, seconds_at_context

if TYPE_CHECKING:  # the proposers package imports every proposer, mlx-lm with them
    from mlxspec.proposers.base import Situation

# An observed verify whose extra tokens cost this many times what the policy expected
# re-prices every width at once (Policy.observe_verify).
PRICE_AT_ONCE = 3.0
RETIME_ROUNDS = 2  # plain rounds that re-time the step after such a jump (the fastest counts)
# Acceptance a probe asks "could drafting pay" at: nearly every draft kept. A source that
# would not pay even so (its measured draft step, catch-up and verify dearer than what it
# could bring) is never probed: no acceptance it might show would turn it on.
OPTIMISTIC_ACCEPTANCE = 0.99
# Acceptance an unproven drafter that must first catch up is priced at, at most: that pass
# is paid before anything is known of the pair, and the prior's even odds started SmolLM2's
# own 10 layers (which agree ~1 % of the time) on a catch-up of the whole prompt, 3-5 % of a
# 64-token answer. A cheap drafter (a 0.5B beside a 7B on a Mac) still starts at once; a dear
# one waits for its priced probe.
UNPROVEN_ACCEPTANCE = 0.3


@dataclass
class Acceptance:
    """Decayed counts of accepted drafts and of rejections (the MLE of a is S/(S+F))."""

    accepted: float = 1.0  # prior: a = 0.5, weight 2
    rejected: float = 1.0

    @classmethod
    def with_prior(cls, rate: float, weight: float = 2.0) -> Acceptance:
        return cls(rate * weight, (1 - rate) * weight)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted: int, accepted: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < drafted else 0)


def expected_tokens(rate: float, k: int) -> float:
    if rate >= 1.0:
        return k + 1.0
    return (1 - rate ** (k + 1)) / (1 - rate)


@dataclass
class Policy:
    cost: VerifyCost
    fixed_k: int | None = None
    decay: float = 0.9
    explore_every: int = 16
    # A probe may cost at most this share of the plain rounds it waited for: its draft
    # step, the catch-up of a drafter that was off, a verify one token wider. A draft
    # model whose catch-up is dear waits longer between probes (or, behind a whole
    # prompt it never read, past a short answer's end), so probing never costs more.
    probe_share: float = 0.02
    stats: dict[tuple[str, str], Acceptance] = field(default_factory=dict)
    # Sources whose acceptance changes along the draft (a block drafter's slots) also keep
    # one estimate per position j: a_j = P(draft j kept | the drafts before it were).
    by_position: dict[tuple[str, str], list[Acceptance]] = field(default_factory=dict)
    draft_cost: dict[str, float] = field(default_factory=dict)  # per token, in target steps
    # Read a proposer's own per-position counts (`Situation.evidence`)? False: one rate
    # for every position, as before they were read (the replay compares both).
    read_evidence: bool = True
    _full_streak: dict[str, bool] = field(default_factory=dict)
    _idle_rounds: dict[tuple[str, str], int] = field(default_factory=dict)
    # Probes that found nothing double the wait before the next one (up to 16x), so a
    # useless proposer costs ever less; an accepted probe resets it.
    _probe_wait: dict[tuple[str, str], int] = field(default_factory=dict)
    _probing: set[tuple[str, str]] = field(default_factory=set)
    # Online correction of the calibrated curve, from the rounds actually run: the
    # machine may be busier (or the context longer) than when it was calibrated.
    step_seconds: float | None = None  # recent one-token step time
    extra_cost_scale: float = 1.0  # observed / calibrated cost of the extra verified tokens
    _retime_left: int = 0  # the price just jumped: plain rounds left to re-time the step
    _remeasure: bool = False  # ...and believe the first wider pass after it outright
    # The curve measured behind a long context (`Engine.long_verify_cost`), once a long
    # prompt asked for it; None: every round priced by `cost`.
    long_cost: VerifyCost | None = None
    # The context length of the round being chosen and priced (tokens), set by whoever
    # runs the round (the scheduler's `_choose`) before it asks; 0: priced as `cost`.
    context: int = 0

    def calibrated(self, m: int) -> float:
        """verify(m) / verify(1) as measured, at this round's context: between the short
        and the long curve by context length (`at_context`), the short one alone where no
        long one was measured. Measured curves, not the online correction per context
        bucket: a bucket's correction would start from the short curve's price at every
        new length and learn it only from the rounds it spoils (at 4k tokens a 9-token
        pass cost 2.8-3.8 steps where the short curve said 1.8), and its unit, the plain step,
        is rarely timed while drafts pay, so it would lag the context's growth too."""
        if self.long_cost is None:
            return self.cost(m)
        return at_context(self.cost, self.long_cost, self.context, m)

    def step_at_context(self) -> float:
        """The calibration's one-token step (seconds) at this round's context."""
        if self.long_cost is None:
            return self.cost.step_seconds
        return seconds_at_context(self.cost, self.long_cost, self.context, 1)

    def verify_cost(self, m: int) -> float:
        return 1.0 + self.extra_cost_scale * (self.calibrated(m) - 1.0)

    def observe_verify(self, m: int, seconds: float) -> None:
        """Feed back what a verify of m tokens really took (draft time excluded).

        Its extra tokens' cost over the calibrated curve's moves `extra_cost_scale` a
        tenth of the way, unless it is PRICE_AT_ONCE times what the scale says: a wide
        pass far dearer than expected (1.5 s for 9 tokens where one takes 4 ms, quantized
        weights on a GPU) is believed at once, so that the next round already runs plain
        rather than crawl (before any plain round was timed, the next rounds run plain
        and the price waits for them). Plain rounds then re-time the step (the unit, until
        then maybe the calibration's, timed in another moment), and the first pass after
        them sets the scale outright: the true price when the jump was understated, the
        old one when it was a busy moment (at the latest the next probe)."""
        if m == 1:
            previous = self.step_seconds
            if self._retime_left:  # the fastest of the re-timing rounds: one may be a hiccup
                first = self._retime_left == RETIME_ROUNDS or previous is None
                self.step_seconds = seconds if first else min(previous, seconds)
                self._retime_left -= 1
            else:
                self.step_seconds = seconds if previous is None else 0.9 * previous + 0.1 * seconds
            return
        calibrated_extra = self.calibrated(m) - 1.0
        if calibrated_extra <= 0.02:
            return
        step = self.step_seconds or self.step_at_context()
        ratio = max((seconds / step - 1.0) / calibrated_extra, 0.25)
        scale = self.extra_cost_scale
        if self._remeasure and not self._retime_left:
            self.extra_cost_scale, self._remeasure = ratio, False
        elif ratio > PRICE_AT_ONCE * scale:
            # No step timed yet: the unit is the calibration's, maybe from a calmer moment
            # (a busy machine would look dear at every width); re-time before believing it.
            if self.step_seconds is not None:
                self.extra_cost_scale = ratio
            self._retime_left, self._remeasure = RETIME_ROUNDS, True
        else:
            self.extra_cost_scale = 0.9 * scale + 0.1 * min(ratio, 4.0)

    @property
    def label(self) -> str:
        return f"fixed k={self.fixed_k}" if self.fixed_k is not None else "adaptive"

    def acceptance_rate(self, situation: Situation) -> float:
        """The estimated per-token acceptance in `situation` (its prior until observed),
        for a caller that weighs this request's draft against others (the batch)."""
        known = self.stats.get(self._key(situation))
        return known.rate if known else Acceptance.with_prior(situation.prior).rate

    def _key(self, situation: Situation) -> tuple[str, str]:
        streak = "after-full" if self._full_streak.get(situation.source.name) else "fresh"
        return situation.source.name, f"{situation.key}/{streak}"

    def choose(self, situation: Situation | None, limit: int) -> int:
        """Draft length for this round; `limit` caps it (tokens left, proposer's k_max)."""
        return self.choose_among([situation] if situation else [], limit)[1]

    def choose_among(self, situations: list[Situation], limit: int) -> tuple[Situation | None, int]:
        """The situation (of several proposers) and draft length with the best expected
        tokens per second; `limit` caps k (tokens left), as does each source's k_max.
        With a fixed k, the first situation drafts (a plain fallback chain)."""
        if not situations or limit <= 0:
            return (situations[0] if situations else None), 0
        if self.fixed_k is not None:
            return situations[0], min(
                self.fixed_k, limit, getattr(situations[0].source, "k_max", limit)
            )
        if self._retime_left:
            return situations[0], 0
        plans = [
            self._plan(s, min(limit, getattr(s.source, "k_max", limit)), limit) for s in situations
        ]
        best = max(range(len(plans)), key=lambda i: plans[i][1])
        situation, (k, _) = situations[best], plans[best]
        if k == 0:  # keep probing now and then, or a bad start would stick forever
            situation = situations[0]
            key = self._key(situation)
            idle = self._idle_rounds.get(key, 0) + 1
            self._idle_rounds[key] = idle
            wait = max(self._probe_wait.get(key, self.explore_every), self._probe_rounds(situation))
            if idle >= wait and self._could_pay(situation, limit):
                self._idle_rounds[key] = 0
                self._probing.add(key)
                return situation, 1
        return situation, k

    def _probe_rounds(self, situation: Situation) -> float:
        """Plain rounds a probe must wait for its price to be `probe_share` of them: a
        one-token draft (its step, the catch-up of a drafter that was off) and the verify's
        extra token, in target steps. The verify as calibrated, not as lately observed:
        a probe is what finds out whether a price that jumped (a busy moment) still holds."""
        per_draft = self.draft_price(situation.source)
        price = per_draft * (1 + self._catch_up_units(situation)) + self.calibrated(2) - 1.0
        return price / self.probe_share

    def _could_pay(self, situation: Situation, limit: int) -> bool:
        """Would drafting beat plain decoding at OPTIMISTIC_ACCEPTANCE, priced as `_plan`
        prices it? If not, a probe can teach nothing that turns the source on."""
        k_max = min(limit, getattr(situation.source, "k_max", limit))
        return self._plan(situation, k_max, limit, rate=OPTIMISTIC_ACCEPTANCE)[0] > 0

    def _price(self, m: int, hoping: bool) -> float:
        """A verify of m tokens in steps: as lately observed, or, `hoping` (`_could_pay`),
        as calibrated: a price that jumped in a busy moment must not end probing for good."""
        return self.calibrated(m) if hoping else self.verify_cost(m)

    def _plan(
        self, situation: Situation, limit: int, left: int | None = None, rate: float | None = None
    ) -> tuple[int, float]:
        """(best k, its expected speed relative to plain decoding) for one situation.

        A drafter that was off pays its catch-up once, for every round after it: each
        token of the `left` the request may still make (default: `limit`) bears its
        share, so a long answer resumes at once and a few last tokens do not. `rate`: an
        acceptance to price at instead of the learned one (`_could_pay`)."""
        key = self._key(situation)
        hoping = rate is not None
        learned = self.stats.setdefault(key, Acceptance.with_prior(situation.prior)).rate
        # Unproven: no draft of it timed yet (`update` times every draft it is told of).
        if situation.catch_up > 1 and situation.source.name not in self.draft_cost:
            learned = min(learned, UNPROVEN_ACCEPTANCE)
        per_draft = self.draft_price(situation.source)
        catch_up_per_token = self._catch_up_price(situation, per_draft) / max(left or limit, 1)
        best_k, best_speed = 0, 1.0
        # A source may verify more nodes than the depth it drafts (lookahead's window).
        nodes = getattr(situation.source, "verify_nodes", lambda k: k)
        # A block drafter's one pass drafts every k alike: its cost is per round.
        per_round = getattr(situation.source, "cost_per_round", False)
        tokens = []
        if rate is None:
            rate = learned
            tokens = self._expected_by_position(
                situation, key, limit
            ) or self._expected_from_evidence(situation, rate, limit)
        # A round's tokens never fall as k grows; where its cost never falls either (a
        # monotone curve, as every measured one is), a k whose cost alone leaves the most
        # tokens no faster than the best ends the search: no longer k can beat it. (A
        # batch asks every row's plan each round: up to `limit` widths each.)
        most = tokens[limit] if tokens else expected_tokens(rate, limit)
        rising = self.cost.monotone and per_draft >= 0
        if self.long_cost is not None:  # between two monotone curves, not past the long one
            rising = rising and self.long_cost.monotone and self.context <= self.long_cost.context
        for k in range(1, limit + 1):
            made = tokens[k] if tokens else expected_tokens(rate, k)
            cost = self._price(nodes(k) + 1, hoping) + (1 if per_round else k) * per_draft
            cost += catch_up_per_token * made
            if rising and most <= best_speed * cost:
                break
            speed = made / cost
            if speed > best_speed:
                best_k, best_speed = k, speed
        return best_k, best_speed

    def draft_price(self, source) -> float:
        """A draft token's cost in target steps: as timed in this policy's rounds, else
        the source's step measured on this machine beside the target's (`own_cost`, a
        `DraftCost`), else its `cost_hint` (a guess)."""
        if source.name in self.draft_cost:
            return self.draft_cost[source.name]
        own = getattr(source, "own_cost", None)
        return source.cost_hint if own is None else own.step_ratio

    def _catch_up_units(self, situation: Situation) -> float:
        """What the source's catch-up pass costs beyond the one draft step it replaces, in
        its own steps: a pass of n tokens on its measured curve (else the target's, the
        same machine's shape), less one. 0 for a source in step or without state."""
        if situation.catch_up <= 1:
            return 0.0
        own = getattr(situation.source, "own_cost", None)
        curve = self.cost if own is None else own.curve
        return max(0.0, curve(situation.catch_up) - 1.0)

    def _catch_up_price(self, situation: Situation, per_draft: float) -> float:
        """The catch-up pass of a source that was off (`Situation.catch_up`), in target
        steps: paid once, by the round that drafts again (`_plan` spreads it)."""
        return self._catch_up_units(situation) * per_draft

    def _expected_by_position(self, situation: Situation, key, limit: int) -> list[float]:
        """Expected tokens of a round for k = 0..limit from the per-position estimates
        (positions not seen yet: the situation's prior); [] for other sources."""
        if not getattr(situation.source, "acceptance_by_position", False):
            return []
        positions = self.by_position.get(key, [])
        prior = Acceptance.with_prior(situation.prior).rate
        totals, survive = [1.0], 1.0
        for j in range(limit):
            survive *= positions[j].rate if j < len(positions) else prior
            totals.append(totals[-1] + survive)
        return totals

    def _expected_from_evidence(self, situation: Situation, rate: float, limit: int) -> list[float]:
        """Expected tokens of a round for k = 0..limit from the proposer's own counts at
        this match (`Situation.evidence`): position j is kept with probability
        rate x followed_j / seen_j, the learned rate scaled by the share of occurrences
        that went on with the line (SuffixDecoding's path probability), and past the
        line's end nothing is. The rate speaks for the occurrence that drafts the line
        (most lines rest on one or two); the share only says how many others went
        elsewhere. Counting agreeing occurrences as evidence *above* the rate (a
        pseudo-count blend) drafted longer after a shared template and measured worse
        on the held-out agent stream (docs/design/suffix.md). [] when there is no evidence."""
        if not situation.evidence or not self.read_evidence:
            return []
        totals, survive = [1.0], 1.0
        for j in range(limit):
            if j < len(situation.evidence):
                followed, seen = situation.evidence[j]
                survive *= rate * followed / seen
            else:
                survive = 0.0
            totals.append(totals[-1] + survive)
        return totals

    def observe_unverified(self, situation: Situation, first_right: bool) -> None:
        """A draft the batch cut to nothing still tells whether its first token was the
        target's own choice at that position (that token is verified anyway): learn
        acceptance from it, so that rounds of W = 0 do not freeze the estimate that
        decides whether speculation comes back. For a drafter that samples, a match is
        rarer than an acceptance (p(x) <= min(1, p(x)/q(x))): the estimate errs low."""
        key = self._key(situation)
        self.stats.setdefault(key, Acceptance.with_prior(situation.prior)).update(
            1, int(first_right), self.decay
        )

    def update(
        self, situation: Situation, drafted: int, accepted: int, draft_seconds: float
    ) -> None:
        if drafted == 0:
            return
        key = self._key(situation)
        if key in self._probing:
            self._probing.discard(key)
            wait = self._probe_wait.get(key, self.explore_every)
            self._probe_wait[key] = (
                self.explore_every if accepted else min(2 * wait, 16 * self.explore_every)
            )
        self.stats.setdefault(key, Acceptance.with_prior(situation.prior)).update(
            drafted, accepted, self.decay
        )
        if getattr(situation.source, "acceptance_by_position", False):
            positions = self.by_position.setdefault(key, [])
            for j in range(min(accepted + 1, drafted)):  # the positions this round reached
                if j == len(positions):
                    positions.append(Acceptance.with_prior(situation.prior))
                positions[j].update(1, 1 if j < accepted else 0, self.decay)
        self._full_streak[situation.source.name] = accepted == drafted
        name = situation.source.name
        per = 1 if getattr(situation.source, "cost_per_round", False) else drafted
        per += self._catch_up_units(situation)  # a pass that caught up: not a token's price
        measured = draft_seconds / per / (self.step_seconds or self.cost.step_seconds)
        previous = self.draft_cost.get(name)
        self.draft_cost[name] = measured if previous is None else 0.8 * previous + 0.2 * measured
