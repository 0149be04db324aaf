"""A training script in Horovod's style that exercises Horovod's Keras API, run at np=2 under
mpirun or horovodrun by test_horovod_api.py:

    mpirun -np 2 python tests/horovod_api/api_check.py --out facts.json

HVD_API picks the module: "hvd_train" (default on Keras 3) imports
`hvd_train.horovod.tensorflow.keras`, "horovod" (default on Keras 2) Horovod's own
`horovod.tensorflow.keras`; names Horovod's Keras module lacks (Min, Max, Product,
grouped_allreduce, broadcast_object, allgather_object, alltoall) come from `horovod.tensorflow`
there. Closed-form results are asserted on every rank; what differs by design between the two
modules (when the initial broadcast happens, how metrics are reduced) is measured and written by
rank 0 to --out, for the test to judge per module.
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from chosen import API, hvd, hvd_ops

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", required=True, help="rank 0 writes the measured facts here (.json)")
args = parser.parse_args()

# Process sets made after init (add_process_set) need this in every worker's environment.
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
hvd.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow import keras  # noqa: E402

rank, size = hvd.rank(), hvd.size()
facts = {"api": API, "keras": importlib.metadata.version("keras"), "size": size}


def value(x):
    return np.asarray(x)


# --- basics ---------------------------------------------------------------------------------
assert hvd.is_initialized()
assert 0 <= hvd.local_rank() < hvd.local_size() and hvd.cross_rank() < hvd.cross_size()
facts["controller"] = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else None
try:
    facts["mpi_threads"] = hvd.mpi_threads_supported()
except ValueError:  # not under MPI's controller, in both modules
    facts["mpi_threads"] = "ValueError"
facts["mpi_built"], facts["gloo_built"] = bool(hvd.mpi_built()), bool(hvd.gloo_built())

# --- collectives: closed forms -------------------------------------------------------------
mine = np.full(3, rank + 1.0, dtype=np.float32)
total = size * (size + 1) / 2
assert np.all(value(hvd.allreduce(mine, op=hvd.Sum, name="sum")) == total)
assert np.all(value(hvd.allreduce(mine, name="mean")) == total / size)  # Average by default
assert np.all(value(hvd.allreduce(mine, average=False, name="deprecated")) == total)
assert np.all(value(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, name="pre")) == 2 * total)
fp16 = hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16, name="fp16")
assert value(fp16).dtype == np.float32 and np.all(value(fp16) == total)
assert np.all(value(hvd.allreduce(mine, op=hvd_ops.Min, name="min")) == 1)
assert np.all(value(hvd.allreduce(mine, op=hvd_ops.Max, name="max")) == size)
factorial = float(np.prod(np.arange(1, size + 1)))
assert np.all(value(hvd_ops.allreduce(mine, op=hvd_ops.Product, name="prod")) == factorial)
pair = hvd_ops.grouped_allreduce([mine, 2 * mine], op=hvd.Sum)
assert np.all(value(pair[0]) == total) and np.all(value(pair[1]) == 2 * total)
rows = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int32), name="gather")
assert value(rows).tolist() == [[r, r] for r in range(size) for _ in range(r + 1)]
assert np.all(value(hvd.broadcast(mine, root_rank=size - 1, name="bcast")) == size)
assert hvd_ops.broadcast_object({"from": rank}, root_rank=size - 1) == {"from": size - 1}
assert hvd_ops.allgather_object(rank) == list(range(size))
scattered = hvd.reducescatter(np.arange(2.0 * size) * (rank + 1), op=hvd.Sum, name="rs")
assert value(scattered).tolist() == [total * i for i in (2 * rank, 2 * rank + 1)]
received = hvd_ops.alltoall(np.array([10 * rank + r for r in range(size)]), name="a2a")
assert value(received).tolist() == [10 * r + rank for r in range(size)]
uneven = np.arange(rank + size, dtype=np.int32)  # rank r sends its first r+1 rows to rank 0
received, splits = hvd_ops.alltoall(uneven, splits=[rank + 1] + [1] * (size - 1), name="a2av")
expected = (
    [v for r in range(size) for v in range(r + 1)] if rank == 0 else [rank + r for r in range(size)]
)
assert value(received).tolist() == expected and value(splits).tolist() == [
    len(range(r + 1)) if rank == 0 else 1 for r in range(size)
], (value(received), value(splits))
# Process sets: one of each rank (made on every rank, in the same order); each reduces alone.
singles = [hvd.add_process_set([r]) for r in range(size)]
alone = hvd_ops.allreduce(mine, op=hvd.Sum, name="own", process_set=singles[rank])
assert np.all(value(alone) == rank + 1)
for process_set in singles:
    hvd.remove_process_set(process_set)
if API == "hvd_train":
    try:
        hvd.allreduce(mine, op=hvd.Adasum)
        raise AssertionError("Adasum was not refused")
    except ValueError as err:
        facts["adasum"] = str(err)

# --- data and model -------------------------------------------------------------------------
FEATURES, CLASSES, PER_RANK_BATCH, STEPS, EPOCHS, LR = 8, 4, 8, 4, 2, 0.1
data = np.random.default_rng(0)
x_all = data.normal(size=(size * PER_RANK_BATCH * STEPS, FEATURES)).astype(np.float32)
y_all = np.argmax(x_all @ data.normal(size=(FEATURES, CLASSES)), axis=1)
# Global batch i is made of rank r's batch i for every r (rows of x_all in order).
x_rank = x_all.reshape(STEPS, size, PER_RANK_BATCH, FEATURES)[:, rank].reshape(-1, FEATURES)
y_rank = y_all.reshape(STEPS, size, PER_RANK_BATCH)[:, rank].reshape(-1)
# Uneven validation shards (rank 0 has three times rank 1's samples): the mean of per-rank
# accuracies is not the accuracy over all of them.
val_rows = [24, 8][rank] if size == 2 else 8
x_val = data.normal(size=(size, 24, FEATURES)).astype(np.float32)[rank, :val_rows]
y_val = data.integers(0, CLASSES, size=(size, 24))[rank, :val_rows]


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(CLASSES, name="logits"),
        ]
    )


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# --- DistributedOptimizer + callbacks: broadcast, warmup, exact metrics -----------------------
model = make_model(seed=100 + rank)  # each rank starts differently: the broadcast must fix that
initial = [hvd_ops.broadcast_object(model.get_weights(), root_rank=r) for r in range(size)]
model.compile(
    optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR * size)),
    loss=LOSS,
    metrics=["accuracy"],
)
rates = []


class RecordRate(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        rates.append(float(value(self.model.optimizer.learning_rate)))


callbacks = [
    # Horovod's order: broadcast first, then metric averaging, then the warmup.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(
        initial_lr=LR * size, warmup_epochs=1, momentum_correction=False, steps_per_epoch=STEPS
    ),
    # From epoch 1 on, half the rate, set at each epoch's first batch.
    hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=LR * size, multiplier=lambda epoch: 0.5, start_epoch=1, momentum_correction=False
    ),
    RecordRate(),
]
if API == "hvd_train":  # Keras 3's ModelCheckpoint needs its path at construction
    best = os.path.join(tempfile.mkdtemp(), "best.keras")
    callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=best))
history = model.fit(
    x_rank,
    y_rank,
    batch_size=PER_RANK_BATCH,
    epochs=EPOCHS,
    shuffle=False,
    validation_data=(x_val, y_val),
    callbacks=callbacks,
    verbose=0,
)
# Warmup, Horovod's formula at each batch of epoch 0, then the rate reached.
expected = [LR * size / size * ((b / STEPS + 1 / STEPS) * (size - 1) / 1 + 1) for b in range(STEPS)]
expected += [LR * size * 0.5] * STEPS
assert np.allclose(rates, expected, rtol=1e-6), (rates, expected)
assert not np.allclose(rates[0], LR * size, rtol=1e-6)  # the control: warmup starts lower

# Every rank holds the same weights.
digests = hvd_ops.allgather_object([w.tobytes() for w in model.get_weights()])
assert all(d == digests[0] for d in digests)


# One process on the global batches, from rank r's initial weights, at the recorded rates.
def one_process(weights):
    alone = make_model(seed=0)
    alone.set_weights(weights)
    sgd = keras.optimizers.SGD(LR)
    alone.compile(optimizer=sgd, loss=LOSS)
    for step, rate in enumerate(rates):
        sgd.learning_rate.assign(rate)
        rows = slice(
            (step % STEPS) * size * PER_RANK_BATCH, (step % STEPS + 1) * size * PER_RANK_BATCH
        )
        alone.train_on_batch(x_all[rows], y_all[rows])
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(alone.get_weights(), model.get_weights(), strict=True)
    )


facts["gap_from_rank0_start"] = one_process(initial[0])
facts["gap_from_rank1_start"] = one_process(initial[1])

# Metrics: the logged validation accuracy against the exact one and the mean of per-rank ones.
correct = np.sum(np.argmax(model.predict(x_val, verbose=0), axis=1) == y_val)
counts = value(hvd.allreduce(np.array([correct, val_rows], dtype=np.float64), op=hvd.Sum))
per_rank = hvd_ops.allgather_object(float(correct) / val_rows)
logged = float(history.history["val_accuracy"][-1])
facts["val_accuracy"] = {
    "logged": logged,
    "exact": float(counts[0] / counts[1]),
    "mean_of_rank_means": float(np.mean(per_rank)),
}

# --- groups: explicit allreduce groups reduce to the same bits as the default buckets ---------
grouped = {}
for name, groups in [("default", None), ("two", 2), ("lists", "lists")]:
    net = make_model(seed=7)
    if groups == "lists":
        groups = [net.get_layer("hidden").trainable_weights]
    net.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), groups=groups), loss=LOSS
    )
    net.fit(x_rank, y_rank, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    grouped[name] = net.get_weights()
for name in ("two", "lists"):
    assert all(
        np.array_equal(a, b) for a, b in zip(grouped[name], grouped["default"], strict=True)
    ), name

# --- backward_passes_per_step=2: Horovod's default sums the two batches' gradients ------------
net = make_model(seed=7)
start = net.get_weights()
net.compile(
    optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2),
    loss=LOSS,
)
net.fit(x_rank, y_rank, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
gaps = {}
for name, rate in [("sum", 2 * LR), ("mean", LR)]:
    # One process, one update per two global batches: the sum of two means is twice the mean.
    alone = make_model(seed=0)
    alone.set_weights(start)
    alone.compile(optimizer=keras.optimizers.SGD(rate), loss=LOSS)
    pair_rows = 2 * size * PER_RANK_BATCH
    for update in range(STEPS // 2):
        rows = slice(update * pair_rows, (update + 1) * pair_rows)
        alone.train_on_batch(x_all[rows], y_all[rows])
    pairs = zip(alone.get_weights(), net.get_weights(), strict=True)
    gaps[name] = max(float(np.max(np.abs(a - b))) for a, b in pairs)
assert gaps["sum"] < 1e-5 < gaps["mean"], gaps  # the control: averaging the two differs

# --- register_local_var: a layer's gradient stays local, divided by size ---------------------
net = make_model(seed=7)  # the same start on every rank
start = net.get_weights()
local = net.get_layer("logits").kernel
sgd = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
sgd.register_local_var(local)
net.compile(optimizer=sgd, loss=LOSS)
batch = (x_rank[:PER_RANK_BATCH], y_rank[:PER_RANK_BATCH])
with tf.GradientTape() as tape:
    own_loss = LOSS(batch[1], net(batch[0]))
own_grad = value(tape.gradient(own_loss, local))
net.train_on_batch(*batch)
kernel_index = [id(w) for w in net.weights].index(id(local))
expected_kernel = start[kernel_index] - LR * own_grad / size
gap = float(np.max(np.abs(value(local) - expected_kernel)))
unscaled = float(np.max(np.abs(value(local) - (start[kernel_index] - LR * own_grad))))
assert gap < 1e-6 < unscaled, (gap, unscaled)  # the control: without the 1/size it differs
kernels = hvd_ops.allgather_object(value(local).tobytes())
hidden = hvd_ops.allgather_object(value(net.get_layer("hidden").kernel).tobytes())
assert kernels[0] != kernels[-1] and hidden[0] == hidden[-1]  # local differs, the rest agrees

if API == "hvd_train":
    net = make_model(seed=7)
    partial = hvd.PartialDistributedOptimizer(
        keras.optimizers.SGD(LR), local_layers=[net.get_layer("logits")]
    )
    net.compile(optimizer=partial, loss=LOSS)
    net.train_on_batch(*batch)
    assert float(np.max(np.abs(value(net.get_layer("logits").kernel) - expected_kernel))) < 1e-6

# --- a model built lazily (no keras.Input, as Horovod's examples build theirs) --------------
# Its weights exist only once the first step is traced (a Dropout's seed state before that):
# the broadcast comes after that batch.
lazy_digests = {}
for name, broadcast in [("broadcast", True), ("control", False)]:
    keras.utils.set_random_seed(100 + rank)  # each rank its own initial weights
    lazy = keras.Sequential(
        [
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(CLASSES),
        ]
    )
    lazy.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss=LOSS)
    lazy_callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if broadcast else []
    lazy.fit(
        x_rank,
        y_rank,
        batch_size=PER_RANK_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=lazy_callbacks,
    )
    lazy_digests[name] = hvd_ops.allgather_object([w.tobytes() for w in lazy.get_weights()])
assert all(d == lazy_digests["broadcast"][0] for d in lazy_digests["broadcast"])
assert lazy_digests["control"][0] != lazy_digests["control"][-1]  # without it, ranks differ

# --- load_model: the optimizer comes back distributed, its state restored -------------------
# Horovod's own load_model finds Keras 2's optimizers by their HDF5 names only: .h5 there.
suffix = ".keras" if API == "hvd_train" else ".h5"
path = hvd_ops.broadcast_object(
    os.path.join(tempfile.mkdtemp(), "model" + suffix) if rank == 0 else None
)
if rank == 0:
    model.save(path)
hvd.allreduce(np.zeros(1), name="saved")  # the file is complete before any rank reads it
loaded = hvd.load_model(path)
assert int(value(loaded.optimizer.iterations)) == STEPS * EPOCHS
loaded.fit(x_rank, y_rank, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
digests = hvd_ops.allgather_object([w.tobytes() for w in loaded.get_weights()])
assert all(d == digests[0] for d in digests)  # ranks' data differ: only averaging keeps this
facts["loaded_iterations"] = int(value(loaded.optimizer.iterations))
if API == "hvd_train":
    # Saved by rank 0 at the best epoch, a model that loads; rank 1's own path stays empty.
    assert os.path.exists(best) == (rank == 0)
    facts["best_saved"] = keras.models.load_model(best) is not None if rank == 0 else None

if rank == 0:
    with open(args.out, "w") as out:
        json.dump(facts, out)
