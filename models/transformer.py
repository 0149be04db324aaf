"""A small Transformer encoder (Vaswani et al. 2017) that classifies sequences of token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hvd_train.errors import UserError
from models import register

if TYPE_CHECKING:
    import keras


@register("transformer")
def build_transformer(
    input_shape: tuple[int, ...],
    num_classes: int,
    vocab_size: int = 10000,
    d_model: int = 64,
    heads: int = 4,
    ff: int = 128,
    blocks: int = 2,
    dropout: float = 0.1,
) -> keras.Model:
    """Transformer text classifier: token and position embeddings, encoder blocks, mean pooling.

    Each block is post-LayerNorm, as in the paper: x = LayerNorm(x + Dropout(Attention(x))), then
    x = LayerNorm(x + Dropout(FeedForward(x))), the feed-forward being Dense(ff, relu) and
    Dense(d_model). Dropout also follows the embedding sum. Every position is attended to and
    averaged (no padding mask).

    Args:
      input_shape: (seq_len,): integer token ids in [0, vocab_size).
      num_classes: the logits.
      vocab_size: the token embedding's rows.
      d_model: the embedding and block width; divisible by `heads`.
      heads: attention heads, each d_model / heads wide.
      ff: the feed-forward layer's hidden width.
      blocks: encoder blocks.
      dropout: the rate of every dropout layer.

    Raises:
      UserError: an input shape that is not (seq_len,), or d_model not divisible by heads.
    """
    if len(input_shape) != 1:
        raise UserError(f"transformer: input_shape must be (seq_len,), got {tuple(input_shape)}")
    if d_model % heads:
        raise UserError(f"transformer: d_model ({d_model}) must be divisible by heads ({heads})")
    import keras

    from models.layers import PositionEmbedding

    inputs = keras.Input(tuple(input_shape), dtype="int32")
    x = keras.layers.Embedding(vocab_size, d_model, name="token_embedding")(inputs)
    x = PositionEmbedding(name="position_embedding")(x)
    x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
    for block in range(1, blocks + 1):
        name = f"block{block}"
        y = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"{name}_attention")(x, x)
        y = keras.layers.Dropout(dropout, name=f"{name}_attention_dropout")(y)
        x = keras.layers.Add(name=f"{name}_attention_add")([x, y])
        x = keras.layers.LayerNormalization(name=f"{name}_attention_norm")(x)
        y = keras.layers.Dense(ff, activation="relu", name=f"{name}_ff1")(x)
        y = keras.layers.Dense(d_model, name=f"{name}_ff2")(y)
        y = keras.layers.Dropout(dropout, name=f"{name}_ff_dropout")(y)
        x = keras.layers.Add(name=f"{name}_ff_add")([x, y])
        x = keras.layers.LayerNormalization(name=f"{name}_ff_norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="transformer")
