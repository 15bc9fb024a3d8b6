"""A small standalone draft model distilled from the target (`train-drafter --kind model`).

The student is the target's own first M layers, final norm and (tied) embedding / LM
head, built by the target's mlx-lm class with `num_hidden_layers = M`
(`truncated_model`). Its layers and norm learn, teacher-forced on the cached token
windows, to match the target's distribution (KL over the draft vocabulary, from the
stored final hidden states); the embedding and LM head stay the target's, frozen. It is
saved in mlx-lm's format with the target's tokenizer, so `mlx_lm.load` and mlx-lm's own
speculative decoding can use it as well as mlxspec's draft-model proposer.
"""

from __future__ import annotations

import copy
import json
import shutil
from fnmatch import fnmatch
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import dequantize_model, load_tokenizer, save_config, save_model

from mlxspec.drafter.data import Shard
from mlxspec.drafter.head import lm_rows
from mlxspec.drafter.train import Batch, HeldOutChoices, check_layers, held_out
from mlxspec.models.anatomy import Decoder, split_decoder
from mlxspec.models.gguf_rope import FrequencyFactorRoPE
from mlxspec.models.loading import LoadedModel
from mlxspec.proposers.draft_model import check_same_vocabulary, truncated_model

RECORD_FILE = "training.json"
# Tokenizer files of an mlx-lm model folder (mlx-lm's download patterns, less weights,
# config and code).
TOKENIZER_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt"]
NOT_TOKENIZER = {"config.json", "model.safetensors.index.json", RECORD_FILE}


def default_layers(total: int) -> int:
    """About an eighth of the target's depth (4 of SmolLM2's 30 layers)."""
    return max(1, round(total / 8))


class ModelStudent:
    """The truncated target as a `Student` of `train`: layers and final norm learn."""

    def __init__(self, model: nn.Module, decoder: Decoder, layers: int, vocab: mx.array):
        if any(isinstance(m, FrequencyFactorRoPE) for _, m in model.named_modules()):
            # mlx-lm's config.json has no place for a GGUF's own rope factors: reloaded, the
            # saved draft would rotate by plain rope, not the one it was trained with.
            raise ValueError(
                "a draft model of a GGUF with Llama 3 rope_freqs cannot be saved in mlx-lm's "
                "format; train another kind (e.g. --kind head)"
            )
        check_layers(layers, len(decoder.layers))
        # Its own modules: truncated_model shares the target's (a draft only reads them),
        # and training (and set_dtype) must not change the target's layers and norm.
        student = copy.deepcopy(truncated_model(model, layers))
        if any(
            isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            for _, m in student.named_modules()
        ):
            student = dequantize_model(student)  # quantized weights cannot learn
        student.set_dtype(mx.float32)
        student.freeze()
        self.own = split_decoder(student)  # the student's own parts (same modules)
        for layer in self.own.layers:
            layer.unfreeze()
        self.own.norm.unfreeze()
        self.module, self.layers = student, layers
        self.checkpoint = f"checkpoint-model-{layers}"
        self.rows = lm_rows(decoder, vocab)  # the target's LM head rows = the student's
        mx.eval(self.rows)
        self.choices = HeldOutChoices(decoder)

    def loss(self, module: nn.Module, batch: Batch, done: float = 0.0):
        """KL(teacher || student) at every position with a next token, over the draft
        vocabulary; `module` is `self.module`, whose parts `self.own` holds."""
        h = self.own.hidden(batch.tokens, [None] * self.layers)[:, :-1]
        kl = batch.kl(h @ self.rows.T, 0, -1)
        valid = batch.mask[:, 1:]
        return (kl * valid).sum() / mx.maximum(valid.sum(), 1)

    def agreement(self, shards: list[Shard]) -> dict:
        return agreement(self.module, shards, self.choices(shards))


def agreement(model: nn.Module, shards: list[Shard], choices: list[np.ndarray]) -> dict:
    """Held-out first-draft acceptance under greedy decoding of a draft model: how often
    its argmax over the full vocabulary equals the target's (`target_choices`), on
    answer tokens."""
    hits = total = 0
    for (tokens, _, prompt_length), chosen in zip(held_out(shards), choices):
        guess = np.asarray(mx.argmax(model(mx.array(tokens[None, :-1])), axis=-1))[0]
        truth = chosen[:-1]
        start = max(prompt_length - 1, 0)  # positions predicting answer tokens
        same = guess[start:] == truth[start:]
        hits, total = hits + int(same.sum()), total + len(same)
    return {"first_token_acceptance": round(hits / max(total, 1), 4), "positions": total}


def save_draft_model(
    model: nn.Module, loaded: LoadedModel, directory: Path, record: dict, dtype=mx.bfloat16
) -> None:
    """An mlx-lm model folder: config.json, model.safetensors, the target's tokenizer
    files, and the training record (training.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.set_dtype(dtype)
    save_model(directory, model)
    config = {
        k: v for k, v in loaded.config.items() if k not in ("quantization", "quantization_config")
    }
    config["num_hidden_layers"] = model.args.num_hidden_layers
    if config.get("layer_types"):
        config["layer_types"] = list(config["layer_types"][: config["num_hidden_layers"]])
    # A GGUF's end-of-turn token is an extra EOS that only the loaded tokenizer knows.
    config["eos_token_id"] = sorted(loaded.tokenizer.eos_token_ids)
    save_config(config, directory / "config.json")
    save_tokenizer(loaded, directory)
    (directory / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")


def save_tokenizer(loaded: LoadedModel, directory: Path) -> None:
    """The target's tokenizer files: copied from its folder, or written out from the
    tokenizer mlxspec rebuilt from a GGUF's metadata (a GGUF carries no tokenizer.json).
    Checked by loading them back as mlx-lm does."""
    if loaded.path.is_dir():
        for path in sorted(loaded.path.iterdir()):
            if path.name in NOT_TOKENIZER or not path.is_file():
                continue
            if any(fnmatch(path.name, pattern) for pattern in TOKENIZER_PATTERNS):
                shutil.copyfile(path, directory / path.name)
    else:
        loaded.tokenizer._tokenizer.save_pretrained(directory)
    saved = load_tokenizer(directory, eos_token_ids=sorted(loaded.tokenizer.eos_token_ids))
    check_same_vocabulary(loaded.ref, loaded.tokenizer, str(directory), saved)
