"""The bench run: untimed preparation, then every (prompt, repeat, method) in turn.

The order interleaves methods within each prompt and repeat, so a noisy machine slows
all methods alike instead of whichever happened to run during the noise. Everything
that would distort a timed row happens before the first one: proposers are built, the
verify cost is calibrated (the adaptive policy and the speedup estimate use it), and
every method runs once (warm-up).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxspec.bench import BenchError
from mlxspec.bench.lossless import Divergence, first_divergence, plain_top2_gap
from mlxspec.bench.methods import MLX_LM_SPECULATIVE, PLAIN, Method, draft_proposer
from mlxspec.bench.runners import (
    Measurement,
    Stream,
    run_mlx_lm_speculative,
    run_mlxspec,
    run_plain_mlx_lm,
)
from mlxspec.bench.suites import BenchPrompt
from mlxspec.registry.models_toml import NONE
from mlxspec.registry.runtime import Runtime
from mlxspec.structured.answer import AnswerConstraint, answer_grammar
from mlxspec.structured.grammar import Grammar
from mlxspec.suffix.store import HistoryStore

WARM_UP = [{"role": "user", "content": "Say hello, then count to five."}]
WARM_UP_TOKENS = 8

Progress = Callable[[int, int, BenchPrompt, Method], None]


@dataclass
class Run:
    prompt: BenchPrompt
    method: Method
    repeat: int
    measurement: Measurement
    divergence: Divergence | None = None  # vs plain-mlx-lm on the same prompt


def schedule(
    prompts: list[BenchPrompt], methods: list[Method], repeats: int, replay: bool = False
) -> list[tuple[BenchPrompt, int, Method]]:
    """Every (prompt, repeat, method); a replay goes through all prompts in order once per
    repeat, so each repeat's history builds up as in a real session."""
    if replay:
        return [(p, r, m) for r in range(repeats) for p in prompts for m in methods]
    return [(p, r, m) for p in prompts for r in range(repeats) for m in methods]


class Bench:
    def __init__(
        self,
        runtime: Runtime,
        prompts: list[BenchPrompt],
        methods: list[Method],
        max_tokens: int,
        repeats: int,
        replay: bool = False,
        stream: Stream | None = None,
    ):
        """`stream`: how mlxspec rows run (default: the engine's own; sharded: every rank
        runs the same plan in step, so mlx-lm's rows run sharded too)."""
        if methods[0] != Method(PLAIN):
            raise ValueError("plain-mlx-lm must come first: every other row is checked against it")
        self.runtime, self.prompts, self.methods = runtime, prompts, methods
        self.max_tokens, self.repeats, self.replay = max_tokens, repeats, replay
        self.stream = stream
        self.plan = schedule(prompts, methods, repeats, replay)
        # No run reads or writes the user's history: every run's store is a temporary
        # one (see `runs`), so a method never drafts from another's answers.
        self._histories = tempfile.TemporaryDirectory(prefix="mlxspec-bench-history-")
        self._draft = None  # mlx-lm's draft model: the very module mlxspec's proposer uses
        self._encoded: dict[str, list[int]] = {}
        # Each constrained prompt's grammar as its answer is read (after any reasoning).
        self._grammars: dict[str, Grammar | None] = {}

    @property
    def total(self) -> int:
        return len(self.plan)

    def prepare(self, notify: Callable[[str], None] = lambda _: None) -> None:
        """Build, calibrate and warm up; none of it inside a timed row."""
        engine = self.runtime.engine
        for method in self.methods:
            if method.runner == "mlxspec":
                self.runtime.proposer(method.proposer)
            elif method.runner == MLX_LM_SPECULATIVE:
                name = self.runtime.proposer(draft_proposer(self.runtime.entry).name)
                self._draft = engine.proposers[name].model
        # Every drafting row needs it: the adaptive policy to choose k, and every row's
        # estimated speedup to price its rounds (mlxspec/speedup.py).
        if any(m.runner == "mlxspec" and m.proposer != NONE for m in self.methods):
            engine.verify_cost  # noqa: B018  (measured once per model and machine, then cached)
        self._encoded = {
            p.id: engine.encode_chat([{"role": "user", "content": p.text}]) for p in self.prompts
        }
        self._grammars = {p.id: self._answer_grammar(p) for p in self.prompts}
        self.runtime.use_history(HistoryStore(Path(self._histories.name) / "warm-up"))
        notify(f"warming up {len(self.methods)} methods")
        warm_up = engine.encode_chat(WARM_UP)
        for method in self.methods:
            try:
                self.measure(method, warm_up, WARM_UP_TOKENS)
            except ValueError as err:  # e.g. mlx-lm's speculation needs a trimmable cache
                raise BenchError(
                    f"{method.name} cannot run on '{self.runtime.entry.name}': {err}; "
                    "leave it out with --proposers"
                ) from None

    def runs(self, progress: Progress = lambda *_: None) -> Iterator[Run]:
        """Timed runs in schedule order; each checked against plain-mlx-lm's tokens."""
        reference: dict[str, list[int]] = {}
        for index, (prompt, repeat, method) in enumerate(self.plan):
            progress(index, self.total, prompt, method)
            tokens = self._encoded[prompt.id]
            # A replay: each (method, repeat) its own history, building up over the
            # prompts. Otherwise every run starts from an empty one: history is on, as
            # for a user, but only the request itself (and a shipped seed) can draft.
            run_name = f"{self.methods.index(method)}-{repeat}"
            folder = Path(self._histories.name) / (
                run_name if self.replay else f"{run_name}-{prompt.id}"
            )
            self.runtime.use_history(HistoryStore(folder))
            grammar = None if method.free else self._grammars[prompt.id]
            measurement = self.measure(method, tokens, self.max_tokens, grammar)
            # Plain runs first; a free row against plain decoding free too.
            key = (prompt.id, grammar is None)
            reference.setdefault(key, measurement.tokens)
            divergence = None
            position = first_divergence(reference[key], measurement.tokens)
            if position is not None:
                plain = reference[key][:position]
                gap = plain_top2_gap(self.runtime.loaded.model, tokens + plain)
                divergence = Divergence(repeat, position, gap)
            yield Run(prompt, method, repeat, measurement, divergence)

    def _answer_grammar(self, prompt: BenchPrompt) -> Grammar | None:
        """The prompt's grammar, applied where its answer starts (after the model's
        reasoning, in its own markup: as `serve` applies a response_format)."""
        if prompt.grammar is None:
            return None
        messages = [{"role": "user", "content": prompt.text}]
        constraint = AnswerConstraint(grammar=prompt.grammar)
        engine = self.runtime.engine
        try:
            grammar = answer_grammar(engine.tokenizer, messages, constraint)
            engine.constraint(grammar)  # compiled once now: a bad schema fails before a row
        except ValueError as err:  # GrammarError, or the engine's GenerationError
            raise BenchError(f"prompt {prompt.id!r}: {err}") from None
        return grammar

    def measure(
        self, method: Method, prompt: list[int], max_tokens: int, grammar: Grammar | None = None
    ) -> Measurement:
        if method.runner in (PLAIN, MLX_LM_SPECULATIVE):
            if grammar is not None and method.runner == MLX_LM_SPECULATIVE:
                raise BenchError(
                    f"{MLX_LM_SPECULATIVE} cannot constrain its answers; leave it out with "
                    "--proposers, or add @free to it"
                )
            measurement = self._measure_mlx_lm(method, prompt, max_tokens, grammar)
            if self.stream is not None:
                # mlx-lm's loop leaves one forward pass in flight on its own stream; sharded,
                # its collectives would race the next row's and pair up wrongly across ranks.
                mx.synchronize(generation_stream)
            return measurement
        return run_mlxspec(
            self.runtime.engine,
            prompt,
            max_tokens,
            method.proposer,
            method.k,
            method.tree,
            True,  # history on: every run has a temporary store of its own (see `runs`)
            self.stream,
            grammar,
        )

    def _measure_mlx_lm(
        self, method: Method, prompt: list[int], max_tokens: int, grammar: Grammar | None
    ) -> Measurement:
        loaded = self.runtime.loaded
        if method.runner == PLAIN:
            engine = self.runtime.engine
            constraint = None if grammar is None else engine.constraint(grammar)
            return run_plain_mlx_lm(loaded.model, loaded.tokenizer, prompt, max_tokens, constraint)
        return run_mlx_lm_speculative(
            loaded.model, self._draft, loaded.tokenizer, prompt, max_tokens, method.k_label
        )
