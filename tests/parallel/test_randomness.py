"""Random state is per rank: every rank seeded alike still draws its own dropout masks, noise and
flips, and rank r's are those of one process whose generators are seeded rank_seed(seed, r)
(Keras 3) or whose TensorFlow seed is rank_seed(seed, r) (Keras 2); weights stay global."""

import keras
import numpy as np
import tensorflow as tf

import hvd_train
from hvd_train import comm
from hvd_train.callbacks import CheckWeights
from hvd_train.keras import compat
from hvd_train.keras.randomness import random_state_variables, rank_seed
from hvd_train.keras.state import agreed_variables, weights_digest

BATCH = 8
SEED = 1234
LAYER_SEEDS = {"flip": 11, "noise": 12, "dropout": 13}
# Outside every model, so that no broadcast or averaging touches what the probes saw.
SEEN: dict[str, tf.Variable] = {}


class Probe(keras.layers.Layer):
    """Keeps what the layer before it produced in the last training step."""

    def __init__(self, key: str, **kwargs):
        super().__init__(**kwargs)
        self.key = key

    def build(self, input_shape):
        SEEN[self.key] = tf.Variable(tf.zeros((BATCH, *input_shape[1:])), trainable=False)

    def call(self, inputs, training=None):
        if training:
            SEEN[self.key].assign(inputs)
        return inputs


def random_model(tag: str, seeds: dict[str, int | None]) -> keras.Model:
    """flip -> noise -> dropout, each followed by a probe keyed `tag/<layer>`."""
    inputs = keras.Input((4, 4, 1))
    x = keras.layers.RandomFlip("horizontal", seed=seeds["flip"])(inputs)
    x = Probe(f"{tag}/flip")(x)
    x = keras.layers.GaussianNoise(1.0, seed=seeds["noise"])(x)
    x = Probe(f"{tag}/noise")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.5, seed=seeds["dropout"])(x)
    x = Probe(f"{tag}/dropout")(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def data() -> tuple[np.ndarray, np.ndarray]:
    """The same batch on every rank: only the random layers can make the ranks' inputs differ."""
    x = (np.arange(BATCH * 16, dtype="float32").reshape(BATCH, 4, 4, 1) + 1.0) / 16.0
    return x, np.arange(BATCH, dtype="int32") % 2


def seen(tag: str) -> dict[str, np.ndarray]:
    """What the probes saw, as flips, the noise added, and the dropout mask."""
    flip, noise, dropout = (SEEN[f"{tag}/{k}"].numpy() for k in ("flip", "noise", "dropout"))
    return {"flip": flip, "noise": noise - flip, "mask": (dropout != 0).astype("int8")}


def fit(model: keras.Model, distributed: bool, callbacks=()) -> None:
    optimizer = keras.optimizers.SGD(0.1)
    if distributed:
        optimizer = hvd_train.DistributedOptimizer(optimizer)
        callbacks = [*hvd_train.distributed_callbacks(), *callbacks]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    # Built before fit in both paths, as the distributed one does: Keras 2 would otherwise trace
    # the step twice, and its seeded random ops draw a seed per trace.
    optimizer.build(model.trainable_variables)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)


def one_process_stream(tag: str, rank: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s draws computed by one process: the documented function of (seed, rank)."""
    keras.utils.set_random_seed(SEED)
    if compat.CLASSIC:
        # RandomFlip has a generator of its own; Dropout and GaussianNoise use the global seed.
        model = random_model(tag, {**LAYER_SEEDS, "flip": rank_seed(LAYER_SEEDS["flip"], rank)})
        tf.random.set_seed(rank_seed(SEED, rank))  # before fit traces the train function
    else:
        model = random_model(tag, {k: rank_seed(s, rank) for k, s in LAYER_SEEDS.items()})
    fit(model, distributed=False)
    return seen(tag)


def differs_from_rank0(draws: list[dict[str, np.ndarray]]) -> list[list[str]]:
    """For each rank, the kinds of draw that differ from rank 0's."""
    return [[k for k in d if not np.array_equal(d[k], draws[0][k])] for d in draws]


def test_ranks_seeded_alike_draw_their_own_masks_noise_and_flips():
    keras.utils.set_random_seed(SEED)  # every rank alike
    model = random_model("dist", LAYER_SEEDS)
    fit(model, distributed=True)
    mine = seen("dist")
    reference = one_process_stream("ref", comm.rank())
    draws = comm.allgather_object(mine, name="test.random_draws")
    weights = comm.allgather_object(weights_digest(agreed_variables(model)), name="test.w")

    equal_to_reference = {k: bool(np.array_equal(mine[k], reference[k])) for k in mine}
    assert equal_to_reference == {"flip": True, "noise": True, "mask": True}, equal_to_reference
    # Rank r's stream is not rank 0's: every kind of draw differs on every other rank.
    assert differs_from_rank0(draws)[1:] == [["flip", "noise", "mask"]] * (comm.size() - 1)
    assert len(set(weights)) == 1  # the weights themselves stay global


def test_rank0_stream_is_not_the_reference_of_another_rank():
    """Negative control: the comparison above can fail: rank 0's draws are not rank 1's."""
    keras.utils.set_random_seed(SEED)
    rank0 = one_process_stream("ref0", 0)
    rank1 = one_process_stream("ref1", 1)
    assert all(not np.array_equal(rank0[k], rank1[k]) for k in rank0)


def test_unseeded_layers_differ_across_ranks_and_repeat_run_after_run():
    """Layers without seeds of their own (drawn from keras.utils.set_random_seed, alike on every
    rank): per-rank draws, the same in a second run with the same seed."""
    runs = []
    for run in range(2):
        keras.utils.set_random_seed(SEED)
        model = random_model(f"unseeded{run}", dict.fromkeys(LAYER_SEEDS))
        # CheckWeights compares weights over ranks every step: random state must stay out of it.
        fit(model, distributed=True, callbacks=[CheckWeights(every=1)])
        runs.append((seen(f"unseeded{run}"), weights_digest(agreed_variables(model))))
    draws = comm.allgather_object(runs[0][0], name="test.unseeded")
    digests = comm.allgather_object([d for _, d in runs], name="test.unseeded_w")

    assert differs_from_rank0(draws)[1:] == [["flip", "noise", "mask"]] * (comm.size() - 1)
    assert all(np.array_equal(runs[0][0][k], runs[1][0][k]) for k in runs[0][0])
    assert len({d for pair in digests for d in pair}) == 1


def test_random_state_is_its_own_and_its_position_global():
    keras.utils.set_random_seed(SEED)
    model = random_model("state", LAYER_SEEDS)
    fit(model, distributed=True)
    states = [v.numpy().tolist() for v in random_state_variables(model)]
    gathered = comm.allgather_object(states, name="test.random_state")

    if compat.CLASSIC:
        assert states == []  # Keras 2's random ops keep no state in variables
        return
    # [seed, draws]: the seed rank r's own, the number of draws (one per step) the same.
    expected = [[rank_seed(s, comm.rank()), 1] for s in LAYER_SEEDS.values()]
    assert sorted(states) == sorted(expected)
    assert [[d for _, d in g] for g in gathered] == [[1, 1, 1]] * comm.size()
