"""What the bench compares: mlx-lm's own loops and mlxspec's engine with each proposer.

Method names, as `--proposers` takes them (comma-separated):

    plain-mlx-lm               mlx-lm's generate_step: the baseline every speedup is against
    mlx-lm-speculative[@k=N]   mlx-lm's speculative_generate_step with the entry's draft model
    [mlxspec:]none             mlxspec's own loop without drafts (its overhead vs mlx-lm)
    [mlxspec:]NAME[@k=N][@tree] mlxspec with proposer NAME; adaptive k unless @k=N is given;
                               @tree verifies a draft tree per round (k: its depth)
    METHOD@free                any method with the prompts' schema or regex dropped: what
                               the constraint costs (or saves), on the same prompts
    core                       plain-mlx-lm, mlx-lm-speculative, mlxspec:none, mlxspec with the
                               entry's default proposer (adaptive and fixed k) and with the
                               draft pair (adaptive)
    all                        core, plus every proposer adaptive and at a fixed k, and
                               every proposer that can branch as a tree
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxspec.bench import BenchError
from mlxspec.registry.models_toml import NONE, ModelEntry, ProposerConfig

PLAIN = "plain-mlx-lm"
MLX_LM_SPECULATIVE = "mlx-lm-speculative"
MLX_LM_DRAFT_TOKENS = 3
# One fixed-k row per kind beside the adaptive one; draft models at mlx-lm's k, so the
# mlx-lm and mlxspec rows of the same pair differ only in the loop around it.
FIXED_K = {"prompt-lookup": 4, "draft-model": MLX_LM_DRAFT_TOKENS, "head": 3}
BRANCHING = ("prompt-lookup", "draft-model", "head", "medusa", "chain")  # trees that branch


@dataclass(frozen=True)
class Method:
    runner: str  # "plain-mlx-lm" | "mlx-lm-speculative" | "mlxspec"
    proposer: str | None = None  # mlxspec: a proposer of the entry, or "none"
    k: int | None = None  # fixed draft length; None: adaptive (mlx-lm: its default, 3)
    tree: bool = False  # mlxspec: verify a draft tree per round
    free: bool = False  # the prompts' schema or regex dropped

    @property
    def name(self) -> str:
        base = f"mlxspec:{self.proposer}" if self.runner == "mlxspec" else self.runner
        base = base if self.k is None or self.k == 0 else f"{base}@k={self.k}"
        base = f"{base}@tree" if self.tree else base
        return f"{base}@free" if self.free else base

    @property
    def k_label(self) -> int | str:
        """The draft length as rows show it: a number, or 'adaptive'."""
        if self.runner == MLX_LM_SPECULATIVE:
            return self.k or MLX_LM_DRAFT_TOKENS
        if self.runner == "mlxspec" and self.proposer != NONE and self.k is None:
            return "adaptive"
        return self.k or 0

    @property
    def speculative(self) -> bool:
        return self.runner == MLX_LM_SPECULATIVE or (
            self.runner == "mlxspec" and self.proposer != NONE
        )


def draft_proposer(entry: ModelEntry) -> ProposerConfig | None:
    """The entry's draft-model proposer: the pair mlx-lm's speculative decoding also runs."""
    return next((p for p in entry.proposers.values() if p.kind == "draft-model"), None)


def core_methods(entry: ModelEntry) -> list[Method]:
    """The headline comparisons: the two plain loops, mlx-lm's speculative decoding on the
    entry's draft pair, and mlxspec's default proposer (adaptive and at a fixed k) and
    draft pair (adaptive). `all` adds the draft pair at mlx-lm's own k, which isolates the
    loop, but a poor draft pair makes those rows slow."""
    draft = draft_proposer(entry)
    methods = [Method(PLAIN)]
    if draft is not None:
        methods.append(Method(MLX_LM_SPECULATIVE))
    methods.append(Method("mlxspec", NONE, 0))
    default = entry.proposers.get(entry.default_proposer)
    if default is not None:
        methods.append(Method("mlxspec", default.name))
        if default.kind in FIXED_K:
            methods.append(Method("mlxspec", default.name, FIXED_K[default.kind]))
    if draft is not None and draft is not default:
        methods.append(Method("mlxspec", draft.name))
    return methods


def all_methods(entry: ModelEntry) -> list[Method]:
    methods = core_methods(entry)
    for config in entry.proposers.values():
        methods.append(Method("mlxspec", config.name))
        if config.kind in FIXED_K:
            methods.append(Method("mlxspec", config.name, FIXED_K[config.kind]))
        if config.kind in BRANCHING:
            methods.append(Method("mlxspec", config.name, tree=True))
    return list(dict.fromkeys(methods))


def with_trees(methods: list[Method], tree: bool | None) -> list[Method]:
    """--tree: every speculative mlxspec row gets a tree twin beside it (line vs tree for
    each proposer); --no-tree: only lines; None: as listed."""
    if tree is None:
        return methods
    out: list[Method] = []
    for method in methods:
        line = replace(method, tree=False)
        out.append(line)
        if tree and line.runner == "mlxspec" and line.proposer != NONE:
            out.append(replace(line, tree=True))
    return list(dict.fromkeys(out))


def parse_methods(text: str, entry: ModelEntry) -> list[Method]:
    """Methods from a comma-separated list; plain-mlx-lm is always measured, first."""
    groups = {"core": core_methods, "all": all_methods}
    methods: list[Method] = []
    for item in (part.strip() for part in text.split(",")):
        if item in groups:
            methods += groups[item](entry)
        elif item:
            methods.append(_method(item, entry))
    if not methods:
        raise BenchError("--proposers is empty; name at least one method")
    plain = Method(PLAIN)
    return [plain, *dict.fromkeys(m for m in methods if m != plain)]


def _method(item: str, entry: ModelEntry) -> Method:
    name, *options = item.split("@")
    tree, free = "tree" in options, "free" in options
    k_texts = [o for o in options if o not in ("tree", "free")]
    if len(k_texts) > 1:
        raise BenchError(f"{item!r}: give @k=N at most once (and @tree, @free at most once)")
    k = _k(k_texts[0], item) if k_texts else None
    return replace(_named(name, item, entry, k, tree), free=free)


def _named(name: str, item: str, entry: ModelEntry, k: int | None, tree: bool) -> Method:
    if name in (PLAIN, MLX_LM_SPECULATIVE) and tree:
        raise BenchError(f"{item!r}: only mlxspec methods verify trees")
    if name == PLAIN:
        if k is not None:
            raise BenchError(f"{item!r}: plain-mlx-lm takes no @k")
        return Method(PLAIN)
    if name == MLX_LM_SPECULATIVE:
        if draft_proposer(entry) is None:
            raise BenchError(
                f"{MLX_LM_SPECULATIVE} needs a draft-model proposer, and '{entry.name}' has none"
            )
        return Method(MLX_LM_SPECULATIVE, k=k)
    proposer = name.removeprefix("mlxspec:")
    if proposer not in entry.proposer_names:
        known = ["core", "all", PLAIN, *([MLX_LM_SPECULATIVE] if draft_proposer(entry) else [])]
        known += [f"mlxspec:{p}" for p in entry.proposer_names]
        raise BenchError(f"unknown method {item!r}; known: {', '.join(known)} (add @k=N to fix k)")
    if proposer == NONE:
        if k or tree:
            raise BenchError(f"{item!r}: mlxspec:none drafts nothing, so it takes no @k or @tree")
        return Method("mlxspec", NONE, 0)
    return Method("mlxspec", proposer, k, tree)


def _k(text: str, item: str) -> int:
    value = text.removeprefix("k=")
    if not value.isdigit() or int(value) < 1:
        raise BenchError(f"{item!r}: write the draft length as @k=N with N >= 1")
    return int(value)
