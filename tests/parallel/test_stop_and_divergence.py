"""Stopping at an agreed step, and the weight-divergence check, on every rank of a real job."""

import keras
import numpy as np
import pytest
from util import DIGITS_X, DIGITS_Y, LOSS, max_abs_diff, mlp, rank_seed, weights

import hvd_train
from hvd_train import callbacks, comm, data
from hvd_train.core import faults


def compiled(model, passes=1):
    optimizer = hvd_train.DistributedOptimizer(
        keras.optimizers.SGD(0.05), backward_passes_per_step=passes
    )
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


class AskOnOneRank:
    """A StopRequest stand-in: the last rank "gets the signal" before batch `at` of epoch 2."""

    def __init__(self, at):
        self.at, self.batches, self.signal_name = at, 0, None

    @property
    def requested(self):
        return self.signal_name is not None


class Clock(keras.callbacks.Callback):
    """Sets the last rank's request before its `ask.at`-th batch of the second epoch."""

    def __init__(self, ask):
        super().__init__()
        self.ask = ask
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if comm.rank() == comm.size() - 1 and self.epoch == 1 and batch == self.ask.at:
            self.ask.signal_name = "SIGTERM"


@pytest.mark.parametrize("passes", [1, 2])
def test_a_stop_asked_on_one_rank_stops_every_rank_after_the_same_step(passes):
    n, r = comm.size(), comm.rank()
    model = compiled(mlp(rank_seed()), passes)
    train, steps = data.shard_dataset((DIGITS_X[:800], DIGITS_Y[:800]), 8, r, n, seed=2)
    ask = AskOnOneRank(at=5)
    stop_cb = callbacks.StopAtAgreedStep(ask)
    with pytest.raises(callbacks.Preempted) as stopped:
        model.fit(
            train,
            epochs=3,
            steps_per_epoch=steps,
            verbose=0,
            callbacks=[*hvd_train.distributed_callbacks(), Clock(ask), stop_cb],
        )
    where = (stopped.value.epoch, stopped.value.step_in_epoch)
    # The request rides on the first gradient allreduce after it is set (batch 5, 0-based);
    # with k passes per update an allreduce runs on every k-th batch only (counted from the
    # start of training), so the agreement waits for the next one. One worker: no allreduce.
    batch = 5
    while n > 1 and (steps + batch + 1) % passes:
        batch += 1
    expected = batch + 1
    stopped_at = comm.allgather_object(where)
    iterations = comm.allgather_object(int(model.optimizer.iterations.numpy()))

    assert stopped_at == [(1, expected)] * n
    assert len(set(iterations)) == 1  # every rank made the same updates


def test_weight_check_names_a_rank_whose_weights_were_changed():
    n, r = comm.size(), comm.rank()
    model = compiled(mlp(rank_seed()))
    train, _ = data.shard_dataset((DIGITS_X[:800], DIGITS_Y[:800]), 8, r, n, seed=2)

    class Tamper(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 6 and r == n - 1 and n > 1:
                weight = self.model.trainable_variables[0]
                weight.assign(weight + np.float32(1e-3))

    check = callbacks.CheckWeights(every=4)
    fit = {"epochs": 1, "steps_per_epoch": 12, "verbose": 0}
    if n == 1:  # no other rank to differ from: the check passes all 12 steps, which train
        initial = weights(model)
        model.fit(train, **fit, callbacks=[*hvd_train.distributed_callbacks(), Tamper(), check])
        assert int(model.optimizer.iterations.numpy()) == 12
        assert max_abs_diff(weights(model), initial) > 1e-3
        return
    with pytest.raises(faults.Diverged, match=rf"after 8 steps .*rank\(s\) {n - 1} differ"):
        model.fit(train, **fit, callbacks=[*hvd_train.distributed_callbacks(), Tamper(), check])
