"""Models already on this disk, where other tools keep them: the Hugging Face cache (which
mlx-lm fills), LM Studio's models folder, and Ollama's store. Read only, never copied: a
found model is named `hf:ORG/NAME`, `lmstudio:PUBLISHER/NAME` (a GGUF file in it:
`lmstudio:PUBLISHER/NAME/FILE.gguf`) or `ollama:NAME:TAG`, and `--model` takes the name.

Where each looks, as the tools themselves lay their folders out:
- Hugging Face: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`;
  `models--ORG--NAME/snapshots/REVISION/` (huggingface_hub's cache layout), the revision
  `refs/main` names.
- LM Studio: `$MLXSPEC_LMSTUDIO_MODELS`, else the "Models Directory" set in its app
  (`downloadsFolder` in `{home}/settings.json`, or in the older app-data settings.json),
  else `{home}/models` (its default), home being what `~/.lmstudio-home-pointer` names,
  else `~/.lmstudio`; `PUBLISHER/NAME/` holding an MLX folder or `.gguf` files.
- Ollama: `$OLLAMA_MODELS` (Ollama's own variable), else `~/.ollama/models`; a manifest
  `manifests/REGISTRY/NAMESPACE/NAME/TAG` (JSON, its layers) names the GGUF blob of the layer
  `application/vnd.ollama.image.model`, at `blobs/sha256-DIGEST`.
The user's models.toml may name LM Studio's and Ollama's folders in `[places]` (`lmstudio`,
`ollama`), which the variables override. A folder that does not exist is not scanned.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlxspec.registry.found_drafters import drafters_for, folder_key, tokens_key

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
PREFIXES = ("hf:", "lmstudio:", "ollama:")


@dataclass(frozen=True)
class FoundModel:
    name: str  # what --model takes
    path: Path  # the folder or GGUF file, read where it is
    source: str  # "Hugging Face cache", "LM Studio", "Ollama"
    format: str  # "mlx" or "gguf"
    size_bytes: int
    runnable: bool
    why: str  # what it is, or why mlxspec cannot run it
    vocabulary: str | None = None  # found_drafters.tokens_key: which drafters it can take


@dataclass(frozen=True)
class _Place:
    """A model's name and where it lies, before anything in it is read."""

    name: str
    path: Path
    source: str
    format: str


# models.toml's [places]. Not the Hugging Face cache: huggingface_hub, mlx-lm and mlxspec's
# own pulls all follow $HF_HUB_CACHE / $HF_HOME, so a second setting could only disagree.
PLACE_KEYS = ("lmstudio", "ollama")


@dataclass(frozen=True)
class Places:
    """Where the three tools keep models: each tool's own variable first, then the user's
    models.toml `[places]` (LM Studio's and Ollama's), then where the tool puts them."""

    huggingface: Path
    lmstudio: Path
    ollama: Path

    @classmethod
    def here(cls, configured: Mapping[str, str] | None = None) -> Places:
        given = {key: Path(value).expanduser() for key, value in (configured or {}).items()}
        return cls(
            hf_cache(),
            lmstudio_models(given.get("lmstudio")),
            ollama_models(given.get("ollama")),
        )


def hf_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME")
    return Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub"


def lmstudio_models(configured: Path | None = None) -> Path:
    """LM Studio's models folder: the "Models Directory" its app was told to use (its
    settings.json's `downloadsFolder`), else `{home}/models`, its home named by
    `~/.lmstudio-home-pointer` where LM Studio moved it (the file its app and `lms` CLI
    read), else `~/.lmstudio`, else the older `~/.cache/lm-studio`."""
    given = os.environ.get("MLXSPEC_LMSTUDIO_MODELS")
    if given or configured:
        return Path(given) if given else configured
    pointer = Path.home() / ".lmstudio-home-pointer"
    try:
        lines = pointer.read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    default = Path.home() / ".lmstudio"
    homes = [Path(lines[0].strip())] if lines else []
    homes += [default, Path.home() / ".cache" / "lm-studio"]
    chosen = _lmstudio_models_setting(next((h for h in homes if h.is_dir()), default))
    if chosen is not None:
        return chosen
    return next((home for home in homes if (home / "models").is_dir()), default) / "models"


# Where LM Studio's app keeps settings.json: its home (current releases), else Electron's
# per-user data folder (older ones: macOS, Linux).
LMSTUDIO_APP_DATA = (
    Path("Library") / "Application Support" / "LM Studio",
    Path(".config") / "LM Studio",
)


def _lmstudio_models_setting(home: Path) -> Path | None:
    """The folder LM Studio's "Models Directory" setting names (`downloadsFolder` in its
    settings.json, what the My Models tab changes), where it exists; None where it was
    never changed, names nothing on this disk, or the file cannot be read."""
    for folder in [home, *(Path.home() / data for data in LMSTUDIO_APP_DATA)]:
        try:
            settings = json.loads((folder / "settings.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        chosen = settings.get("downloadsFolder") if isinstance(settings, dict) else None
        if isinstance(chosen, str) and chosen:
            moved = Path(chosen).expanduser()
            if moved.is_dir():
                return moved
    return None


def ollama_models(configured: Path | None = None) -> Path:
    given = os.environ.get("OLLAMA_MODELS")
    return Path(given) if given else configured or Path.home() / ".ollama" / "models"


def found_models(places: Places | None = None) -> list[FoundModel]:
    """Every model found in the three places, sorted by name, each read for what it is."""
    return [_inspect(place) for place in _places(places)]


def found_drafter(name: str, places: Places | None = None) -> FoundModel | None:
    """The found model that drafts best for the found model `name` (found_drafters.py), or
    None where there is none on the disk."""
    on_disk = found_models(places)
    target = next((model for model in on_disk if model.name == _canonical(name)), None)
    if target is None or not target.runnable:
        return None
    drafters = drafters_for(target, on_disk)
    return drafters[0] if drafters else None


def _places(places: Places | None) -> list[_Place]:
    places = places or Places.here()
    found = [
        *_hugging_face(places.huggingface),
        *_lmstudio(places.lmstudio),
        *_ollama(places.ollama),
    ]
    return sorted(found, key=lambda place: place.name)


def resolve_found(name: str, places: Places | None = None) -> Path | None:
    """The path of a found model's name (None: the name has none of the prefixes);
    LookupError naming where it looked for one that is not there."""
    if not name.startswith(PREFIXES):
        return None
    places = places or Places.here()
    for place in _places(places):
        if place.name == _canonical(name):
            return place.path
    source = {"hf": "huggingface"}.get(name.split(":", 1)[0], name.split(":", 1)[0])
    where = getattr(places, source)
    raise LookupError(f"no model {name!r} in {where} (`mlxspec models` lists what is found)")


def _canonical(name: str) -> str:
    """`ollama:qwen3` is `ollama:qwen3:latest`, as `ollama run qwen3` takes it."""
    if name.startswith("ollama:") and ":" not in name.removeprefix("ollama:"):
        return f"{name}:latest"
    return name


def _hugging_face(cache: Path) -> list[_Place]:
    found = []
    for repo in sorted(cache.glob("models--*")) if cache.is_dir() else ():
        ref = repo / "refs" / "main"
        snapshots = repo / "snapshots"
        revision = ref.read_text().strip() if ref.is_file() else None
        if revision is None and snapshots.is_dir():
            revision = next((p.name for p in sorted(snapshots.iterdir())), None)
        folder = snapshots / revision if revision else None
        if folder is None or not folder.is_dir():
            continue
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        found.extend(_folder_models(f"hf:{repo_id}", folder, "Hugging Face cache"))
    return found


def _lmstudio(root: Path) -> list[_Place]:
    found = []
    for folder in sorted(root.glob("*/*")) if root.is_dir() else ():
        if folder.is_dir():
            name = f"lmstudio:{folder.parent.name}/{folder.name}"
            found.extend(_folder_models(name, folder, "LM Studio"))
    return found


def _ollama(root: Path) -> list[_Place]:
    found = []
    manifests = root / "manifests"
    for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else ():
        registry, namespace, name, tag = manifest.relative_to(manifests).parts
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
        except (OSError, json.JSONDecodeError):
            continue  # not a manifest: nothing to list
        models = [layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
        digest = models[0].get("digest") if models else None
        if digest is None:
            continue
        blob = root / "blobs" / digest.replace(":", "-")
        if blob.is_file():
            name = f"ollama:{_ollama_name(registry, namespace, name)}:{tag}"
            found.append(_Place(name, blob, "Ollama", "gguf"))
    return found


def _ollama_name(registry: str, namespace: str, name: str) -> str:
    """As `ollama list` names it: `qwen3`, `user/model`, `host/user/model`."""
    if registry != OLLAMA_REGISTRY:
        return f"{registry}/{namespace}/{name}"
    return name if namespace == "library" else f"{namespace}/{name}"


def _folder_models(name: str, folder: Path, source: str) -> list[_Place]:
    """An MLX (mlx-lm) folder, or each GGUF file in the folder."""
    if (folder / "config.json").is_file():
        return [_Place(name, folder, source, "mlx")]
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return [_Place(name, ggufs[0], source, "gguf")]
    return [_Place(f"{name}/{gguf.name}", gguf, source, "gguf") for gguf in ggufs]


def _inspect(place: _Place) -> FoundModel:
    read = _mlx_model if place.format == "mlx" else _gguf_model
    return read(place.name, place.path, place.source)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mlx_model(name: str, folder: Path, source: str) -> FoundModel:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        return FoundModel(name, folder, source, "mlx", _size(folder), False, f"config: {err}")
    kind = config.get("model_type", "?")
    weights = any(folder.glob("*.safetensors"))
    known = importlib.util.find_spec(f"mlx_lm.models.{kind}") is not None
    runnable = weights and known
    why = (
        f"{kind}"
        + ("" if weights else ", no safetensors weights")
        + ("" if known else f", an architecture mlx-lm has no model for ({kind})")
    )
    vocabulary = folder_key(folder) if runnable else None
    return FoundModel(name, folder, source, "mlx", _size(folder), runnable, why, vocabulary)


def _gguf_model(name: str, file: Path, source: str) -> FoundModel:
    from mlxspec.models.gguf import GGUFError, describe_gguf
    from mlxspec.models.gguf_reader import read_gguf_header

    vocabulary = None
    try:
        metadata, kinds = read_gguf_header(file)
        why = describe_gguf(metadata, kinds)
        runnable = True
        tokens = list(metadata.get("tokenizer.ggml.tokens", ()))
        vocabulary = tokens_key(tokens) if tokens else None
    except (GGUFError, ValueError, OSError) as err:
        why, runnable = str(err), False
    return FoundModel(name, file, source, "gguf", _size(file), runnable, why, vocabulary)
