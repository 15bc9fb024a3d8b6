"""Named target/proposer pairs from models.toml: the shipped file, extended by the user's.

The shipped `models.toml` (at the repository root; a wheel carries a copy inside the
package, put there by setup.py) documents the schema. A user file (env MLXSPEC_MODELS, else
`<config dir>/models.toml` when it exists) adds entries, replaces shipped entries of the
same name wholesale, and may set `default`. Everything is validated on load; every
problem is one `RegistryError` line naming the file, the entry and the fix.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the backport
    import tomli as tomllib

from mlxspec.paths import config_dir
from mlxspec.registry.on_disk import PLACE_KEYS, Places, found_drafter, resolve_found
from mlxspec.registry.schema import (
    DEFAULTS_OPTIONS,
    ENTRY_OPTIONS,
    ENTRY_TABLES,
    FALLBACK,
    KIND_OPTIONS,
    REFERENCE,
    REQUIRED,
    Option,
)

# The folder that holds the mlxspec package: the repository root in a checkout (where the
# shipped models.toml lives), site-packages once installed. The shipped file's relative paths
# (the packaged heads, "./mlxspec/heads/...") resolve against it, so they hold both ways.
PACKAGE = Path(__file__).parent.parent  # mlxspec/
SHIPPED_ROOT = PACKAGE.parent
_PACKAGE_COPY = PACKAGE / "models.toml"  # in an installed wheel
SHIPPED_FILE = _PACKAGE_COPY if _PACKAGE_COPY.is_file() else SHIPPED_ROOT / "models.toml"
ENV_VAR = "MLXSPEC_MODELS"
NONE = "none"  # the reserved proposer name meaning "no speculation"
SUFFIX = "suffix"  # needs no weights either (drafts from the model's history): on every entry
DRAFT = "draft-model"  # a found model's same-vocabulary drafter, where one is on the disk too


class RegistryError(ValueError):
    """A models.toml problem, or an unknown model/proposer name: one line for the user."""


@dataclass(frozen=True)
class ProposerConfig:
    name: str
    kind: str
    options: Mapping[str, Any]  # validated, defaults filled in (see KIND_OPTIONS)


@dataclass(frozen=True)
class Defaults:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0  # OpenAI's penalties, over a window (sampling.py)
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    context: int = 8192
    tree: bool = False  # draft trees instead of lines (where the model supports them)
    tree_nodes: int = 32
    history: bool = True  # keep and read the model's history of requests (suffix decoding)
    # auto, quantized or dequantized (mlxspec/decoding/weights_choice.py); --weights
    weights: str = "auto"
    # The KV cache's form (mlxspec/models/kv_form.py): None float, 4 or 8 bits in groups
    # of kv_group_size, quantized from position quantized_kv_start; --kv-bits and friends
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    # Extra arguments of the chat template (e.g. {"enable_thinking": False}); a request's
    # own chat_template_kwargs win key by key; --chat-template-args
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Fill-in-the-middle (markup/fim.py): the layout found from the model's tokens ("auto"),
    # none, or a family's tokens; the order: the family's, prefix first or suffix first
    fim: str = "auto"
    fim_order: str = "auto"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    target: str  # a packaged name, a hub repo id, or an absolute local path
    description: str
    proposers: Mapping[str, ProposerConfig]
    default_proposer: str
    defaults: Defaults
    source: Path | None  # the toml file that defined it; None: named by --model

    def proposer(self, name: str | None = None) -> ProposerConfig | None:
        """The named proposer (None: the entry's default); None means no speculation.

        An unknown name is the user's typo, not the file's fault: the error names the
        model, what it has, and the closest name."""
        chosen = self.default_proposer if name is None else name
        if chosen == NONE:
            return None
        if chosen not in self.proposers:
            close = difflib.get_close_matches(chosen, self.proposer_names, n=1)
            guess = f"; did you mean {close[0]!r}?" if close else ""
            raise RegistryError(
                f"unknown proposer {chosen!r} for model {self.name!r}; "
                f"available: {', '.join(self.proposer_names)}{guess}"
            )
        return self.proposers[chosen]

    @property
    def proposer_names(self) -> list[str]:
        return [*self.proposers, NONE]


@dataclass(frozen=True)
class Registry:
    entries: Mapping[str, ModelEntry]
    default: str
    files: tuple[Path, ...]  # the files that were read, shipped first
    user_file: Path | None = None  # where the user adds entries (None: user_file_path())
    # The user file's [places]: where LM Studio and Ollama keep models, if not the default.
    places: Mapping[str, str] = field(default_factory=dict)

    def found_places(self) -> Places:
        """Where models of other tools are looked for (registry/on_disk.py)."""
        return Places.here(self.places)

    def with_defaults(self, **changes: Any) -> Registry:
        """Every entry with some defaults replaced (command-line flags such as --tree
        that hold for whichever model a chat or server switches to); None keeps a value."""
        given = {key: value for key, value in changes.items() if value is not None}
        if not given:
            return self
        entries = {
            name: replace(entry, defaults=replace(entry.defaults, **given))
            for name, entry in self.entries.items()
        }
        return replace(self, entries=entries)

    def get(self, name: str | None = None) -> ModelEntry:
        chosen = self.default if name is None else name
        if chosen not in self.entries:
            where = self.user_file or user_file_path()
            raise RegistryError(
                f"unknown model {chosen!r}; known: {', '.join(self.entries)} (add it to "
                f"{where}); or pass a hub repo id (owner/name), a local path, or a model "
                "`mlxspec models` found on this disk (hf:..., lmstudio:..., ollama:...)"
            )
        return self.entries[chosen]

    def including(self, model: str | None) -> Registry:
        """This registry, plus an entry for `model` when it is a model reference rather
        than an entry's name: a local folder or .gguf file, or a hub repo id, as mlx-lm
        takes them. Such an entry drafts with prompt lookup (its default) or suffix decoding,
        which need no weights."""
        if model is None or model in self.entries:
            return self
        entry = reference_entry(model, self.found_places())
        if entry is None:
            self.get(model)  # raises: the name is not known
        return replace(self, entries=MappingProxyType({**self.entries, model: entry}))


@dataclass(frozen=True)
class _Where:
    """Where a problem is, so every error starts with the file and the entry."""

    source: Path
    entry: str | None = None

    def error(self, problem: str) -> RegistryError:
        entry = f": entry {self.entry!r}" if self.entry is not None else ""
        return RegistryError(f"{self.source.name} ({self.source}){entry}: {problem}")


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+")
_TOML_TYPES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "a table",
}


def _toml_type(value: Any) -> str:
    return _TOML_TYPES.get(type(value), "a date/time")


def table_header(*keys: str) -> str:
    """A table header as written in TOML, e.g. [models."qwen2.5-7b".defaults]."""
    return (
        "[" + ".".join(k if _BARE_KEY.fullmatch(k) else f'"{k}"' for k in ("models", *keys)) + "]"
    )


def _table(value: Any, where: _Where, section: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise where.error(f"{section} must be a table, got {_toml_type(value)}")
    return value


def _value(value: Any, key: str, spec: Option, where: _Where, section: str) -> Any:
    """One checked value: type (a bool is not a number), range, then reference resolution."""
    wrong = f"{key} in {section} must be {spec.rule}, got"
    if spec.type is float and type(value) is int:
        value = float(value)
    if type(value) is not spec.type:
        raise where.error(f"{wrong} {_toml_type(value)}")
    if spec.type is float and not math.isfinite(value):  # TOML allows nan and inf
        raise where.error(f"{wrong} {value!r}")
    if spec.type is list and not all(isinstance(item, str) for item in value):
        raise where.error(f"{wrong} {value!r}")
    if not spec.ok(value):
        raise where.error(f"{wrong} {value!r}")
    if spec.type is list:
        return tuple(value)  # frozen, like everything a registry hands out
    if spec.type is dict:
        return MappingProxyType(value)
    return _resolve(value, key, where, section) if spec.reference else value


def _folder_of(source: Path) -> Path:
    """What relative paths in `source` mean: its folder, but for the shipped file the folder
    holding the package, which is the file's own folder in a checkout and not in a wheel."""
    return SHIPPED_ROOT if source == SHIPPED_FILE else source.parent


def _resolve(reference: str, key: str, where: _Where, section: str) -> str:
    """Local paths become absolute (relative ones against the file's folder); ids stay."""
    if reference.startswith(("/", "~", "./", "../")):
        try:
            path = Path(reference).expanduser()
        except RuntimeError:  # ~user for a user that does not exist
            raise where.error(f"{key} in {section}: cannot expand {reference!r}") from None
        return os.path.normpath(_folder_of(where.source) / path)
    if "/" in reference and not _HUB_ID.fullmatch(reference):
        raise where.error(
            f"{key} in {section}: {reference!r} is neither a hub repo id (owner/name) nor a "
            f"local path; write './{reference}' for a path relative to this file"
        )
    if "/" not in reference and not _NAME.fullmatch(reference):
        raise where.error(f"{key} in {section} must be {REFERENCE.rule}, got {reference!r}")
    return reference


def _options(
    table: Any,
    specs: Mapping[str, Option],
    where: _Where,
    section: str,
    also_known: Iterable[str] = (),
) -> dict[str, Any]:
    """Check a table against its option specs: unknown keys, missing keys, each value."""
    table = _table(table, where, section)
    known = [*specs, *also_known]
    for key in table:
        if key not in known:
            raise where.error(f"unknown key {key!r} in {section}; known keys: {', '.join(known)}")
    values = {}
    for key, spec in specs.items():
        if key in table:
            values[key] = _value(table[key], key, spec, where, section)
        elif spec.default is REQUIRED:
            raise where.error(f"{section} is missing {key}; add {key} = <{spec.rule}>")
        else:
            values[key] = spec.default
    return values


def _check_name(name: str, what: str, where: _Where) -> None:
    if not _NAME.fullmatch(name):
        raise where.error(
            f"{what} name {name!r} is not valid; use letters, digits, '.', '_' and '-'"
        )


def _proposer(name: str, table: Any, where: _Where, section: str) -> ProposerConfig:
    _check_name(name, "proposer", where)
    if name == NONE:
        raise where.error(f"{section}: 'none' is reserved for no speculation; rename it")
    table = dict(_table(table, where, section))
    kind = table.pop("kind", name if name in KIND_OPTIONS else None)
    if not isinstance(kind, str) or kind not in KIND_OPTIONS:
        got = "no kind" if kind is None else f"kind {kind!r}"
        raise where.error(f"{section} has {got}; set kind = one of: {', '.join(KIND_OPTIONS)}")
    if name in KIND_OPTIONS and kind != name:
        raise where.error(
            f"{section} is named after kind {name!r} but has kind {kind!r}; rename it"
        )
    options = _options(table, KIND_OPTIONS[kind], where, section, also_known=("kind",))
    if kind == "prompt-lookup" and options["ngram_min"] > options["ngram_max"]:
        raise where.error(
            f"ngram_min ({options['ngram_min']}) in {section} must be <= "
            f"ngram_max ({options['ngram_max']})"
        )
    return ProposerConfig(name, kind, MappingProxyType(options))


def _check_chain(
    chain: ProposerConfig, proposers: Mapping[str, ProposerConfig], where: _Where, section: str
) -> None:
    members = chain.options["members"]
    for member in members:
        if member == chain.name:
            raise where.error(f"chain {section} lists itself; remove {member!r} from members")
        if member not in proposers:
            others = ", ".join(name for name in proposers if name != chain.name)
            raise where.error(
                f"members of {section} names unknown proposer {member!r}; "
                f"define it or use one of: {others}"
            )
        if proposers[member].kind == "chain":
            raise where.error(f"chain {section} lists chain {member!r}; a chain cannot nest")
        if members.count(member) > 1:
            raise where.error(f"members of {section} lists {member!r} twice; list it once")


def _entry(name: str, table: Any, source: Path, base: ModelEntry | None = None) -> ModelEntry:
    """One entry; with `base` (an entry of the same name from an earlier file) and no
    `target` of its own, it extends `base`: its proposers and defaults are added on top."""
    where = _Where(source, name)
    _check_name(name, "model", where)
    extends = base is not None and "target" not in _table(table, where, table_header(name))
    entry_options = ENTRY_OPTIONS
    if extends:
        inherited = {
            "target": base.target,
            "description": base.description,
            "default_proposer": base.default_proposer,
        }
        entry_options = {k: replace(v, default=inherited[k]) for k, v in ENTRY_OPTIONS.items()}
    values = _options(table, entry_options, where, table_header(name), also_known=ENTRY_TABLES)
    defaults = _options(
        table.get("defaults", {}), DEFAULTS_OPTIONS, where, table_header(name, "defaults")
    )
    proposer_tables = _table(table.get("proposers", {}), where, table_header(name, "proposers"))
    proposers = dict(base.proposers) if extends else {}
    proposers.update(
        (key, _proposer(key, value, where, table_header(name, "proposers", key)))
        for key, value in proposer_tables.items()
    )
    for always in (FALLBACK, SUFFIX):
        if always not in proposers:
            section = table_header(name, "proposers", always)
            proposers[always] = _proposer(always, {}, where, section)
    for proposer in proposers.values():
        if proposer.kind == "chain":
            _check_chain(proposer, proposers, where, table_header(name, "proposers", proposer.name))
    default_proposer = values["default_proposer"]
    if default_proposer != NONE and default_proposer not in proposers:
        raise where.error(
            f"default_proposer {default_proposer!r} is not one of its proposers; "
            f"use one of: {', '.join([*proposers, NONE])}"
        )
    given = {key: value for key, value in defaults.items() if value is not None}
    return ModelEntry(
        name=name,
        target=values["target"],
        description=values["description"],
        proposers=MappingProxyType(proposers),
        default_proposer=default_proposer,
        defaults=replace(base.defaults, **given) if extends else Defaults(**given),
        source=source,
    )


def _looks_like_path(reference: str) -> bool:
    return reference.startswith(("/", "~", ".")) or reference.endswith(".gguf")


def reference_entry(reference: str, places: Places | None = None) -> ModelEntry | None:
    """An entry named after a model reference typed on the command line (None: it is
    no reference). A path must exist: a missing one says so, instead of being looked
    for on the hub."""
    try:
        found = resolve_found(reference, places)  # hf:, lmstudio:, ollama: (on this disk)
    except LookupError as err:
        raise RegistryError(str(err)) from None
    path = found or Path(reference).expanduser()
    if path.exists():
        target = str(path.absolute())
    elif _looks_like_path(reference):
        raise RegistryError(f"no model at {path.absolute()}: the path does not exist")
    elif _HUB_ID.fullmatch(reference):
        target = reference
    else:
        return None
    where = _Where(SHIPPED_FILE, reference)
    proposers = {name: _proposer(name, {}, where, "--model") for name in (FALLBACK, SUFFIX)}
    drafter = found_drafter(reference, places) if found else None
    if drafter is not None:  # a smaller model of its vocabulary on this disk
        proposers[DRAFT] = _proposer(DRAFT, {"draft": str(drafter.path)}, where, "--model")
    return ModelEntry(
        name=reference,
        target=target,
        description="named on the command line",
        proposers=MappingProxyType(proposers),
        default_proposer=FALLBACK,
        defaults=Defaults(),
        source=None,
    )


def parse_registry_text(
    text: str, source: Path, base: Mapping[str, ModelEntry] | None = None
) -> tuple[dict[str, ModelEntry], str | None]:
    """The entries and the `default` (None if unset) of one models.toml's text; entries
    without a target extend those of the same name in `base`."""
    entries, default, _ = _parse_document(text, source, base)
    return entries, default


def _parse_document(
    text: str, source: Path, base: Mapping[str, ModelEntry] | None
) -> tuple[dict[str, ModelEntry], str | None, dict[str, str]]:
    """parse_registry_text's entries and default, and the file's `[places]`."""
    where = _Where(source)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise where.error(f"invalid TOML: {exc}; fix the syntax there") from None
    for key in document:
        if key not in ("default", "models", "places"):
            raise where.error(f"unknown top-level key {key!r}; known keys: default, models, places")
    places = places_table(document, where)
    default = document.get("default")
    if default is not None and not isinstance(default, str):
        raise where.error(f"default must be a model name (a string), got {_toml_type(default)}")
    models = _table(document.get("models", {}), where, "[models]")
    base = base or {}
    entries = {name: _entry(name, table, source, base.get(name)) for name, table in models.items()}
    return entries, default, places


def places_table(document: Mapping[str, Any], where: _Where) -> dict[str, str]:
    """`[places]`: each a folder path (`~` allowed), for the keys on_disk.PLACE_KEYS names."""
    table = _table(document.get("places", {}), where, "[places]")
    for key, value in table.items():
        if key not in PLACE_KEYS:
            raise where.error(f"[places] has {key!r}; known keys: {', '.join(PLACE_KEYS)}")
        if not isinstance(value, str) or not value:
            raise where.error(f"[places] {key} must be a folder path (a string)")
    return dict(table)


def user_file_path() -> Path:
    """Where the user's models.toml is (or would be): $MLXSPEC_MODELS, else the config dir."""
    override = os.environ.get(ENV_VAR)
    return Path(override).expanduser() if override else config_dir() / "models.toml"


def _user_file(explicit: Path | None) -> Path | None:
    """The user file to read, if any: an explicit or env-named file must exist."""
    if explicit is not None:
        path = Path(explicit).expanduser().absolute()
        if not path.is_file():
            raise RegistryError(f"models file {path} does not exist; create it or pass another")
        return path
    path = user_file_path().absolute()
    if os.environ.get(ENV_VAR) and not path.is_file():
        raise RegistryError(f"{ENV_VAR} names a missing file: {path}; create it or unset {ENV_VAR}")
    return path if path.is_file() else None


def parse_registry_file(
    path: Path, base: Mapping[str, ModelEntry] | None = None
) -> tuple[dict[str, ModelEntry], str | None]:
    """`parse_registry_text` of a file; one that cannot be read is one line too."""
    return parse_registry_text(_read(path), path, base)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _Where(path).error(f"cannot read it ({exc}); check the file") from None


def load_registry(user_file: Path | None = None) -> Registry:
    """The shipped entries extended by the user file (`user_file`, else env, else XDG)."""
    entries, default = parse_registry_file(SHIPPED_FILE)
    default_source, files = SHIPPED_FILE, [SHIPPED_FILE]
    user = _user_file(user_file)
    places: dict[str, str] = {}
    if user is not None:
        user_entries, user_default, places = _parse_document(_read(user), user, entries)
        entries.update(user_entries)  # same name: replaced, or extended when it has no target
        files.append(user)
        if user_default is not None:
            default, default_source = user_default, user
    if default is None:
        raise _Where(SHIPPED_FILE).error('no default model is set; add default = "<name>"')
    if default not in entries:
        raise _Where(default_source).error(
            f"default = {default!r} names no entry; use one of: {', '.join(entries)}"
        )
    return Registry(
        MappingProxyType(entries), default, tuple(files), user or user_file_path(), places
    )
