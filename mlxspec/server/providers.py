"""Where the server gets its models: names it may serve, and how to open one.

The server only needs, per model, what a request may ask for (`ModelInfo`) and, on
the worker thread, something with `.engine` and `.proposer(name)` (a `Runtime`).
`RegistryProvider` serves models.toml; tests pass a provider of tiny random models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from mlxspec.decoding.engine import Engine
from mlxspec.registry.models_toml import Defaults, ModelEntry, ProposerConfig, Registry
from mlxspec.server.errors import ApiError


@dataclass(frozen=True)
class ModelInfo:
    name: str
    proposers: tuple[str, ...]  # what a request may name, "none" included
    defaults: Defaults = field(default_factory=Defaults)
    description: str = ""


class OpenModel(Protocol):
    engine: Engine

    def proposer(self, name: str | None) -> str:
        """Build the named proposer if needed (None: the model's default); its name."""


class ModelProvider(Protocol):
    default: str
    models: Mapping[str, ModelInfo]

    def check(self, name: str, proposer: str | None) -> None:
        """Raise NotDownloaded if serving this would need a download (cheap, on the loop)."""

    def open(self, name: str) -> OpenModel:
        """Load a model (slow; runs on the worker thread, which does all MLX work)."""


def find_model(provider: ModelProvider, name: str | None) -> ModelInfo:
    """The named model (None: the provider's default), or a 404 naming what there is."""
    info = provider.models.get(provider.default if name is None else name)
    if info is None:
        raise ApiError(
            404,
            f"unknown model {name!r}; this server has: {', '.join(provider.models)}",
            code="model_not_found",
            param="model",
        )
    return info


class NotDownloaded(RuntimeError):
    """Weights a request would need are not on disk (the server does not fetch them)."""


class RegistryProvider:
    """The entries of models.toml, opened with `mlxspec.registry.runtime.open_runtime`.

    Only the default entry (the one the operator started the server with) may download
    weights; other entries must be pulled first, so that no request starts a download
    of gigabytes that every other request would wait behind.
    """

    def __init__(
        self,
        registry: Registry,
        default: str | None = None,
        notify: Callable[[str], None] = lambda _: None,
    ):
        self.registry, self.notify = registry, notify
        self.default = registry.get(default).name
        self.models = {name: model_info(entry) for name, entry in registry.entries.items()}

    def check(self, name: str, proposer: str | None) -> None:
        if name == self.default:
            return
        from mlxspec.models.loading import weights_location

        entry = self.registry.get(name)
        needed = [entry.target, *_draft_references(entry, entry.proposer(proposer))]
        missing = [ref for ref in needed if not weights_location(ref)[1]]
        if missing:
            raise NotDownloaded(
                f"{name} needs {', '.join(missing)}, which is not downloaded; "
                f"run `mlxspec pull {name}` and retry"
            )

    def open(self, name: str) -> OpenModel:
        from mlxspec.registry.runtime import (
            open_runtime,  # loads mlx-lm model code: only when serving
        )

        return open_runtime(self.registry.get(name), notify=self.notify)


class OpenedProvider:
    """One model that is already open: the bench serves the runtime it has loaded, so
    every row measures the same weights without loading them again."""

    def __init__(self, opened: OpenModel, entry: ModelEntry):
        self.opened, self.default = opened, entry.name
        self.models = {entry.name: model_info(entry)}

    def check(self, name: str, proposer: str | None) -> None:
        return None  # nothing to download: it is open

    def open(self, name: str) -> OpenModel:
        return self.opened


def model_info(entry: ModelEntry) -> ModelInfo:
    return ModelInfo(entry.name, tuple(entry.proposer_names), entry.defaults, entry.description)


def _draft_references(entry: ModelEntry, config: ProposerConfig | None) -> list[str]:
    if config is None:
        return []
    if config.kind == "draft-model":
        return [config.options["draft"]]
    if config.kind == "chain":
        members = [entry.proposer(member) for member in config.options["members"]]
        return [ref for member in members for ref in _draft_references(entry, member)]
    return []
