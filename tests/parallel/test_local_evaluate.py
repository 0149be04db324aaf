"""Metric states are summed over ranks only where every rank asks: in a fit() with the distributed
callbacks, and in `hvd_train.evaluate`; a plain evaluate, predict or `get_metrics_result()` on one
rank stays local (Horovod's pattern: `if rank == 0: model.evaluate(test)` after fit)."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from util import DIGITS_X, DIGITS_Y, LOSS, mlp, rank_seed

import hvd_train
from hvd_train import comm, data
from hvd_train.data import DataError
from hvd_train.keras import compat


def compiled(model, distributed=True):
    sgd = keras.optimizers.SGD(0.1)
    optimizer = hvd_train.DistributedOptimizer(sgd) if distributed else sgd
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    return model


def one_process_copy(model):
    """A fresh single-process model with `model`'s weights: what this rank alone would report."""
    copy = compiled(mlp(0), distributed=False)
    copy.set_weights(model.get_weights())
    return copy


def metric_states(model):
    """{metric: [total, count]}: this rank's states, read without a collective."""
    leaves = []
    for metric in model.metrics:  # Keras 3's CompileMetrics holds the compiled ones
        leaves += getattr(metric, "metrics", None) or [metric]
    return {m.name: [float(v.numpy()) for v in m.variables] for m in leaves}


def global_mean(states, name):
    """The exact mean over ranks, by hand: the summed totals over the summed counts."""
    return sum(s[name][0] for s in states) / sum(s[name][1] for s in states)


@contextlib.contextmanager
def collectives_recorded():
    """On one rank: record the reductions that `hvd_train.comm` is asked for, and run none (a stray
    one would wait forever for the other ranks), returning the local values unchanged."""
    called = []

    def recorded(kind):
        def reduce(tensors, *args, **kwargs):
            called.append(kind)
            return tensors

        return reduce

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(comm, "grouped_allreduce", recorded("grouped_allreduce"))
        patch.setattr(comm, "allreduce", recorded("allreduce"))
        yield called


def python(results):
    return {name: float(value) for name, value in results.items()}


def test_rank0_alone_evaluates_and_predicts_locally_after_a_distributed_fit():
    n, r = comm.size(), comm.rank()
    model = compiled(mlp(rank_seed()))
    train, steps = data.shard_dataset((DIGITS_X[:400], DIGITS_Y[:400]), 16, r, n, seed=3)
    model.fit(
        train,
        epochs=1,
        steps_per_epoch=steps,
        callbacks=hvd_train.distributed_callbacks(),
        verbose=0,
        shuffle=False,  # the sharded dataset reshuffles itself
    )
    hook_left = compat.METRICS_REPORT in vars(model)
    x_test, y_test = DIGITS_X[1500:1597], DIGITS_Y[1500:1597]
    outcome = None
    if r == 0:  # the final test evaluation on rank 0 only
        with collectives_recorded() as called:
            got = model.evaluate(x_test, y_test, batch_size=32, return_dict=True, verbose=0)
            getter = python(model.get_metrics_result())
            predicted = model.predict(x_test, batch_size=32, verbose=0)
        reference = one_process_copy(model)
        expected = reference.evaluate(x_test, y_test, batch_size=32, return_dict=True, verbose=0)
        outcome = {
            "collectives": called,
            "evaluate": max(abs(got[k] - expected[k]) for k in expected),
            "getter": max(abs(getter[k] - expected[k]) for k in expected),
            "predict": float(np.max(np.abs(predicted - reference.predict(x_test, verbose=0)))),
        }
    else:  # meanwhile the other ranks do something else, with no collective either
        model.predict(DIGITS_X[:64], verbose=0)
    outcomes = comm.allgather_object(outcome)
    hooks_left = comm.allgather_object(hook_left)
    chief = outcomes[0]

    assert not any(hooks_left), "fit() left its metric reduction installed"
    assert chief["collectives"] == [], "a rank-0-only evaluate or predict asked for a collective"
    assert chief["evaluate"] < 1e-6 and chief["getter"] < 1e-6
    assert chief["predict"] < 1e-6


def test_a_rank0_only_callback_reads_metrics_in_fit_and_the_logs_stay_global():
    n, r = comm.size(), comm.rank()
    model = compiled(mlp(rank_seed()))
    train, steps = data.shard_dataset((DIGITS_X[:480], DIGITS_Y[:480]), 16, r, n, seed=5)
    val = data.validation_shard((DIGITS_X[1000:1101], DIGITS_Y[1000:1101]), 16, r, n)  # uneven
    x_small, y_small = DIGITS_X[1200:1240], DIGITS_Y[1200:1240]
    states = []  # per epoch: this rank's training states (as validation starts), validation's
    chief = {"collectives": [], "batch_reads": 0, "epoch_end": [], "evaluate": []}

    class RecordStates(keras.callbacks.Callback):  # every rank; reads variables, no collective
        def on_test_begin(self, logs=None):
            self.train = metric_states(self.model)

        def on_epoch_end(self, epoch, logs=None):
            states.append((self.train, metric_states(self.model)))

    class ChiefReads(keras.callbacks.Callback):  # a user's callback, added on rank 0 only
        def on_train_batch_end(self, batch, logs=None):
            with collectives_recorded() as called:
                self.model.get_metrics_result()
            chief["collectives"] += called
            chief["batch_reads"] += 1

        def on_epoch_end(self, epoch, logs=None):
            with collectives_recorded() as called:
                chief["epoch_end"].append(python(self.model.get_metrics_result()))
                got = self.model.evaluate(x_small, y_small, return_dict=True, verbose=0)
            expected = one_process_copy(self.model).evaluate(
                x_small, y_small, return_dict=True, verbose=0
            )
            chief["evaluate"].append(max(abs(got[k] - expected[k]) for k in expected))
            chief["collectives"] += called

    history = model.fit(
        train,
        epochs=2,
        steps_per_epoch=steps,
        validation_data=val,
        callbacks=[
            *hvd_train.distributed_callbacks(),
            RecordStates(),
            *([ChiefReads()] if r == 0 else []),
        ],
        verbose=0,
        shuffle=False,
    ).history
    histories = comm.allgather_object(history)
    all_states = comm.allgather_object(states)
    chief = comm.allgather_object(chief if r == 0 else None)[0]

    assert all(h == histories[0] for h in histories), "ranks report different epoch logs"
    for epoch in range(2):
        train_states = [s[epoch][0] for s in all_states]
        val_states = [s[epoch][1] for s in all_states]
        for key, per_rank, name in [
            ("loss", train_states, "loss"),
            ("accuracy", train_states, "accuracy"),
            ("val_loss", val_states, "loss"),
            ("val_accuracy", val_states, "accuracy"),
        ]:
            exact = global_mean(per_rank, name)
            assert abs(history[key][epoch] - exact) <= 1e-5 * max(1.0, abs(exact)), (key, epoch)
        # Rank 0's getter saw its own validation states: local, not the global log.
        rank0_val_loss = global_mean(val_states[:1], "loss")
        assert abs(chief["epoch_end"][epoch]["loss"] - rank0_val_loss) < 1e-5
        if n > 1:
            assert abs(rank0_val_loss - history["val_loss"][epoch]) > 1e-4
    assert chief["collectives"] == [], "a rank-0-only read inside fit asked for a collective"
    assert chief["batch_reads"] == 2 * steps
    assert max(chief["evaluate"]) < 1e-6  # rank 0's evaluate inside fit: its one-process result


def _uneven_parts(x, y, how, r, n):
    """This rank's part for `hvd_train.evaluate`, the data it passes, and the shard keyword."""
    if how == "arrays":  # hvd_train.evaluate takes samples r, r + n, ...
        return (x[r::n], y[r::n]), (x, y), {"batch_size": 16}
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 7 batches: 4 and 3 on 2 ranks
    if how == "dataset, shard=True":
        return batches.shard(n, r), (batches,), {"shard": True}
    # Already sharded, shares 1 : 2 : ... : n: ranks run different numbers of batches.
    bounds = [len(x) * k * (k + 1) // (n * (n + 1)) for k in range(n + 1)]
    part = tf.data.Dataset.from_tensor_slices(
        (x[bounds[r] : bounds[r + 1]], y[bounds[r] : bounds[r + 1]])
    ).batch(16)
    return part, (part,), {}


@pytest.mark.parametrize("how", ["arrays", "dataset, shard=True", "sharded dataset"])
def test_distributed_evaluate_on_an_uneven_split_equals_one_process(how):
    n, r = comm.size(), comm.rank()
    x, y = DIGITS_X[:101], DIGITS_Y[:101]  # 101 is not divisible by 2 or 3
    model = compiled(mlp(0))  # the same weights on every rank
    part, given, options = _uneven_parts(x, y, how, r, n)
    got = hvd_train.evaluate(model, *given, **options)
    local = model.evaluate(*(part if how == "arrays" else (part,)), return_dict=True, verbose=0)
    expected = compiled(mlp(0), distributed=False).evaluate(
        x, y, batch_size=101, return_dict=True, verbose=0
    )
    gathered = comm.allgather_object((got, local))
    tolerance = {"loss": 1e-5, "accuracy": 1e-6}

    assert all(g == gathered[0][0] for g, _ in gathered), "ranks got different results"
    assert set(got) == set(expected)
    for name, tol in tolerance.items():
        assert abs(got[name] - expected[name]) < tol, name
    if n > 1:  # the negative control: the mean of the per-rank means misses on this split
        for name, tol in tolerance.items():
            mean_of_means = np.mean([part_result[name] for _, part_result in gathered])
            assert abs(mean_of_means - expected[name]) > 5 * tol, name


def test_distributed_evaluate_refuses_what_it_cannot_shard():
    n = comm.size()
    model = compiled(mlp(0))
    with pytest.raises(DataError, match="fewer than"):  # a rank would have nothing
        hvd_train.evaluate(model, DIGITS_X[: n - 1], DIGITS_Y[: n - 1])
    with pytest.raises(ValueError, match="shard=True needs arrays"):
        hvd_train.evaluate(model, iter([(DIGITS_X[:8], DIGITS_Y[:8])]), shard=True)
