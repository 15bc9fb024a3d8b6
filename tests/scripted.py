"""A tiny llama rigged to write a chosen answer, so answers with real markup (reasoning,
tool calls) run through the real engine, server and parser.

Random models cannot be made to write `<tool_call>`. This one is mlx-lm's own llama with
its weights set so that the next token depends on the current one only: embeddings are
one-hot, the one layer adds nothing (its output projections are zero), and the LM head maps
each token to its successor. The answer is a chain of `pieces`, each a token of its own
(the byte tokenizer's extra pieces, which encoding never produces): the prompt's last token
leads to the first piece, each piece to the next, the last to end-of-text, every other
token straight to end-of-text. Greedy decoding, speculative or not, writes the pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models import llama
from tiny_models import EOS, byte_level, byte_tokenizer


def scripted_tokenizer(pieces: Sequence[str], chat_template: str | None):
    """The byte tokenizer with the answer's pieces as tokens, and a chat template."""
    if len(set(pieces)) != len(pieces) or min(map(len, pieces)) < 2:
        raise ValueError("the pieces must differ and be several characters each")
    tokenizer = byte_tokenizer(pieces)
    tokenizer._tokenizer.chat_template = chat_template
    return tokenizer


def scripted_config(tokenizer) -> dict:
    """The llama's config: one dimension per token (rounded up for heads of an even size)."""
    size = len(tokenizer.get_vocab())
    return dict(
        model_type="llama",
        hidden_size=-(-size // 8) * 8,
        num_hidden_layers=1,
        intermediate_size=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        vocab_size=size,
        tie_word_embeddings=False,
    )


def scripted_model(tokenizer, pieces: Sequence[str], after_token: int) -> llama.Model:
    """A llama over `tokenizer` that answers `pieces` to any prompt ending in
    `after_token`."""
    vocab = tokenizer.get_vocab()
    config = scripted_config(tokenizer)
    size, width = config["vocab_size"], config["hidden_size"]
    model = llama.Model(llama.ModelArgs.from_dict(config))
    ids = [vocab[byte_level(piece)] for piece in pieces]
    eos = vocab[EOS]
    successor = [eos] * size
    for current, following in zip([after_token, *ids], [*ids, eos]):
        successor[current] = following
    head = mx.zeros((size, width))
    head[mx.array(successor), mx.arange(size)] = 1.0
    model.model.embed_tokens.weight = mx.eye(size, width)
    layer = model.model.layers[0]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.model.norm.weight = mx.ones((width,))
    model.lm_head.weight = head
    mx.eval(model.parameters())
    return model
