"""Global metrics and one model: metric states reduced exactly, BatchNorm statistics averaged."""

import keras
from util import DIGITS_X, DIGITS_Y, LOSS, mlp, rank_seed, spread_over_ranks

import hvd_train
from hvd_train import comm, data
from hvd_train.keras import compat


def bn_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    x = keras.layers.Dense(32)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def compiled(model):
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    return model


def test_uneven_validation_gives_the_one_process_accuracy_and_loss():
    n, r = comm.size(), comm.rank()
    x_val, y_val = DIGITS_X[:101], DIGITS_Y[:101]  # 101 is not divisible by 2 or 3
    model = compiled(mlp(0))
    shard = data.validation_shard((x_val, y_val), 16, r, n)
    got = hvd_train.evaluate(model, shard)  # an already sharded dataset
    reference = compiled(mlp(0))
    local = reference.evaluate(shard, return_dict=True, verbose=0)  # this rank's shard only
    expected = reference.evaluate(x_val, y_val, batch_size=101, return_dict=True, verbose=0)
    gathered = comm.allgather_object(got)

    assert all(g == gathered[0] for g in gathered)
    assert abs(got["accuracy"] - expected["accuracy"]) < 1e-6
    assert abs(got["loss"] - expected["loss"]) < 1e-5
    if n > 1:  # the shard alone reports something else: the reduction is doing the work
        assert abs(local["accuracy"] - expected["accuracy"]) > 1e-3


def test_fit_history_is_global_and_every_variable_agrees_at_epoch_end():
    n, r = comm.size(), comm.rank()
    model = compiled(bn_model(rank_seed()))
    train, steps = data.shard_dataset((DIGITS_X[:600], DIGITS_Y[:600]), 16, r, n, seed=1)
    val = data.validation_shard((DIGITS_X[600:701], DIGITS_Y[600:701]), 16, r, n)
    agree = []

    class Check(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            agree.append(spread_over_ranks([v.numpy() for v in self.model.variables]))

    history = model.fit(
        train,
        epochs=2,
        steps_per_epoch=steps,
        validation_data=val,
        callbacks=[*hvd_train.distributed_callbacks(), Check()],
        verbose=0,
        shuffle=False,
    ).history
    histories = comm.allgather_object(history)
    moving = [
        v.numpy() for v in model.non_trainable_variables if "moving" in compat.variable_name(v)
    ]
    moving_spread = spread_over_ranks(moving)

    assert all(h == histories[0] for h in histories), "ranks report different metrics"
    assert agree == [0.0, 0.0], "BatchNorm statistics (or weights) differ between ranks"
    assert moving and moving_spread == 0.0
    assert set(history) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history["loss"][1] < history["loss"][0]  # and it trained
