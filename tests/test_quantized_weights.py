"""The path Metal runs, on this CPU: weights kept quantized (`--weights quantized`).

Every proposer kind is built the way the CLI builds it (models.toml -> Runtime) on tiny
targets kept quantized: GGUF files in llama.cpp's Q4_0, Q4_1 and Q8_0, and an mlx-lm
folder quantized by `nn.quantize`; each drafts a greedy answer equal to plain decoding's
with the same weights. The real SmolLM2 does the same with its shipped proposers (slow).
"""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from click.testing import CliRunner
from lossless import assert_lossless, plain_greedy
from mlx_lm.utils import quantize_model, save_config, save_model
from test_block import dflash_checkpoint
from test_cli import assert_one_line_error
from test_lossless import CPU_LIKE_COST, NEWER
from test_mtp import layout_tensors
from tiny_gguf import write_tiny_gguf
from tiny_models import FAMILIES, byte_tokenizer, tiny_model

from mlxspec.cli import main
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.verify_cost import calibration_key
from mlxspec.decoding.weights_choice import held_weights
from mlxspec.drafter.head import HeadSpec, build_head, save_head
from mlxspec.drafter.medusa import MedusaHeads, save_medusa
from mlxspec.models.anatomy import split_decoder
from mlxspec.models.loading import load_model
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import ProposerError, Runtime, open_runtime, target_weights

MAX_TOKENS = 20


def replace_defaults(entry, **changes):
    return replace(entry, defaults=replace(entry.defaults, **changes))


def priced_like_this_cpu(runtime: Runtime) -> Runtime:
    """The runtime with an engine on a fixed cost curve (as a sharded rank's is), built
    before its proposers: tree shapes then do not hang on a calibration of a busy machine."""
    loaded, old = runtime.loaded, runtime.engine
    runtime.engine = Engine(
        loaded.model,
        loaded.tokenizer,
        old.name,
        verify_cost=CPU_LIKE_COST,
        history=old.history,
        weights=runtime.weights,
    )
    return runtime


# name -> (kind, options); {folder} is the test's folder of drafter weights.
PROPOSERS = {
    "prompt-lookup": ("prompt-lookup", "ngram_min = 1\nngram_max = 3"),
    "suffix": ("suffix", ""),
    "draft-model": ("draft-model", 'draft = "{target}"\ndraft_layers = 1'),
    "self-spec": ("self-spec", "layers = 1"),
    "lookahead": ("lookahead", ""),
    "head": ("head", 'path = "{folder}/head"'),
    "medusa": ("medusa", 'path = "{folder}/medusa"'),
}
# On the mlx-lm folder only: drafters whose tiny layouts fit its vocabulary (257 tokens).
LAYOUT_PROPOSERS = {
    "block": ("block", 'path = "{folder}/dflash"'),
    "mtp": ("mtp", 'path = "{folder}/mtp"'),
}
TREES = ("draft-model", "head", "medusa", "block")
FORMS = ["Q4_0", "Q4_1", "Q8_0", "mlx-q4"]


def quantized_mlx_folder(folder) -> None:
    """A tiny llama quantized by `nn.quantize` (4 bits, group 32) and saved as mlx-lm
    saves one, with an MTP layer and a DFlash drafter made for it on their tiny layouts."""
    model = tiny_model("llama", seed=1)
    (folder / "mtp").mkdir()
    tensors, _ = layout_tensors("deepseek-v3-names-on-llama", model)
    mx.save_safetensors(str(folder / "mtp" / "model.safetensors"), tensors)
    dflash_checkpoint(folder / "dflash")
    nn.quantize(model, group_size=32, bits=4)
    target = folder / "target"
    save_model(target, model)
    quantization = {"group_size": 32, "bits": 4, "mode": "affine"}
    save_config({**FAMILIES["llama"], "quantization": quantization}, target / "config.json")
    byte_tokenizer()._tokenizer.save_pretrained(target)


def drafter_heads(folder, target: str) -> None:
    """Untrained EAGLE-style and Medusa heads for the target: they read its quantized LM
    head and hidden states, which is what is under test, whatever they draft."""
    loaded = load_model(target, progress=False, dequantize=False)
    decoder = split_decoder(loaded.model)
    vocab = mx.arange(decoder.embed.weight.shape[0])
    spec = HeadSpec(decoder.width, int(vocab.size), final_norm=True, feed_normed=True)
    save_head(build_head(spec, loaded.model, vocab), folder / "head")
    save_medusa(MedusaHeads(decoder.width, 3, vocab), folder / "medusa")


@pytest.fixture(scope="module", params=FORMS)
def quantized_target(request, tmp_path_factory):
    """(models.toml entry of a quantized tiny target with every proposer, its folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    proposers = dict(PROPOSERS)
    if request.param.startswith("Q"):
        target = str(write_tiny_gguf(folder / f"tiny.{request.param}.gguf", request.param))
    else:
        quantized_mlx_folder(folder)
        target = str(folder / "target")
        proposers |= LAYOUT_PROPOSERS
    drafter_heads(folder, target)
    lines = [f'[models.tiny]\ntarget = "{target}"\n\n[models.tiny.defaults]\nweights = "quantized"']
    for name, (kind, options) in proposers.items():
        options = options.format(folder=folder, target=target)
        lines.append(f'[models.tiny.proposers.{name}]\nkind = "{kind}"\nk_max = 4\n{options}')
    (folder / "models.toml").write_text("\n\n".join(lines) + "\n")
    return folder, request.param, list(proposers)


def test_every_proposer_kind_drafts_losslessly_on_quantized_weights(quantized_target, monkeypatch):
    folder, form, proposers = quantized_target
    monkeypatch.setenv("MLXSPEC_MODELS", str(folder / "models.toml"))
    runtime = priced_like_this_cpu(open_runtime(load_registry().get("tiny")))
    model = runtime.loaded.model
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear), form
    eos = set(runtime.loaded.tokenizer.eos_token_ids)
    prompts = [[5, 6, 7, 8] * 3, [40, 41, 42, 9, 40, 41]]
    references = [plain_greedy(model, prompt, MAX_TOKENS, eos) for prompt in prompts]
    drafted = {}
    for name in proposers:
        runtime.proposer(name)
        for tree in (False, True) if name in TREES else (False,):
            settings = GenerationSettings(max_tokens=MAX_TOKENS, k=3, tree=tree)
            drafted[name, tree] = 0
            for prompt, reference in zip(prompts, references):
                done = list(runtime.engine.stream(prompt, settings, name))[-1]
                label = f"{form} {name} tree={tree} {prompt[:3]}"
                assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
                assert done.record.weights["form"] == "quantized", label
                assert done.record.tree_rounds > 0 or not tree, label
                drafted[name, tree] += done.record.drafted
    assert all(drafted.values()), f"{form}: proposers that never drafted: {drafted}"


@pytest.mark.parametrize("family", [*NEWER, "qwen3_5_moe"])
def test_newer_families_draft_losslessly_on_weights_kept_quantized(family, tmp_path, monkeypatch):
    """Qwen3.5 (and its MoE, router gates at 8 bits), gpt-oss (its router at 8 bits) and Gemma 4
    (per-layer embeddings too) quantized to 4 bits as mlx-lm quantizes them, kept so:
    every proposer kind that applies stays lossless (the heads, untrained, read the
    hidden states of the verify itself; Gemma 4 cannot be split into layers)."""
    model = tiny_model(family, seed=1)
    model, config = quantize_model(model, FAMILIES[family], group_size=32, bits=4)
    target = tmp_path / "target"
    save_model(target, model)
    save_config(config, target / "config.json")
    byte_tokenizer()._tokenizer.save_pretrained(target)
    names = ["prompt-lookup", "suffix", "lookahead", "self-spec"]
    if family != "gemma4_text":  # its layers cannot be split off its per-layer inputs
        names += ["draft-model", "head", "medusa"]
        drafter_heads(tmp_path, str(target))
    proposers = {name: PROPOSERS[name] for name in names}
    if "draft-model" in proposers:  # Qwen3.5's first layer alone has no attention
        proposers["draft-model"] = ("draft-model", 'draft = "{target}"\ndraft_layers = 2')
    lines = [f'[models.tiny]\ntarget = "{target}"\n\n[models.tiny.defaults]\nweights = "quantized"']
    for name, (kind, options) in proposers.items():
        options = options.format(folder=tmp_path, target=target)
        lines.append(f'[models.tiny.proposers.{name}]\nkind = "{kind}"\nk_max = 4\n{options}')
    (tmp_path / "models.toml").write_text("\n\n".join(lines) + "\n")
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models.toml"))
    runtime = priced_like_this_cpu(open_runtime(load_registry().get("tiny")))
    loaded = runtime.loaded.model
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.named_modules()), family
    eos = set(runtime.loaded.tokenizer.eos_token_ids)
    prompts = [[40, 41, 42, 9, 40, 41, 7, 1, 2, 3, 4, 5, 6, 40, 41]]
    with pytest.raises(ProposerError, match="whose KV cache can be trimmed|cannot split"):
        runtime.proposer("self-spec")  # it would share the target's recurrent/window caches
    for name in proposers.keys() - {"self-spec"}:
        runtime.proposer(name)
        drafted = 0
        for prompt in prompts:
            reference = plain_greedy(loaded, prompt, MAX_TOKENS, eos)
            settings = GenerationSettings(max_tokens=MAX_TOKENS, k=3)
            done = list(runtime.engine.stream(prompt, settings, name))[-1]
            label = f"{family} quantized {name} {prompt[:3]}"
            assert_lossless(loaded, prompt, reference, list(done.token_ids), label, done.record)
            assert done.record.weights["form"] == "quantized", label
            drafted += done.record.drafted
        assert drafted, f"{family}: {name} never drafted"


def test_the_weights_form_is_part_of_the_calibration_key(tmp_path):
    """A curve measured on quantized weights never prices float ones (and back)."""
    target = str(write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf", "Q4_1"))
    kept = held_weights(load_model(target, progress=False, dequantize=False).model)
    floats = held_weights(load_model(target, progress=False, dequantize=True).model)
    assert (kept, floats) == ("q4 (affine, group 32), float32", "float32")
    assert calibration_key("tiny", kept) != calibration_key("tiny", floats)


def test_weights_are_chosen_on_the_command_line_and_shown_in_the_record(tmp_path, monkeypatch):
    target = str(write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", "Q8_0"))
    monkeypatch.setenv("MLXSPEC_DATA", str(tmp_path))
    runner = CliRunner()
    for flags, env, form, held in [
        (["--weights", "quantized"], {}, "quantized", "q8 (affine, group 32), float32"),
        ([], {"MLXSPEC_WEIGHTS": "quantized"}, "quantized", "q8 (affine, group 32), float32"),
        ([], {"MLXSPEC_WEIGHTS": "dequantized"}, "dequantized", "float32"),
        ([], {}, "dequantized", "float32"),  # auto, on this CPU
    ]:
        args = ["generate", "hi", "-m", target, "-p", "none", "-n", "3", "--raw", "--json"]
        result = runner.invoke(main, args + flags, env=env)
        assert result.exit_code == 0, result.output
        weights = json.loads(result.stdout.splitlines()[-1])["record"]["weights"]
        assert (weights["form"], weights["held"]) == (form, held), (flags, env)
    bad = runner.invoke(main, ["generate", "hi", "-m", target, "--weights", "int3"])
    assert_one_line_error(bad, "--weights", "int3", "quantized")
    bad = runner.invoke(main, ["generate", "hi", "-m", target], env={"MLXSPEC_WEIGHTS": "x"})
    assert_one_line_error(bad, "--weights", "'x'")


def test_a_bad_weights_default_in_models_toml_is_one_line(tmp_path, monkeypatch):
    models = tmp_path / "models.toml"
    models.write_text('[models.tiny]\ntarget = "x"\n[models.tiny.defaults]\nweights = "q3"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    result = CliRunner().invoke(main, ["generate", "hi", "-m", "tiny"])
    assert_one_line_error(result, "weights", "'auto', 'quantized' or 'dequantized'")


@pytest.mark.slow
def test_every_shipped_proposer_of_smollm2_answers_losslessly_on_quantized_weights():
    """`--weights quantized` on the real model: every proposer of the default entry
    answers, with plain decoding's greedy tokens for the same weights (on this CPU's
    measured cost curve: a calibration of quantized SmolLM2 here takes minutes)."""
    entry = replace_defaults(load_registry().get("smollm2-135m"), weights="quantized")
    weights = target_weights(entry)
    loaded = load_model(entry.target, progress=False, dequantize=weights.dequantize)
    runtime = priced_like_this_cpu(Runtime(entry, loaded, print, weights))
    prompt = [{"role": "user", "content": "Repeat: the quick brown fox jumps over the lazy dog"}]
    settings = GenerationSettings(max_tokens=8)
    plain = list(runtime.engine.stream(prompt, settings, "none"))[-1]
    assert plain.record.weights["form"] == "quantized"
    for name in entry.proposers:
        done = list(runtime.engine.stream(prompt, settings, runtime.proposer(name)))[-1]
        assert done.token_ids == plain.token_ids, name
