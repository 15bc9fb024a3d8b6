"""The next round's pass started before this round's tokens reach the host: when a round
may launch it and which tokens it runs over (the pass itself, kept until the next round
takes it or something else takes it back, is `target.LaunchedPass`).

mlx-lm's `generate_step` and `batch_generate` pipeline every step so: the next pass is
built on the lazy token and `mx.async_eval`ed before the host reads this one, so the
host's work (acceptance, detokenizing, events) runs while the pass computes. A launch
never changes a result: the next round's verify takes the pass only if it is over
exactly that round's rows; anything else (a join, a leave, a draft) takes it back first
by a one-column trim of every row, so the caches hold what they held without it.
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.decoding.request import RequestRun


def launches_next(run: RequestRun, rows: list[list[int]]) -> bool:
    """Whether a request (on caches that can take a pass back) may have the next round's
    pass start before this round's token is known on the host (mlx-lm's `generate_step`
    pipelines every step so): greedy, drafting nothing this round nor the next (k fixed
    at 0), not ended by its length this round. A round that ends it otherwise (EOS, a
    stop string, a cancel, a completed grammar) takes the pass back. A request that
    asked for logprobs reads them once its token is known, which would wait behind the
    launched pass: it is not launched for. `rows`: the round's one row of the request."""
    return (
        rows == [[run.sequence[-1]]]
        and run.top_logprobs is None
        and run.sampling.greedy
        and run.policy.fixed_k == 0
        and len(run.produced) + 1 < run.max_tokens
    )


def next_tokens(reads: list[dict[str, mx.array]]) -> mx.array:
    """The tokens a plain round chose, still lazy, one a row: the last column of each
    read's argmax (`batch_greedy_reads`' whole batch at once, or each row's own)."""
    return mx.concatenate([read["argmax"][..., -1:].reshape(-1) for read in reads])


def launch_next(caches, decided: list[mx.array], reads: list[dict[str, mx.array]]) -> None:
    """Start the next round's pass on this round's argmax (`next_tokens`), still lazy:
    it computes while the host accepts, detokenizes and hands out this round's events.
    What the host reads of this round (`decided`, `reads`) is scheduled on its own first:
    MLX signals every array of one `async_eval` at the end of all of it, so read after
    being scheduled with the next pass, it waited for that whole pass (0.6 ms a token of
    a 6 ms pass on this CPU; on a GPU, all the overlap). `caches`: `SingleCaches` or
    `BatchCaches`, whichever can take the pass back."""
    mx.async_eval(decided, reads)
    caches.launch(next_tokens(reads), [read["argmax"] for read in reads])


def one_step(round_seconds: float) -> float:
    """The price of a plain round whose pass was launched the round before: one plain
    step (the wait for it is not what the pass cost)."""
    return 1.0
