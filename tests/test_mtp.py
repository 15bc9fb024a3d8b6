"""Models' own MTP layers as drafters: tiny targets of each family (a hybrid Qwen3.5,
a hybrid MoE Qwen3-Next, DeepSeek-V3 with MLA and MoE, GLM-4.5 MoE, MiMo, a llama)
with MTP tensors written in each published layout's exact names and config fields (HF
names: zero-centred norms stored as w - 1 for the Qwen ones, MoE experts one by one,
MLA's kv_b_proj whole), loaded, drafting losslessly (greedy line and tree, sampled by
chi-square), and `mlxspec pull --mtp` against a local original checkpoint (index + shards).

Acceptance is made to happen by construction: the targets' layers write little into
the residual stream (so they act nearly as a bigram of the embedding), and each MTP
layer's fusion picks the next token's embedding, so the MTP layer drafts that bigram."""

from __future__ import annotations

import importlib
import json
import random
import struct
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from lossless import assert_lossless, plain_greedy
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import save_config, save_model
from tiny_models import VOCAB, byte_tokenizer

from mlxspec.cli import main
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.formats import convert_published
from mlxspec.drafter.head import HeadError, family_block, lm_rows
from mlxspec.drafter.mtp_pull import pull_mtp
from mlxspec.models.anatomy import is_recurrent, last_attention_layer, split_decoder
from mlxspec.proposers.head import HeadProposer
from mlxspec.sampling import SamplingSettings

D, EOS = 64, VOCAB - 1
# Every target: width 64, 4 heads, the byte tokenizer's vocabulary.
SIZE = dict(
    hidden_size=D, intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=VOCAB
)
HYBRID = dict(
    SIZE,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,  # layers 0, 2 recurrent (GatedDeltaNet), 1, 3 attention
    tie_word_embeddings=False,
)
# What the DeepSeek-V3 and GLM-4.5 configs share: two layers, the MTP layer after them
# (num_nextn_predict_layers), 4 routed experts (2 per token) and a shared one.
AFTER_LAST_MOE = dict(
    SIZE,
    num_hidden_layers=2,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    topk_group=1,
    rope_theta=1e4,
    num_nextn_predict_layers=1,
)
CONFIGS = {
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": dict(
            HYBRID,
            model_type="qwen3_5_text",
            rope_parameters={"type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        ),
    },
    # Qwen3.5 MoE (35B-A3B, 122B-A10B): its checkpoints store the experts fused,
    # mlp.experts.gate_up_proj (E, 2I, d) and mlp.experts.down_proj (E, d, I).
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": dict(
            HYBRID,
            model_type="qwen3_5_moe_text",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            rope_parameters={"type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        ),
    },
    "qwen3_next": dict(
        HYBRID,
        model_type="qwen3_next",
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
    ),
    # DeepSeek-V3: MLA attention; layer 0 MoE (routed + shared experts), layer 1 dense
    # (moe_layer_freq 2), so the MTP layer (index 2) is MoE only when built as layer N.
    "deepseek_v3": dict(
        AFTER_LAST_MOE,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        n_group=2,
        first_k_dense_replace=0,
        moe_layer_freq=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=32,  # MLA's per-head matrices: wide enough for 4-bit groups of 32
        qk_rope_head_dim=8,
        v_head_dim=32,
    ),
    # GLM-4.5: GQA with qk-norm and partial RoPE; layer 0 dense, layer 1 and MTP MoE.
    "glm4_moe": dict(
        AFTER_LAST_MOE,
        model_type="glm4_moe",
        max_position_embeddings=4096,
        num_key_value_heads=2,
        head_dim=16,
        n_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        attention_bias=True,
        rope_scaling=None,
        tie_word_embeddings=False,
    ),
    # MiMo: Qwen2 layers (q/k/v biases); its MTP layers are model.mtp_layers.*
    "mimo": dict(
        SIZE,
        model_type="mimo",
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_nextn_predict_layers=1,
    ),
    "llama": dict(
        SIZE,
        model_type="llama",
        num_hidden_layers=3,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
QUIET = ("o_proj.weight", "down_proj.weight")


def target(family: str, seed: int = 0):
    """A tiny random model whose layers write little (x0.05) into the residual stream,
    with a sharp LM head (x8), so its next token mostly follows the current one. The
    hybrids' GatedDeltaNet layers write more (x0.15): enough that a recurrent state left
    unrestored after a rejection changes the output, so the snapshot path is tested."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(json.loads(json.dumps(CONFIGS[family]))))

    def shape(path, value):
        if path.endswith("lm_head.weight"):
            return value * 8
        if path.endswith("linear_attn.out_proj.weight"):
            return value * 0.15
        return value * 0.05 if path.endswith(QUIET) else value

    model.update(tree_map_with_path(shape, model.parameters()))
    mx.eval(model.parameters())
    return model


def hf_block(
    model, prefix: str, zero_centred: bool, index: int | None = None, fused: bool = False
) -> tuple[dict, dict]:
    """(checkpoint tensors, what mlxspec must load): a fresh layer of the target's family
    (built as layer `index`) in HF names: experts one by one (`fused`: in two tensors,
    as Qwen3.5 MoE ships them), MLA's kv_b_proj whole, zero-centred norms stored as w - 1."""
    fresh = dict(tree_flatten(family_block(model, index).parameters()))
    intended = {
        k: (1 + 0.1 * mx.random.normal(v.shape) if k.endswith("norm.weight") else 0.05 * v)
        for k, v in fresh.items()
    }
    stored = {}
    for key, value in intended.items():
        if zero_centred and key.endswith("norm.weight"):
            value = value - 1.0
        if fused and key.endswith("switch_mlp.up_proj.weight"):
            continue  # stored with gate_proj, below
        if fused and key.endswith("switch_mlp.gate_proj.weight"):
            up = intended[key.replace("gate_proj", "up_proj")]
            stored[prefix + "mlp.experts.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
        elif fused and key.endswith("switch_mlp.down_proj.weight"):
            stored[prefix + "mlp.experts.down_proj"] = value
        elif ".switch_mlp." in key:  # mlx-lm stacks the experts; checkpoints list them
            for e in range(value.shape[0]):
                stored[prefix + key.replace("switch_mlp.", f"experts.{e}.")] = value[e]
        elif key.endswith("self_attn.unembed_out.weight"):
            continue  # stored with embed_q, below
        elif key.endswith("self_attn.embed_q.weight"):  # MLA: mlx-lm splits kv_b_proj
            # embed_q (heads, kv_lora_rank, nope), unembed_out (heads, v_head, kv_lora_rank)
            # from kv_b_proj (heads * (nope + v_head), kv_lora_rank), as DeepSeek ships it.
            unembed = intended[key.replace("embed_q", "unembed_out")]
            joined = mx.concatenate([value.swapaxes(-1, -2), unembed], axis=1)
            stored[prefix + key.replace("embed_q", "kv_b_proj")] = joined.reshape(
                -1, value.shape[1]
            )
        else:
            stored[prefix + key] = value
    return stored, intended


def picks(first: bool) -> mx.array:
    """A fusion matrix (d, 2d) that passes one of its two inputs through."""
    eye, zero = mx.eye(D), mx.zeros((D, D))
    return mx.concatenate([eye, zero] if first else [zero, eye], axis=1)


AFTER_THE_LAST = ("deepseek-v3", "glm-4.5", "deepseek-v3-names-on-llama")


def layout_tensors(layout: str, model) -> tuple[dict, dict]:
    """A checkpoint's MTP tensors in `layout`'s published names, and the block it holds."""
    n = len(model.layers)
    small = lambda: 0.1 * mx.random.normal((D,))  # noqa: E731
    if layout in ("qwen3.5", "qwen3.5-moe", "qwen3-next"):
        fused = layout == "qwen3.5-moe"
        block, intended = hf_block(model, "mtp.layers.0.", zero_centred=True, fused=fused)
        return {
            "mtp.fc.weight": picks(first=True),
            "mtp.pre_fc_norm_embedding.weight": mx.zeros((D,)),  # w - 1: a norm of ones
            "mtp.pre_fc_norm_hidden.weight": small(),
            "mtp.norm.weight": mx.zeros((D,)),
            **block,
        }, intended
    if layout in AFTER_THE_LAST:  # DeepSeek-V3's and GLM-4.5's names: the layer after the last
        p = f"model.layers.{n}."
        block, intended = hf_block(model, p, zero_centred=False, index=n)
        return {
            p + "eh_proj.weight": picks(first=True),
            p + "enorm.weight": mx.ones((D,)),
            p + "hnorm.weight": 1 + small(),
            p + "shared_head.norm.weight": mx.ones((D,)),
            p + "shared_head.head.weight": lm_rows(split_decoder(model), mx.arange(VOCAB)),
            p + "embed_tokens.weight": model.model.embed_tokens.weight,  # a copy: unused
            **block,
        }, intended
    p = "model.mtp_layers.0."  # MiMo: [hidden, embedding]
    block, intended = hf_block(model, p, zero_centred=False)
    return {
        p + "input_proj.weight": picks(first=False),
        p + "token_layernorm.weight": mx.ones((D,)),
        p + "hidden_layernorm.weight": 1 + small(),
        p + "final_layernorm.weight": mx.ones((D,)),
        **block,
    }, intended


# layout -> target family (DeepSeek-V3's names also on a llama target)
LAYOUTS = {
    "qwen3.5": "qwen3_5",
    "qwen3.5-moe": "qwen3_5_moe",
    "qwen3-next": "qwen3_next",
    "deepseek-v3": "deepseek_v3",
    "glm-4.5": "glm4_moe",
    "deepseek-v3-names-on-llama": "llama",
    "mimo": "mimo",
}


def mtp_head(layout: str, folder, seed: int = 0):
    model = target(LAYOUTS[layout], seed)
    mx.random.seed(seed + 1)
    tensors, intended = layout_tensors(layout, model)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    return model, convert_published(folder, model, split_decoder(model)), intended


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_layouts_load_draft_chained_and_stay_lossless(layout, tmp_path):
    model, head, intended = mtp_head(layout, tmp_path)
    # Every block weight is where mlx-lm's layer class wants it, zero-centring undone.
    loaded = dict(tree_flatten(head.block.parameters()))
    assert loaded.keys() == intended.keys()
    for key, value in intended.items():
        assert mx.allclose(loaded[key], value, atol=1e-6), key
    # What a chained step reads back: the normed output where the published forward
    # returns it normed (Qwen3-Next, MiMo), the pre-norm one for DeepSeek-V3's shared_head.
    g = mx.random.normal((1, 2, D)) * 5
    fed_normed = mx.allclose(head.feedback(g), head.features(g))
    assert fed_normed == (layout not in AFTER_THE_LAST) and head.features(g).abs().max() < 5
    engine = Engine(model, byte_tokenizer(), "tiny")
    # GatedDeltaNet state cannot be cut back: rejected drafts roll back by snapshot.
    hybrid = any(is_recurrent(layer) for layer in model.layers)
    assert engine.target.strategy == ("snapshot" if hybrid else "trim")
    assert hybrid == (layout in ("qwen3.5", "qwen3.5-moe", "qwen3-next"))
    engine.add_proposer(HeadProposer(head, engine.target))
    trees = [False] if engine.target.tree_unsupported else [False, True]
    for tree in trees:
        drafted = accepted = longest = 0
        for prompt in prompts(3, seed=len(layout)):
            settings = GenerationSettings(max_tokens=30, k=3, tree=tree)
            done = list(engine.stream(prompt, settings, "head"))[-1]
            reference = plain_greedy(model, prompt, 30, {EOS})
            label = f"{layout} tree={tree} {prompt[:3]}"
            assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
            drafted, accepted = drafted + done.record.drafted, accepted + done.record.accepted
            longest = max([longest, *done.record.accepted_lengths])
        assert drafted > 0 and accepted > drafted / 4, (layout, tree, accepted, drafted)
        assert longest >= 2, "chained drafts (depth > 1) were never all accepted"


def test_a_hybrid_target_uses_the_snapshot_path_and_samples_the_targets_law(tmp_path):
    """Sampled speculation with the MTP layer of a GatedDeltaNet hybrid: the first token
    follows the target's own law (chi-square), with rejections rolled back by snapshot."""
    model, head, _ = mtp_head("qwen3.5", tmp_path, seed=3)
    engine = Engine(model, byte_tokenizer(), "tiny")
    assert engine.target.strategy == "snapshot"
    engine.add_proposer(HeadProposer(head, engine.target))
    prompt, runs, temperature = [72, 101, 108, 108], 300, 3.0
    law = np.array(mx.softmax(model(mx.array([prompt]))[0, -1] / temperature).tolist())
    first, drafted = Counter(), 0
    for seed in range(runs):
        sampling = SamplingSettings(temperature=temperature, seed=seed)
        done = list(engine.stream(prompt, GenerationSettings(2, sampling, k=2), "head"))[-1]
        drafted += done.record.drafted
        first[done.token_ids[0] if done.token_ids else EOS] += 1
    likely = [t for t in range(VOCAB) if law[t] * runs >= 5]
    observed = np.array([first[t] for t in likely] + [runs - sum(first[t] for t in likely)])
    expected = np.array([law[t] for t in likely] + [1 - law[likely].sum()]) * runs
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    assert drafted >= runs and dof >= 3
    assert statistic < dof + 4.5 * np.sqrt(2 * dof), (statistic, dof)  # ~ alpha 1e-4


def test_an_mtp_layer_without_its_own_lm_head_drafts_with_the_targets(tmp_path):
    """GLM-4.6's checkpoints ship no shared_head.head and no embedding copy (vLLM issue
    #25993: "weights were not initialized from checkpoint: model.embed_tokens.weight,
    model.layers.92.shared_head.head.weight"; PR #27597 maps both to the target's): the
    target's own LM head reads the layer."""
    model = target("glm4_moe")
    tensors, _ = layout_tensors("glm-4.5", model)
    n = len(model.layers)
    del tensors[f"model.layers.{n}.shared_head.head.weight"]
    del tensors[f"model.layers.{n}.embed_tokens.weight"]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    head = convert_published(tmp_path, model, split_decoder(model))
    assert not head.spec.own_lm_head and "lm_head" not in head
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(HeadProposer(head, engine.target))
    prompt = prompts(1, seed=4)[0]
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=20, k=3), "head"))[-1]
    reference = plain_greedy(model, prompt, 20, {EOS})
    assert_lossless(model, prompt, reference, list(done.token_ids), "glm-4.6", done.record)
    assert done.record.accepted > done.record.drafted / 4, done.record


@pytest.mark.parametrize(
    "layout, removed, named",
    [
        ("qwen3.5", "mtp.layers.0.self_attn.k_proj.weight", "block.self_attn.k_proj.weight"),
        # sanitize stacks the experts: the missing one in the checkpoint's own name
        ("deepseek-v3", "model.layers.2.mlp.experts.3.up_proj.weight", "missing model.layers.2."),
        # sanitize splits kv_b_proj: what is missing after it, all on the line
        ("deepseek-v3", "model.layers.2.self_attn.kv_b_proj.weight", "embed_q.weight, block."),
        ("glm-4.5", "model.layers.2.mlp.gate.e_score_correction_bias", "e_score_correction_bias"),
    ],
)
def test_an_mtp_layer_that_does_not_fit_is_refused_in_one_line(layout, removed, named, tmp_path):
    model = target(LAYOUTS[layout])
    tensors, _ = layout_tensors(layout, model)
    del tensors[removed]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(HeadError, match="-mtp head but does not fit") as err:
        convert_published(tmp_path, model, split_decoder(model))
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


# --- mlxspec pull --mtp --------------------------------------------------------------------------


def original_checkpoint(
    folder,
    model,
    layout_name: str = "deepseek-v3-names-on-llama",
    config=None,
    fp8: bool = False,
    **changes,
) -> dict:
    """An original (HF) checkpoint of `model` with its MTP layer in the layer after the
    last (GLM-4.5 / DeepSeek-V3 names): the target's tensors in one shard, the MTP
    tensors in another, and a third shard that is not a safetensors file at all, so a
    pull that opened anything but the MTP shard would fail. `fp8`: the block's matrices
    as DeepSeek-V3 ships them (float8_e4m3, a weight_scale_inv per 128 x 128 block).
    Returns the block's weights in mlx-lm's names."""
    folder.mkdir()
    mtp, intended = layout_tensors(layout_name, model)
    for key, value in changes.items():
        if value is None:
            mtp.pop(key)
        else:
            mtp[key] = value
    fp8_names = [k for k in mtp if fp8 and k.endswith("_proj.weight") and ".eh_proj" not in k]
    for name in fp8_names:
        scale = mtp[name].abs().max() / 448  # float8_e4m3's largest value
        mtp[name] = mx.to_fp8(mtp[name] / scale)
        blocks = tuple(-(-side // 128) for side in mtp[name].shape)
        mtp[f"{name}_scale_inv"] = mx.full(blocks, scale)
    body = {f"model.{k}": v for k, v in tree_flatten(model.model.parameters())}
    mx.save_safetensors(str(folder / "model-00001-of-00003.safetensors"), body)
    mx.save_safetensors(str(folder / "model-00002-of-00003.safetensors"), mtp)
    label_fp8(folder / "model-00002-of-00003.safetensors", fp8_names)
    (folder / "model-00003-of-00003.safetensors").write_bytes(b"not weights")
    weight_map = {k: "model-00001-of-00003.safetensors" for k in body}
    weight_map.update({k: "model-00002-of-00003.safetensors" for k in mtp})
    weight_map["lm_head.weight"] = "model-00003-of-00003.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = config or {"model_type": "glm4_moe", "num_hidden_layers": len(model.layers)}
    if fp8:
        fp8_fields = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
        config = {**config, "quantization_config": fp8_fields}
    (folder / "config.json").write_text(
        json.dumps({"hidden_size": D, **config, "num_nextn_predict_layers": 1})
    )
    return intended


def label_fp8(path, names: list[str]) -> None:
    """mlx writes FP8 bytes as U8; DeepSeek's files say F8_E4M3 (mlx reads both as bytes)."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    for name in names:
        header[name]["dtype"] = "F8_E4M3"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A quantized tiny llama target in mlx-lm's format (named `tiny` in models.toml),
    and private config and cache folders."""
    from test_loading import save_tiny_llama

    model, _ = save_tiny_llama(tmp_path / "float")  # the same weights, not quantized
    save_tiny_llama(tmp_path / "tiny", quantize=True)
    models = tmp_path / "models.toml"
    models.write_text(f'[models.tiny]\ntarget = "{tmp_path / "tiny"}"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path, model


def cli(*args):
    return CliRunner().invoke(main, list(args))


def generate(proposer: str) -> dict:
    """`mlxspec generate --json` on the models.toml entry `tiny`, greedy, k = 3."""
    args = ["generate", "hello there", "-m", "tiny", "-p", proposer, "-n", "24", "--k", "3"]
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_pull_mtp_fetches_only_the_mtp_shard_quantizes_registers_and_drafts(hub):
    tmp_path, model = hub
    original_checkpoint(tmp_path / "original", model)
    result = cli("pull", "tiny", "--mtp", "--from", str(tmp_path / "original"))
    assert result.exit_code == 0, result.output
    assert "in 1 of the checkpoint's files: model-00002-of-00003" in result.output
    assert "registered as proposer 'mtp' of 'tiny'" in result.output
    saved = list((tmp_path / "cache" / "mtp").iterdir())[0]
    stored = mx.load(str(saved / "mtp.safetensors"))
    assert "model.layers.2.self_attn.q_proj.scales" in stored  # quantized like the target
    assert json.loads((saved / "config.json").read_text())["quantization"]["bits"] == 4

    spec, plain = generate("mtp"), generate("none")
    assert spec["record"]["proposer"] == "mtp" and spec["record"]["drafted"] > 0
    assert spec["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("layout", ["deepseek-v3", "glm-4.5", "qwen3.5-moe"])
def test_pull_mtp_of_a_moe_target_keeps_the_mtp_layer_only_and_stays_lossless(
    layout, tmp_path, monkeypatch
):
    """DeepSeek-V3 (MLA + MoE, its block in FP8), GLM-4.5 (MoE) and Qwen3.5 MoE (hybrid,
    fused experts): the conversion of a 4-bit MLX target has no MTP layer; the pull takes
    it from the original checkpoint's MTP shard and quantizes it like the target."""
    family = LAYOUTS[layout]
    model = target(family)
    nn.quantize(model, group_size=32, bits=4, class_predicate=quantizable)
    config = {**CONFIGS[family], "quantization": {"group_size": 32, "bits": 4}}
    save_model(tmp_path / "tiny", model)
    save_config(dict(config), tmp_path / "tiny" / "config.json")
    byte_tokenizer()._tokenizer.save_pretrained(tmp_path / "tiny")
    fp8 = layout == "deepseek-v3"  # as DeepSeek ships it: the block in FP8
    intended = original_checkpoint(
        tmp_path / "original", target(family), layout, CONFIGS[family], fp8
    )
    (tmp_path / "models.toml").write_text(f'[models.tiny]\ntarget = "{tmp_path / "tiny"}"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models.toml"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))

    result = cli("pull", "tiny", "--mtp", "--from", str(tmp_path / "original"))
    assert result.exit_code == 0, result.output
    (saved,) = (tmp_path / "cache" / "mtp").iterdir()
    stored = mx.load(str(saved / "mtp.safetensors"))
    n = len(model.layers)
    after_last = layout in AFTER_THE_LAST
    assert all(key.startswith(f"model.layers.{n}." if after_last else "mtp.") for key in stored)
    assert not any(key.endswith("_scale_inv") for key in stored)  # FP8 made 4-bit
    assert f"model.layers.{n}.embed_tokens.weight" not in stored  # the target's own is used
    if after_last:
        assert f"model.layers.{n}.mlp.experts.3.down_proj.scales" in stored  # one by one
    else:  # fused, not in mlx's names: quantized when it loads
        assert stored["mtp.layers.0.mlp.experts.down_proj"].dtype == mx.float32
    if layout == "deepseek-v3":
        assert f"model.layers.{n}.self_attn.kv_b_proj.scales" in stored  # MLA, split on load

    spec, plain = generate("mtp"), generate("none")
    assert spec["record"]["drafted"] > 0 and spec["record"]["accepted"] > 0
    assert spec["token_ids"] == plain["token_ids"]

    floats = convert_published(saved, model, split_decoder(model), dequantize=True)
    loaded = dict(tree_flatten(floats.block.parameters()))
    for key in ("mlp.switch_mlp.up_proj.weight", "self_attn.o_proj.weight"):  # FP8, 4-bit
        error = mx.linalg.norm(loaded[key] - intended[key]) / mx.linalg.norm(intended[key])
        assert error < 0.2, (key, error)

    # Where quantized matmul is fast (Metal) the layer loads 4-bit as the target is: as
    # stored, or (Qwen3.5's fused experts) quantized now; only DeepSeek's and GLM's
    # router gate (no quantized twin in mlx) made float.
    head = convert_published(saved, model, split_decoder(model), dequantize=False)
    quantized = {k.rsplit(".", 1)[0] for k, _ in tree_flatten(head.parameters()) if "scales" in k}
    assert {"fc", "block.mlp.switch_mlp.up_proj", "block.self_attn.o_proj"} <= quantized
    if after_last:
        assert "lm_head" in quantized and "block.mlp.gate" not in quantized
    if layout == "deepseek-v3":  # kv_b_proj split by mlx-lm's sanitize, re-quantized
        assert {"block.self_attn.embed_q", "block.self_attn.unembed_out"} <= quantized
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(HeadProposer(head, engine.target))
    accepted = 0
    for prompt in prompts(2, seed=3):
        done = list(engine.stream(prompt, GenerationSettings(max_tokens=20, k=3), "head"))[-1]
        reference = plain_greedy(model, prompt, 20, {EOS})
        assert_lossless(model, prompt, reference, list(done.token_ids), layout, done.record)
        accepted += done.record.accepted
    assert accepted > 0


@pytest.mark.parametrize("layout", ["qwen3.5", "qwen3-next", "mimo", "glm-4.5"])
def test_every_pulled_layout_loads_quantized_the_metal_way(layout, tmp_path):
    """What a Mac loads: the pulled layer of a 4-bit target, kept 4-bit. Each family's
    sanitize must see its quantized experts (Qwen3-Next's stacks `.weight` only) and
    every layer must come out quantized, near the checkpoint's weights."""
    model = target(LAYOUTS[layout])
    config = CONFIGS[LAYOUTS[layout]]
    intended = original_checkpoint(tmp_path / "original", model, layout, config)
    pull_mtp(str(tmp_path / "original"), tmp_path / "pulled", {"group_size": 32, "bits": 4})
    head = convert_published(tmp_path / "pulled", model, split_decoder(model), dequantize=False)
    quantized = {k.rsplit(".", 1)[0] for k, _ in tree_flatten(head.parameters()) if "scales" in k}
    assert {"fc", "block.self_attn.o_proj"} <= quantized, quantized
    assert ("block.mlp.switch_mlp.up_proj" in quantized) == (
        "moe" in type(head.block.mlp).__name__.lower()
    )
    floats = convert_published(tmp_path / "pulled", model, split_decoder(model), dequantize=True)
    loaded = dict(tree_flatten(floats.block.parameters()))
    for key, value in intended.items():
        error = mx.linalg.norm(loaded[key] - value) / max(float(mx.linalg.norm(value)), 1e-6)
        assert error < 0.2, (key, error)
    # The same 4-bit values either way: the kept layer writes what the float one does
    # into the residual stream (compared on what it writes: it writes little).
    x = mx.random.normal((1, 6, D))
    kept, made_float = (h.block(x, "causal") - x for h in (head, floats))
    error = mx.linalg.norm(kept - made_float) / mx.linalg.norm(made_float)
    assert error < 1e-3, float(error)


def quantizable(_path: str, module) -> bool:
    """The layers mlx-lm would quantize at group size 32."""
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % 32 == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model.layers.2.enorm.weight": None}, "does not fit this target"),
        ({"model.layers.2.eh_proj.weight": mx.zeros((96, 192))}, "does not fit this target"),
    ],
)
def test_a_pulled_mtp_layer_missing_a_tensor_or_too_wide_fails_in_one_line(hub, change, message):
    tmp_path, model = hub
    original_checkpoint(tmp_path / "original", model, **change)
    assert cli("pull", "tiny", "--mtp", "--from", str(tmp_path / "original")).exit_code == 0
    result = cli("generate", "hello", "-m", "tiny", "-p", "mtp", "-n", "4")
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("Error: proposer 'mtp'") and message in lines[-1], result.output


def test_pull_mtp_says_in_one_line_when_the_hub_cannot_be_reached(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    result = cli("pull", "tiny", "--mtp", "--from", "someone/not-cached-here")
    assert result.exit_code != 0
    assert "cannot reach the Hugging Face hub" in result.output, result.output


def test_a_checkpoint_without_mtp_tensors_is_named(hub):
    tmp_path, model = hub
    original_checkpoint(tmp_path / "original", model)
    index = tmp_path / "original" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(
        json.dumps({"weight_map": {k: v for k, v in weight_map.items() if ".layers.2." not in k}})
    )
    result = cli("pull", "tiny", "--mtp", "--from", str(tmp_path / "original"))
    assert result.exit_code != 0 and "has no MTP tensors" in result.output


def test_mtp_without_a_pull_says_what_to_run(hub):
    models = hub[0] / "models.toml"
    models.write_text(models.read_text() + "[models.tiny.proposers.mtp]\n")
    result = cli("generate", "hello", "-m", "tiny", "-p", "mtp", "-n", "4")
    assert result.exit_code != 0 and "mlxspec pull tiny --mtp" in result.output


def test_the_mtp_layer_is_modelled_on_an_attention_layer_of_a_hybrid():
    model = target("qwen3_5")
    assert last_attention_layer(model.layers) == 3 and not family_block(model).is_linear


@pytest.mark.parametrize("source", ["smollm2-135m", "/models/some.Q4_K_M.gguf"])
def test_pull_mtp_from_a_gguf_says_so_at_once(hub, source):
    result = cli("pull", "tiny", "--mtp", "--from", source)
    assert result.exit_code != 0 and "keeps no MTP layer" in result.output, result.output


# --- MiMo against its reference forward pass ---------------------------------------------

# XiaomiMiMo/MiMo-7B-Base's config.json as quoted in NVIDIA-NeMo/Megatron-Bridge
# tests/unit_tests/models/mimo/test_mimo_bridge.py (9cbb207), its sizes shrunk.
MIMO_7B = {
    "architectures": ["MiMoForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 32768,
    "model_type": "mimo",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 640000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151680,
}
MIMO_TINY = MIMO_7B | {
    "hidden_size": D,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}


def qwen2_layer(w: dict, x: mx.array, theta: float, heads: int, kv_heads: int) -> mx.array:
    """vLLM's Qwen2DecoderLayer (MiMo's mtp_block) over x (1, L, d), causal, positions
    0..L-1: q/k/v with biases, rotate-half RoPE, GQA, SiLU-gated MLP, both residuals."""
    n, head_dim = x.shape[1], x.shape[2] // heads
    normed = rms(x, w["input_layernorm.weight"], 1e-5)

    def project(name, count, rope):
        y = normed @ w[f"self_attn.{name}_proj.weight"].T + w[f"self_attn.{name}_proj.bias"]
        y = y.reshape(1, n, count, head_dim).transpose(0, 2, 1, 3)
        if not rope:
            return y
        angles = mx.arange(n)[:, None] * theta ** (-mx.arange(0, head_dim, 2) / head_dim)
        cos, sin = (mx.concatenate([f(angles)] * 2, -1) for f in (mx.cos, mx.sin))
        half = head_dim // 2
        return y * cos + mx.concatenate([-y[..., half:], y[..., :half]], -1) * sin

    q, k, v = project("q", heads, True), project("k", kv_heads, True), project("v", kv_heads, 0)
    k, v = (mx.repeat(t, heads // kv_heads, axis=1) for t in (k, v))
    future = mx.triu(mx.ones((n, n)), k=1) * -1e9
    scores = mx.softmax(q @ k.transpose(0, 1, 3, 2) / head_dim**0.5 + future, axis=-1)
    attended = (scores @ v).transpose(0, 2, 1, 3).reshape(1, n, heads * head_dim)
    h = x + attended @ w["self_attn.o_proj.weight"].T
    m = rms(h, w["post_attention_layernorm.weight"], 1e-5)
    gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
    return h + (gate * mx.sigmoid(gate) * up) @ w["mlp.down_proj.weight"].T


def rms(x, w, eps):
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_mimo_mtp_drafts_what_vllms_mimo_mtp_computes(tmp_path):
    """One draft step over a sequence, by vLLM's MiMoMultiTokenPredictorLayer.forward
    (mimo_mtp.py @ 0bb55d6) written out by hand: it reads `MiMoModel.forward`'s output,
    `hidden_states + residual` BEFORE the final norm (mimo.py @ 1b55f1e; the target's
    norm weight is made uneven so that the normed state would differ after
    hidden_layernorm), [hidden_layernorm(h), token_layernorm(e)] through input_proj, the
    embedding zeroed at position 0, a Qwen2 layer, final_layernorm, the target's LM head."""
    from mlx_lm.models import mimo

    mx.random.seed(11)
    model = mimo.Model(mimo.ModelArgs.from_dict(MIMO_TINY))
    model.model.norm.weight = 1 + 0.5 * mx.random.normal((D,))
    mx.eval(model.parameters())
    p = "model.mtp_layers.0."
    block, w = hf_block(model, p, zero_centred=False)
    fusion = {
        "input_proj.weight": 0.1 * mx.random.normal((D, 2 * D)),
        "token_layernorm.weight": 1 + 0.2 * mx.random.normal((D,)),
        "hidden_layernorm.weight": 1 + 0.2 * mx.random.normal((D,)),
        "final_layernorm.weight": 1 + 0.2 * mx.random.normal((D,)),
    }
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), {**block} | {p + k: v for k, v in fusion.items()}
    )
    kept = ("model_type", "hidden_size", "num_hidden_layers", "rms_norm_eps", "vocab_size")
    pulled = {k: MIMO_TINY[k] for k in (*kept, "num_nextn_predict_layers")}
    (tmp_path / "config.json").write_text(json.dumps(pulled | {"mtp_source": "mimo-7b"}))
    decoder = split_decoder(model)
    head = convert_published(tmp_path, model, decoder)

    tokens = random.Random(12).choices(range(256), k=9)
    h = model.model.embed_tokens(mx.array([tokens[:-1]]))
    for layer in model.model.layers:  # MiMoModel.forward: the stream before model.norm
        h = layer(h, "causal")
    e = model.model.embed_tokens(mx.array([tokens[1:]]))
    e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)  # positions == 0
    x = (
        mx.concatenate(
            [
                rms(h, fusion["hidden_layernorm.weight"], 1e-5),
                rms(e, fusion["token_layernorm.weight"], 1e-5),
            ],
            axis=-1,
        )
        @ fusion["input_proj.weight"].T
    )
    x = qwen2_layer(w, x, MIMO_7B["rope_theta"], 4, 2)
    expected = rms(x, fusion["final_layernorm.weight"], 1e-5) @ model.lm_head.weight.T

    rows = decoder.hidden(mx.array([tokens[:-1]]), [None] * 2, capture=head.target_layers)
    embeds = decoder.embed(mx.array([tokens[1:]]))
    g = head(head.from_target(rows), embeds, "causal")
    logits = head.logits(g, lm_rows(decoder, head.vocab))
    assert mx.allclose(logits, expected, atol=1e-3, rtol=1e-3), float(
        (logits - expected).abs().max()
    )


def test_pull_fetches_every_drafter_of_an_entry_so_it_drafts_offline(hub, monkeypatch):
    """`pull NAME` fetches the target, draft models and the drafters' weights (a block
    drafter, a head, Medusa heads, an exit head), each with its own files: a user who
    pulls once and goes offline can still use `--proposer dflash`."""
    import mlxspec.models.loading as loading
    from mlxspec.drafter.block import BLOCK_PATTERNS
    from mlxspec.drafter.medusa import MEDUSA_PATTERNS

    tmp_path, _ = hub
    (tmp_path / "models.toml").write_text(
        f'[models.tiny]\ntarget = "{tmp_path / "tiny"}"\n'
        '[models.tiny.proposers.draft-model]\ndraft = "org/draft"\n'
        '[models.tiny.proposers.dflash]\nkind = "block"\npath = "org/dflash"\n'
        '[models.tiny.proposers.medusa]\npath = "org/medusa"\n'
        "[models.tiny.proposers.mtp]\n"  # pulled by --mtp, not here
    )
    fetched = {}

    def download(ref, *, progress, patterns):
        fetched[ref] = patterns
        return tmp_path / "tiny"

    monkeypatch.setattr(loading, "_download_from_hub", download)
    result = cli("pull", "tiny")
    assert result.exit_code == 0, result.output
    drafters = {"org/dflash": BLOCK_PATTERNS, "org/medusa": MEDUSA_PATTERNS}
    assert fetched == {"org/draft": None, **drafters}
    assert "tiny: ready" in result.output
