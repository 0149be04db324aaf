"""DistributedOptimizer's argument checks and wrapping, in one process without a launcher."""

import keras
import pytest

from hvd_train import comm
from hvd_train.keras.optimizer import DistributedOptimizer, is_distributed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"op": "max"}, "op must be"),
        ({"gradient_predivide_factor": 0.0}, "must be positive"),
        ({"gradient_predivide_factor": 2.0, "op": comm.Sum}, "only with op=Average"),
        ({"bucket_mb": -0.5}, "bucket_mb must be >= 0 or None, got -0.5"),
        ({"reduction": "tree"}, "reduction 'tree': expected one of auto, flat, two_level"),
        ({"backward_passes_per_step": 0}, "int >= 1, got 0"),
        ({"backward_passes_per_step": 1.5}, "int >= 1, got 1.5"),
    ],
)
def test_bad_options_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def test_wraps_in_place_and_keeps_the_serialised_form():
    sgd = keras.optimizers.SGD(0.1, momentum=0.5)
    config = sgd.get_config()
    wrapped = DistributedOptimizer(sgd)
    assert wrapped is sgd and is_distributed(sgd)
    assert isinstance(sgd, keras.optimizers.SGD) and type(sgd).__name__ == "SGD"
    assert keras.optimizers.serialize(sgd)["config"] == config
    assert keras.optimizers.serialize(sgd)["class_name"] == "SGD"
    with pytest.raises(ValueError, match="already distributed"):
        DistributedOptimizer(sgd)


def test_mixed_float16_puts_the_loss_scaling_inside():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        optimizer = DistributedOptimizer(keras.optimizers.Adam(1e-3))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert is_distributed(optimizer)
    assert not is_distributed(optimizer.inner_optimizer)


def test_a_built_optimizer_is_refused():
    sgd = keras.optimizers.SGD(0.1)
    sgd.build([keras.Variable([1.0])])
    with pytest.raises(ValueError, match="already built"):
        DistributedOptimizer(sgd)


def test_bf16_compression_sends_floats_as_bfloat16_and_restores_their_dtype():
    import numpy as np
    import tensorflow as tf

    bf16 = comm.Compression.bf16
    for dtype in (tf.float16, tf.float32, tf.float64):
        sent, ctx = bf16.compress(tf.constant([1.0 + 2.0**-10, 2.0**-20, -3.0], dtype))
        back = bf16.decompress(sent, ctx)
        assert sent.dtype == tf.bfloat16 and back.dtype == dtype
        # 1 + 2^-10 is between two bfloat16 values (1 and 1 + 2^-7): nearest, 1.
        assert back.numpy().tolist() == [1.0, 2.0**-20, -3.0]
    ints, ctx = bf16.compress(tf.constant([3, 4], tf.int32))
    assert ints.dtype == tf.int32 and bf16.decompress(ints, ctx).numpy().tolist() == [3, 4]
    # Beyond fp16's range, within bfloat16's.
    huge, ctx = bf16.compress(tf.constant([2.0**100]))
    assert np.isfinite(bf16.decompress(huge, ctx).numpy()).all()


def test_bf16_compression_is_refused_where_horovod_cannot_reduce_bfloat16(monkeypatch):
    assert comm.reduces_bfloat16()  # the installer's Horovod
    DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comm.Compression.bf16)
    # A Horovod without the patch (its op takes no bfloat16: the check's other answer).
    monkeypatch.setattr(comm, "reduces_bfloat16", lambda: False)
    with pytest.raises(ValueError, match="bf16 compression needs a Horovod that reduces bfloat16"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comm.Compression.bf16)
