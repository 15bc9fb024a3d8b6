"""From a models.toml entry to a ready engine: load the target, build proposers on demand.

Front ends (CLI, TUI, server, bench) open a `Runtime` and ask it for proposers by
name; weights for a draft model are loaded only when that proposer is first used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec.batch.memory import Holdings, fit, gb
from mlxspec.decoding.draft_cost import DraftCost, cached_draft_cost, measure_draft_cost
from mlxspec.decoding.draft_form import DraftForm, choose_draft_form
from mlxspec.decoding.engine import Engine
from mlxspec.decoding.verify_cost import (
    cached_verify_cost,
    calibration_key,
    known_calibration,
    measure_again,
)
from mlxspec.decoding.weight_form import (
    DEQUANTIZED,
    QUANTIZED,
    decide_weight_form,
    dequantized_bytes,
    free_memory_bytes,
)
from mlxspec.decoding.weights_choice import (
    AUTO,
    WeightsChoice,
    for_plain_decoding,
    held_weights,
    resolve_weights,
)
from mlxspec.drafter.block import BLOCK_PATTERNS, load_block_drafter
from mlxspec.drafter.exit import EXIT_PATTERNS, load_exit
from mlxspec.drafter.formats import load_head
from mlxspec.drafter.head import HEAD_PATTERNS, HeadError
from mlxspec.drafter.medusa import MEDUSA_PATTERNS, load_medusa
from mlxspec.drafter.mtp_pull import mtp_folder
from mlxspec.models.anatomy import UnsupportedModel
from mlxspec.models.footprint import footprint
from mlxspec.models.kv_form import KVForm, kv_form, kv_token_bytes
from mlxspec.models.loading import (
    LoadedModel,
    LoadError,
    fetch_weights,
    load_model,
    weights_location,
)
from mlxspec.proposers import (
    Chain,
    DraftModel,
    Lookahead,
    PromptLookup,
    Proposer,
    SelfSpeculation,
    check_same_vocabulary,
    truncated_model,
)
from mlxspec.proposers.block import BlockProposer
from mlxspec.proposers.draft_model import VocabularyMismatch
from mlxspec.proposers.head import HeadProposer
from mlxspec.proposers.medusa import MedusaProposer
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.registry.models_toml import ModelEntry, ProposerConfig
from mlxspec.registry.prompt_store import prompt_cache_for
from mlxspec.suffix.seed import seed_index
from mlxspec.suffix.store import HistoryStore, history_store


class ProposerError(ValueError):
    """A proposer that cannot be built for this target: one line for the user."""


def parameter_count(model: nn.Module) -> int:
    return sum(value.size for _, value in tree_flatten(model.parameters()))


def weight_bytes(model: nn.Module) -> int:
    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))


def draft_cost_hint(draft: nn.Module, target: nn.Module) -> float:
    """A draft token's cost in target steps where nothing is measured (an engine whose costs
    were handed in; else `DraftCost` measures it): the ratio of the bytes each step reads.
    (A count of parameters reads a 4-bit model's packed words as 1 for 8 weights: a
    bfloat16 draft for a 4-bit target looked 1.8x dearer than it is, and the adaptive
    policy drafted too little until it had timed one.)"""
    return weight_bytes(draft) / weight_bytes(target)


def proposer_downloads(config: ProposerConfig) -> list[tuple[str, list[str] | None]]:
    """The weights a proposer fetches when first used, as (reference, hub file patterns):
    what `mlxspec pull` fetches ahead, so that an entry pulled once drafts offline."""
    options = config.options
    wanted = {
        "draft-model": ("draft", None),
        "head": ("path", HEAD_PATTERNS),
        "mtp": ("path", HEAD_PATTERNS),  # None: the pulled layer (`pull --mtp`)
        "block": ("path", BLOCK_PATTERNS),
        "medusa": ("path", MEDUSA_PATTERNS),
        "self-spec": ("exit", EXIT_PATTERNS),
    }.get(config.kind)
    if wanted is None or not options.get(wanted[0]):
        return []
    return [(options[wanted[0]], wanted[1])]


class Runtime:
    def __init__(
        self,
        entry: ModelEntry,
        loaded: LoadedModel,
        notify: Callable[[str], None],
        weights: WeightsChoice | None = None,
    ):
        """`weights`: the form `loaded` was loaded in (default: the entry's choice)."""
        self.entry, self.loaded, self.notify = entry, loaded, notify
        self.weights = weights or target_weights(entry)
        self.kv = entry_kv(entry)
        self.engine = Engine(
            loaded.model,
            loaded.tokenizer,
            entry.name,
            notify=notify,
            history=history_store(entry.name),
            weights=self.weights,
            prompt_cache=prompt_cache_for(entry.name, entry.target, held_weights(loaded.model)),
            fim=(entry.defaults.fim, entry.defaults.fim_order),
            kv=self.kv,
        )
        self._kv_token: int | None = None
        self.checks_memory = True  # False: a sharded rank's (every rank must agree)
        self._pool_bound = self.engine.prompt_cache.max_bytes  # the plan's, before shrinking
        self.check_memory()

    def proposer(self, name: str | None) -> str:
        """Make sure the named proposer (None: the entry's default) is built; its name."""
        config = self.entry.proposer(name)
        if config is None:
            return "none"
        if config.name not in self.engine.proposers:
            self.engine.add_proposer(self._build(config))
            self.check_memory()  # its weights count from now on
        return config.name

    def holdings(self) -> Holdings:
        """What this runtime holds: the target's weights, the drafters' own (weights a
        drafter shares with the target counted once), KV per token, the prompt cache's
        bound."""
        if self._kv_token is None:
            self._kv_token = kv_token_bytes(self.loaded.model, self.kv)
        target = {id(v) for _, v in tree_flatten(self.loaded.model.parameters())}
        drafters = {
            id(v): v.nbytes
            for proposer in self.engine.proposers.values()
            for module in vars(proposer).values()
            if isinstance(module, nn.Module)
            for _, v in tree_flatten(module.parameters())
            if id(v) not in target
        }
        return Holdings(
            weights=weight_bytes(self.loaded.model),
            drafters=sum(drafters.values()),
            kv_token=self._kv_token,
            kv_form=self.kv.key,
            prompt_cache=self._pool_bound if self._pool_bound is not None else 0,
        )

    def check_memory(self, device: int | None = None) -> None:
        """Weights, drafters, KV of the entry's context and the prompt cache against the
        device: DoesNotFit with the numbers where they cannot fit; where only the prompt
        cache is too much, its bound shrinks (said once). The engine checks each request
        against the same sum."""
        if not self.checks_memory:
            return
        pool = self.engine.prompt_cache
        holdings = self.holdings()
        bound = fit(holdings, self.entry.defaults.context, device=device)
        if self._pool_bound is not None and bound < self._pool_bound:
            if pool.max_bytes != bound:
                self.notify(
                    f"the prompt cache keeps {gb(bound)}, not {gb(self._pool_bound)}: "
                    f"{holdings.describe(self.entry.defaults.context, prompt_cache=False)} "
                    "leave no more"
                )
            pool.max_bytes = bound
            pool.evict_to(bound)
        self.engine.holdings = holdings

    def use_history(self, store: HistoryStore) -> None:
        """Read and feed another history from now on (the bench gives each method its
        own)."""
        self.engine.history = store
        for proposer in self.engine.proposers.values():
            for member in getattr(proposer, "members", [proposer]):
                if hasattr(member, "store"):
                    member.store = store

    def _build(self, config: ProposerConfig) -> Proposer:
        options = config.options
        try:
            if config.kind == "prompt-lookup":
                return PromptLookup(
                    config.name, options["ngram_max"], options["ngram_min"], options["k_max"]
                )
            if config.kind == "suffix":
                seed = None
                if options["seed"]:
                    target, tokenizer = self.entry.target, self.loaded.tokenizer
                    seed = lambda: seed_index(target, tokenizer)  # noqa: E731  (built lazily)
                return SuffixProposer(
                    config.name,
                    self.engine.history,
                    options["k_max"],
                    options["spec_factor"],
                    options["min_match"],
                    self.engine.vocab_size,
                    seed,
                )
            if config.kind == "self-spec":
                return self._self_spec(config)
            if config.kind == "draft-model":
                return self._draft_model(config)
            if config.kind in ("head", "mtp"):
                return self._head(config)
            if config.kind == "block":
                return self._block(config)
            if config.kind == "medusa":
                path = fetch_weights(options["path"], patterns=MEDUSA_PATTERNS)
                heads = load_medusa(path, self.engine.target.decoder)
                return MedusaProposer(heads, self.engine.target, config.name, options["k_max"])
            if config.kind == "lookahead":
                return Lookahead(
                    config.name, options["window"], options["ngram"], options["guesses"]
                )
            if config.kind == "chain":
                members = [
                    self.engine.proposers.get(m) or self._build(self.entry.proposer(m))
                    for m in options["members"]
                ]
                return Chain(members, config.name)
        except (UnsupportedModel, VocabularyMismatch, HeadError, LoadError, ValueError) as err:
            raise ProposerError(
                f"proposer '{config.name}' for '{self.entry.name}': {err}"
            ) from None
        raise ProposerError(
            f"proposer '{config.name}' is of kind '{config.kind}', which this version of mlxspec "
            "cannot run yet; pick another with --proposer"
        )

    def _self_spec(self, config: ProposerConfig) -> SelfSpeculation:
        target, options = self.engine.target, config.options
        exit_head = None
        if options.get("exit"):
            path = fetch_weights(options["exit"], patterns=EXIT_PATTERNS)
            exit_head = load_exit(path, target.decoder)
        return SelfSpeculation(target, options["layers"], config.name, options["k_max"], exit_head)

    def _head(self, config: ProposerConfig) -> HeadProposer:
        target = self.engine.target
        reference = config.options["path"]
        if config.kind == "mtp" and reference is None:  # where `pull --mtp` puts it
            folder = mtp_folder(self.entry.target)
            if not folder.is_dir():
                raise ProposerError(
                    f"no MTP layer pulled for '{self.entry.name}' yet; run `mlxspec pull "
                    f"{self.entry.name} --mtp` (with --from ORIGINAL_REPO for an MLX conversion)"
                )
            reference = str(folder)
        path = fetch_weights(reference, patterns=HEAD_PATTERNS)
        head = load_head(path, self.loaded.model, target.decoder)
        return HeadProposer(head, target, config.name, config.options["k_max"])

    def _block(self, config: ProposerConfig) -> BlockProposer:
        target, options = self.engine.target, config.options
        path = fetch_weights(options["path"], patterns=BLOCK_PATTERNS)
        drafter = load_block_drafter(path, target.decoder, options["format"])
        return BlockProposer(drafter, target, config.name, options["k_max"])

    def _draft_model(self, config: ProposerConfig) -> DraftModel:
        reference, layers = config.options["draft"], config.options.get("draft_layers")
        if reference == self.entry.target:
            model = self.loaded.model if not layers else truncated_model(self.loaded.model, layers)
            own_cost = self._draft_cost(model, reference, layers)
        else:
            model, own_cost = self._draft_in_its_form(
                reference, layers, config.options.get("weights", AUTO)
            )
        cost_hint = draft_cost_hint(model, self.loaded.model)
        return DraftModel(
            model,
            config.name,
            config.options["k_max"],
            cost_hint=cost_hint,
            own_cost=own_cost,
            kv=self.kv,
        )

    def _load_draft(self, reference: str, layers: int | None, dequantize: bool) -> LoadedModel:
        """The draft's weights in one form, checked against the target's tokenizer and
        cut to its first `layers` where asked (`model` replaced)."""
        self.notify(
            f"loading draft model {reference} ({'dequantized' if dequantize else 'as stored'})"
        )
        draft = load_model(reference, dequantize=dequantize)
        check_same_vocabulary(self.entry.target, self.loaded.tokenizer, reference, draft.tokenizer)
        if layers:
            draft = replace(draft, model=truncated_model(draft.model, layers))
        return draft

    def _draft_in_its_form(
        self, reference: str, layers: int | None, requested: str
    ) -> tuple[nn.Module, DraftCost | None]:
        """The draft model in the form it drafts cheapest in, and its measured cost.

        `requested` (the proposer's `weights`): quantized or dequantized as asked; auto,
        where costs are measured, both forms of a draft stored quantized timed beside the
        target once per pair (draft_form.py) and the decision kept; where they are not
        (an engine handed its costs), the target's form."""
        if requested != AUTO:
            draft = self._load_draft(reference, layers, requested == DEQUANTIZED)
            return draft.model, self._draft_cost(draft.model, reference, layers)
        if not self.engine.measures_costs:
            draft = self._load_draft(reference, layers, self.weights.dequantize)
            return draft.model, None
        name = reference + (f" first {layers} layers" if layers else "")
        key = calibration_key(
            f"draft form {name}", held_weights(self.loaded.model), f"pair with {self.entry.target}"
        )
        known = known_calibration(key, DraftForm.from_json)
        if known is not None and not measure_again(known):
            draft = self._load_draft(reference, layers, known.form == DEQUANTIZED)
            return draft.model, self._draft_cost(draft.model, reference, layers)
        measured: dict[str, tuple[nn.Module, DraftCost]] = {}

        def decide() -> DraftForm:
            stored = self._load_draft(reference, layers, dequantize=False)
            measured[QUANTIZED] = (stored.model, self._draft_cost(stored.model, reference, layers))
            if not stored.quantized:  # one form: float, as the target's form says
                form = DEQUANTIZED if self.weights.dequantize else QUANTIZED
                if form == DEQUANTIZED:
                    floats = self._load_draft(reference, layers, dequantize=True).model
                    measured[DEQUANTIZED] = (floats, None)
                return DraftForm(form, "stored in float, loaded as the target is", {})
            need, free = dequantized_bytes(stored.model, 4), free_memory_bytes()
            if free is not None and need > free:
                skipped = f"dequantized ({need / 2**30:.1f} GiB) does not fit in memory"
                return choose_draft_form({QUANTIZED: measured[QUANTIZED][1]}, skipped)
            floats = self._load_draft(reference, layers, dequantize=True).model
            measured[DEQUANTIZED] = (floats, self._draft_cost(floats, reference, layers))
            return choose_draft_form({form: cost for form, (_, cost) in measured.items()})

        decision = cached_verify_cost(key, decide, DraftForm.from_json)
        self.notify(f"draft model {reference}: {decision.reason}")
        model, cost = measured.get(decision.form, (None, None))
        if model is None:  # decided by another process meanwhile
            model = self._load_draft(reference, layers, decision.form == DEQUANTIZED).model
        return model, cost or self._draft_cost(model, reference, layers)

    def _draft_cost(self, model: nn.Module, reference: str, layers: int | None) -> DraftCost | None:
        """The draft's step measured beside the target's on this machine, once per pair
        (kept in the cache), unless the engine's costs were handed in (then nothing is
        measured, and the bytes' guess prices it until a draft was timed)."""
        if not self.engine.measures_costs:
            return None
        name = reference + (f" first {layers} layers" if layers else "")
        weights = f"{held_weights(model)} beside {held_weights(self.loaded.model)}"

        def measure() -> DraftCost:
            self.notify("measuring the draft model's step beside the target's (once per pair)")
            return measure_draft_cost(model, self.loaded.model, self.engine.vocab_size)

        return cached_draft_cost(name, self.entry.target, weights, measure)


def entry_kv(entry: ModelEntry) -> KVForm:
    """The form the entry's KV caches are held in (`--kv-bits`, models.toml `kv_bits`)."""
    d = entry.defaults
    return kv_form(d.kv_bits, d.kv_group_size, d.quantized_kv_start)


def estimated_holdings(entry: ModelEntry) -> Holdings | None:
    """What the entry's target will hold at its context, from its files, without loading
    it, in the form `--weights` loads it in (None: not on this disk, or its files do not
    say; `models.footprint`)."""
    where, present = weights_location(entry.target)
    found = footprint(where, target_weights(entry).dequantize) if present else None
    if found is None:
        return None
    kv = entry_kv(entry)
    return Holdings(found.weights, 0, found.kv_token(kv), kv.key, prompt_cache=0)


def check_before_loading(entry: ModelEntry) -> None:
    """DoesNotFit, with the numbers, before any weight is read, where the entry's
    weights and the KV of its context cannot fit the device (the prompt cache gives way)."""
    holdings = estimated_holdings(entry)
    if holdings is not None:
        fit(holdings, entry.defaults.context)


def target_weights(entry: ModelEntry) -> WeightsChoice:
    """The form the entry's target (and its draft models) load in (`--weights`)."""
    return resolve_weights(entry.defaults.weights, entry.target)


def open_runtime(
    entry: ModelEntry, notify: Callable[[str], None] = lambda _: None, speculating: bool = True
) -> Runtime:
    """The entry's target loaded in the form `--weights` resolves to; `speculating` False
    (a plain-decoding run) never measures the forms for `auto`."""
    check_before_loading(entry)
    weights = target_weights(entry)
    if not speculating:
        weights = for_plain_decoding(weights)
    notify(f"loading {entry.name} ({entry.target}), weights {weights.form}")
    loaded = load_model(entry.target, dequantize=weights.dequantize)
    if weights.measure_at_load and loaded.quantized:
        loaded, weights = measured_weights(entry, loaded, notify)
    return Runtime(entry, loaded, notify, weights)


def measured_weights(
    entry: ModelEntry, loaded: LoadedModel, notify: Callable[[str], None]
) -> tuple[LoadedModel, WeightsChoice]:
    """`auto` on a backend that keeps weights quantized: the faster form measured (once
    per model and device, then cached), and the target loaded in it."""
    notify(f"measuring {entry.name}'s verify costs quantized and dequantized")
    vocab_size, loaded_held = len(loaded.tokenizer.get_vocab()), held_weights(loaded.model)
    form = decide_weight_form(entry.target, loaded.model, vocab_size)
    dequantize = form.form == DEQUANTIZED
    if dequantize or held_weights(loaded.model) != loaded_held:  # dequantized to measure
        loaded = load_model(entry.target, dequantize=dequantize)  # once: the choice is cached
    notify(form.reason)
    return loaded, WeightsChoice(AUTO, dequantize, form.reason)
