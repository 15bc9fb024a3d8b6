"""What a batch round does with one row: can its proposer join, which of its draft it
keeps, what the host reads of its logits, and its own copy of the proposer.

Plain functions the scheduler calls (and the server and the concurrency bench, for
`unbatchable_reason`); kept apart so the scheduler file holds the round loop alone.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from mlxspec.decoding.request import RequestRun
from mlxspec.logprobs import PendingLogprobs, TokenLogprob
from mlxspec.models.tree import DraftTree, keep_best
from mlxspec.proposers.base import Proposer
from mlxspec.proposers.self_spec import SelfSpeculation


def unbatchable_reason(proposer: Proposer, capture_unsupported: str | None) -> str | None:
    """Why `proposer` cannot draft for one row of a batch yet (None: it can).

    `capture_unsupported`: why the batch cannot hand a row its hidden states (None: it
    can; `BatchCaches.capture_unsupported`). Self-speculation runs the target's own
    layers and cache, which a batch's rows do not each have (a request alone does).
    """
    for member in [proposer, *getattr(proposer, "members", ())]:
        if member.needs_hidden and capture_unsupported:
            name = member.name
            return f"proposer '{name}' reads the target's hidden states: {capture_unsupported}"
        if isinstance(member, SelfSpeculation):
            return f"proposer '{member.name}' runs the target's own layers and cache"
    return None


def cut_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first n tokens of a line; of a tree, its n likeliest nodes with their
    ancestors (without scores, its first n: breadth-first, so ancestors come first)."""
    if tree.is_chain or tree.scores is None:
        return DraftTree(tree.tokens[:n], tree.parents[:n])
    return keep_best(tree, n)


def first_guess(tree: DraftTree) -> int:
    """The draft's first token: of a tree, its likeliest child of the root (a tree's
    nodes of one depth come in no order of likelihood)."""
    children = tree.children()[0]  # node numbers: node n's token is tokens[n - 1]
    if tree.scores is not None:
        children.sort(key=lambda node: -tree.scores[node - 1])
    return tree.tokens[children[0] - 1]


def greedy_reads(run: RequestRun, processed: mx.array) -> dict[str, mx.array]:
    """What the host reads of a greedy row's processed logits (m, V), lazy: the argmax of
    each row and, where the run counts them, its near ties. Evaluated with the logits in
    one go: read one by one, each is an evaluation per row (1.3 ms each over 8 rows of a
    tiny model here) and, after a launch, waits behind the launched pass. Sampling: {}."""
    if not run.sampling.greedy:
        return {}
    reads = {"argmax": mx.argmax(processed, axis=-1)}
    if run.counts_near_ties:
        reads["near_ties"] = run.scorer.near_tie_rows(processed, reads["argmax"])
    return reads


def batch_greedy_reads(runs: list[RequestRun], logits: mx.array) -> dict[str, mx.array] | None:
    """`greedy_reads` of a whole batch at once, where every row is greedy over its logits
    as the verify left them (no processors): one argmax and one near-tie test over the
    (B, W, V) logits, against about eight small operations a row (on a GPU, each a kernel
    launch: an H100's batch of 8 ran 0.73x mlx-lm's `batch_generate`). None otherwise
    (a processor or a grammar changes a row's logits);
    `split_reads` cuts the evaluated whole into each row's."""
    plain = (run.sampling.greedy and not run.scorer.processors for run in runs)
    if not all(plain) or any(run.constraint is not None for run in runs):
        return None
    whole = {"argmax": mx.argmax(logits, axis=-1)}
    if any(run.counts_near_ties for run in runs):
        rows = logits.reshape(-1, logits.shape[-1])
        ties = runs[0].scorer.near_tie_rows(rows, whole["argmax"].reshape(-1))
        whole["near_ties"] = ties.reshape(logits.shape[:2])
    return whole


def split_reads(whole: dict[str, mx.array], lengths: list[int]) -> list[dict[str, list]]:
    """Each row's reads (its first `length` columns) from `batch_greedy_reads`' evaluated
    arrays, read to the host in one go."""
    host = {name: values.tolist() for name, values in whole.items()}
    return [{name: rows[i][:n] for name, rows in host.items()} for i, n in enumerate(lengths)]


def read_logprobs(
    runs: list[RequestRun], pending: list[PendingLogprobs | None]
) -> list[list[TokenLogprob] | None]:
    """Each row's new tokens' logprobs from `RequestRun.pending_logprobs` (None where its
    request did not ask): what every asking row chose, and its top N, read back in one
    evaluation once acceptance chose the tokens."""
    asked = [array for p in pending if p is not None for array in p.arrays]
    if asked:
        mx.eval(asked)
    return [None if p is None else p.entries(run.tokenizer.decode) for run, p in zip(runs, pending)]


def as_list(read: mx.array | list | None) -> list | None:
    """A read as a host list (`split_reads` made it one already)."""
    return read if read is None or isinstance(read, list) else read.tolist()


def private_copy(proposer: Proposer) -> Proposer:
    """`proposer` for one request alone: its own caches and indexes, weights shared."""
    if hasattr(proposer, "members"):
        mine = copy.copy(proposer)
        mine.members = [private_copy(member) for member in proposer.members]
        return mine
    if hasattr(proposer, "reset"):  # e.g. a draft model's cache, suffix's request index:
        mine = copy.copy(proposer)  # share weights and the history store, start afresh
        mine.reset()
        return mine
    return copy.deepcopy(proposer)
