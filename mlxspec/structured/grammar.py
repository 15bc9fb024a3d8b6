"""Structured output: a request's grammar (`settings.Grammar`: a JSON schema, a regex, a
Lark grammar) compiled, and its state while the request decodes, as token masks.

The grammar engine is llguidance (the one llama.cpp, vLLM and SGLang use): it compiles a
JSON schema in milliseconds, computes a token mask in tens of microseconds on SmolLM2's
49k vocabulary, rolls back for speculation, and tells which tokens the grammar forces.
mlxspec's part is to keep decoding lossless under it (see docs/design/grammar.md):

- the reference is *constrained* plain decoding: at every position only the tokens the
  grammar allows, the target's distribution renormalised over them;
- in a verify pass every row is masked by the grammar's state after the drafts before it;
  a draft the grammar forbids is cut (a tree: pruned) before the pass, never paid for;
- the tokens the grammar forces are drafts that cost nothing to make (`forced`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for

import mlx.core as mx
import numpy as np

from mlxspec.settings import Grammar, GrammarError

# Compiled grammars kept per tokenizer (a matcher is copied per request in microseconds).
CACHED_GRAMMARS = 64
# The longest a grammar may take to compile before its request fails (a tool schema takes
# milliseconds; llguidance's own fuel limits end most runaway grammars sooner).
COMPILE_SECONDS = 10.0
# How long a request's start waits for its grammar: one that fails at once (a syntax
# error, an unknown keyword) is refused right there, as a request error.
QUICK_SECONDS = 0.2
# Compiling runs here, off the round loop's thread (llguidance lets go of the GIL).
_compiler = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mlxspec-grammar")


_tokenizers: dict[int, tuple[object, object]] = {}
_compiled: OrderedDict[tuple[int, str], object] = OrderedDict()
_lock = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of an mlx-lm tokenizer (built once per tokenizer: about 0.7 s
    for a 49k vocabulary). `vocab_size`: the LM head's width, which may pad the
    tokenizer's vocabulary; the ids past it are never allowed."""
    with _lock:
        held = _tokenizers.get(id(tokenizer))
        if held is not None and held[0] is tokenizer:
            return held[1]
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not isinstance(hf, PreTrainedTokenizerFast):
        raise GrammarError(
            "structured output needs a fast (Rust) Hugging Face tokenizer; "
            f"this model's is {type(hf).__name__}"
        )
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    built = llguidance.hf.from_tokenizer(hf, n_vocab=max(vocab_size, len(hf)), eos_token=eos)
    with _lock:
        _tokenizers[id(tokenizer)] = (tokenizer, built)
    return built


def compile_grammar(grammar: Grammar, tokenizer, vocab_size: int):
    """A fresh matcher for `grammar` at its start, or GrammarError saying why it cannot
    be enforced. Compiled once per (tokenizer, grammar), copied per request."""
    from llguidance import LLMatcher

    llg_tokenizer = grammar_tokenizer(tokenizer, vocab_size)
    text = grammar.llguidance()
    key = (id(llg_tokenizer), text)
    with _lock:
        template = _compiled.get(key)
        if template is not None:
            _compiled.move_to_end(key)
    if template is None:
        matcher = LLMatcher(llg_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(error_line(matcher.get_error()))
        with _lock:
            _compiled[key] = matcher
            while len(_compiled) > CACHED_GRAMMARS:
                _compiled.popitem(last=False)
        template = matcher
    return template.deep_copy()


UNIMPLEMENTED = re.compile(r"^Unimplemented keys: \[(.*)\]$")
UNKNOWN_FORMAT = re.compile(r"^Unknown format: (.*)$")
AT_POSITION = re.compile(r"^at \d+\(\d+\): ")  # a place in llguidance's wrapping of a regex


def error_line(message: str) -> str:
    """llguidance's error, as one line for a user: a keyword or format it cannot enforce
    named; a regex's parse error with the line that says what is wrong (the first only
    says where); else its first line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    first = AT_POSITION.sub("", lines[0])
    if first.endswith("regex parse error:"):  # what is wrong is further down
        first += " " + next(
            (line[len("error: ") :] for line in lines if line.startswith("error: ")), ""
        )
    if found := UNIMPLEMENTED.match(first):
        return f"cannot enforce the keyword(s) {found.group(1)}"
    if found := UNKNOWN_FORMAT.match(first):
        return f'cannot enforce "format": {json.dumps(found.group(1))}'
    return first


def masked_logits(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """`logits` (m, V) with what `allowed` (m, V' bools) forbids set to -inf: the
    distribution constrained decoding draws from, renormalised by the softmax. An LM head
    wider than the tokenizer (V > V') has its padding ids forbidden."""
    width = logits.shape[-1]
    if allowed.shape[-1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[-1])))
    keep = mx.array(allowed[: logits.shape[0], :width])
    return mx.where(keep, logits, mx.array(-mx.inf, logits.dtype))


def mask_processor(constraint: Constraint, prompt_length: int):
    """The constraint as an mlx-lm logits processor (`generate_step`'s
    `logits_processors`): it takes in the tokens generated since its last call, then
    masks the next step's logits. Constrained plain decoding on mlx-lm's own loop."""
    taken = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal taken
        new = tokens[prompt_length + taken :].tolist()
        constraint.take(new)
        taken += len(new)
        return masked_logits(logits, constraint.mask()[None])

    return process


class Constraint:
    """One request's grammar state: the matcher has taken in every token the request
    produced. Per round: the forced tokens (free drafts), the draft cut to what the
    grammar allows with a mask per verify row, then the round's new tokens taken in."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int, wait: float = COMPILE_SECONDS):
        """Compiling starts now on a thread of its own, so that it overlaps the request's
        wait and its prefill (the scheduler admits it once `ready`); `wait`: seconds to
        wait for it here, where a grammar that fails raises GrammarError."""
        self.grammar, self.vocab_size = grammar, vocab_size
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        self._started = time.monotonic()
        self._compiling = _compiler.submit(compile_grammar, grammar, tokenizer, vocab_size)
        self._matcher = None
        self.wait(wait)
        if self._compiling.done() or wait >= COMPILE_SECONDS:
            self.matcher  # noqa: B018  (raises what compiling found wrong)

    @property
    def ready(self) -> bool:
        """Compiled, or failed, or out of time: `matcher` no longer waits."""
        overdue = time.monotonic() - self._started >= COMPILE_SECONDS
        return self._matcher is not None or self._compiling.done() or overdue

    def wait(self, seconds: float) -> None:
        """Wait at most `seconds` for compiling to end."""
        wait_for([self._compiling], timeout=seconds)

    @property
    def matcher(self):
        """The request's matcher, compiled (waiting for it, within COMPILE_SECONDS of the
        start); GrammarError if it cannot be enforced or took too long."""
        if self._matcher is None:
            left = COMPILE_SECONDS - (time.monotonic() - self._started)
            try:
                self._matcher = self._compiling.result(timeout=max(left, 0.0))
            except FutureTimeout:
                raise GrammarError(
                    f"the grammar did not compile within {COMPILE_SECONDS:g} s; simplify it"
                ) from None
        return self._matcher

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and allows nothing but the end of the text."""
        return self.matcher.is_stopped()

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (at most `limit`): the canonical spelling of
        its forced bytes. llguidance's mask allows only that spelling there, so the
        target's choice differs only where the mask leaves it a choice."""
        if limit <= 0:
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def mask(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar allows now."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if allowed.shape[0] >= self.vocab_size:
            return allowed[: self.vocab_size]
        return np.pad(allowed, (0, self.vocab_size - allowed.shape[0]))

    def prune(
        self, tokens: list[int], parents: list[int]
    ) -> tuple[list[int], np.ndarray, int | None]:
        """Of a draft tree (nodes 1..n: `tokens`, `parents`, parents first), the nodes whose
        whole path the grammar allows, and the mask of each kept node's row, the root's
        first: (kept node numbers, (1 + kept, vocab_size) masks, the first refused node,
        where the draft is a line). The matcher ends where it began."""
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for node, parent in enumerate(parents, start=1):
            children[parent].append(node)
        kept, refused = [], None
        rows = {}  # node -> its mask row

        def visit(node: int) -> None:
            nonlocal refused
            rows[node] = self.mask()
            for child in children[node]:
                token = tokens[child - 1]
                if rows[node][token] and token in self.eos:
                    # The end, where the grammar allows it: nothing follows it (its row
                    # decides nothing), and llguidance takes it without a token to roll
                    # back, so it is not taken in at all.
                    kept.append(child)
                    rows[child] = rows[node]
                    if children[child] and refused is None:
                        refused = children[child][0]
                    continue
                if not rows[node][token] or not self.matcher.consume_token(token):
                    refused = child if refused is None else refused
                    continue
                kept.append(child)
                visit(child)
                self.matcher.rollback(1)

        visit(0)
        kept.sort()
        masks = np.stack([rows[0], *(rows[node] for node in kept)])
        return kept, masks, refused

    def take(self, tokens: list[int]) -> None:
        """Take in the round's new tokens (the target chose each among those allowed)."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")
