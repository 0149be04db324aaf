"""A DLRM-style click model (Naumov et al. 2019) whose embedding table is split by rows over the
ranks (`hvd_train.ShardedEmbedding`), while its dense layers stay data parallel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hvd_train.errors import UserError
from models import register

if TYPE_CHECKING:
    import keras


@register("dlrm")
def build_dlrm(
    input_shape: tuple[int, ...],
    num_classes: int,
    rows: int = 100_000,
    fields: int = 8,
    dim: int = 16,
    bottom: Sequence[int] = (32,),
    top: Sequence[int] = (64, 32),
    sharded: bool = True,
    seed: int = 0,
) -> keras.Model:
    """DLRM-style click model: embedded ids and dense features, their pairwise dot products, an MLP.

    Each input row holds `fields` ids in [0, rows) (floats holding integers, as the "clicks" data
    carry them) and then the dense features. The ids share one table of `rows` x `dim`; the dense
    features pass a bottom MLP to `dim` values; the dot products of every pair of those fields + 1
    vectors (both triangles, as in DLRM's concatenating variant) and the dense vector feed the top
    MLP, which returns the logits.

    Args:
      input_shape: (fields + dense features,).
      num_classes: the logits (2 for click or not).
      rows: the table's rows; with "clicks" data, `data.vocab_size` unless given.
      fields: ids per row; with "clicks" data, `data.shape[0]` unless given.
      dim: values per id, and the bottom MLP's output width.
      bottom, top: hidden widths of the bottom and top MLPs (relu).
      sharded: true: the table is split by rows over all ranks (modern stack only); false: Keras's
        Embedding, held whole on every rank and data parallel like the rest.
      seed: the split table's initial values (the same at every worker count).

    Raises:
      UserError: an input with no dense feature, or sharded on the classic stack.
    """
    import keras

    if len(input_shape) != 1 or input_shape[0] <= fields:
        raise UserError(
            f"dlrm: input_shape must be (fields + dense features,) with {fields} fields and at "
            f"least one dense feature, got {tuple(input_shape)}"
        )
    inputs = keras.Input(input_shape)
    ids, dense = inputs[:, :fields], inputs[:, fields:]
    if sharded:
        import hvd_train

        try:
            table = hvd_train.ShardedEmbedding(rows, dim, seed=seed, name="table")
        except ValueError as err:  # the classic stack
            message = f"dlrm: sharded: true: {err}; set model.params.sharded: false"
            raise UserError(message) from None
    else:
        table = keras.layers.Embedding(rows, dim, name="table")
    embedded = table(ids)
    x = dense
    for i, width in enumerate(bottom):
        x = keras.layers.Dense(width, activation="relu", name=f"bottom_{i}")(x)
    x = keras.layers.Dense(dim, activation="relu", name="bottom_out")(x)
    vectors = keras.layers.Concatenate(axis=1)([keras.layers.Reshape((1, dim))(x), embedded])
    dots = keras.layers.Flatten()(keras.layers.Dot(axes=2)([vectors, vectors]))
    y = keras.layers.Concatenate()([x, dots])
    for i, width in enumerate(top):
        y = keras.layers.Dense(width, activation="relu", name=f"top_{i}")(y)
    outputs = keras.layers.Dense(num_classes, name="logits")(y)
    return keras.Model(inputs, outputs, name="dlrm")
