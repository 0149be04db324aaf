"""Per-step training losses of a Horovod-style Keras script, for the parity of this toolkit's
module on Keras 3 with Horovod's own on Keras 2 (test_parity.py runs it on both stacks):

    mpirun -np 2 python tests/horovod_api/parity.py --weights W.npz --out L.json

HVD_API picks the module as in api_check.py. If W.npz does not exist, rank 0 writes the initial
weights of the model built here; if it exists, the model takes them by variable order (Keras 2
and 3 order a Sequential model's weights alike). No dropout, a fixed data order (each rank its
slice of every global batch), momentum SGD with Horovod's warmup (momentum correction on). Rank 0
writes every rank's loss at each step, each that step's batch alone.
"""

import argparse
import importlib
import importlib.metadata
import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from chosen import API, hvd, hvd_ops

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--weights", type=Path, required=True, help="initial weights (.npz)")
parser.add_argument("--out", type=Path, required=True, help="per-step losses (.json)")
parser.add_argument("--lr-scale", type=float, default=1.0, help="a control: perturb the rate")
parser.add_argument(
    "--no-momentum-correction", action="store_true", help="a control: warm up without it"
)
args = parser.parse_args()

hvd.init()

import numpy as np  # noqa: E402
from tensorflow import keras  # noqa: E402

FEATURES, CLASSES, PER_RANK_BATCH, STEPS, EPOCHS, BASE_LR = 32, 10, 16, 10, 2, 0.05
rank, size = hvd.rank(), hvd.size()
data = np.random.default_rng(1)
x_all = data.normal(size=(STEPS * size * PER_RANK_BATCH, FEATURES)).astype(np.float32)
y_all = np.argmax(x_all @ data.normal(size=(FEATURES, CLASSES)), axis=1)
# Rank r trains on its slice of each global batch, in order.
x = x_all.reshape(STEPS, size, PER_RANK_BATCH, FEATURES)[:, rank].reshape(-1, FEATURES)
y = y_all.reshape(STEPS, size, PER_RANK_BATCH)[:, rank].reshape(-1)

model = keras.Sequential(
    [
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.0),
        keras.layers.Dense(CLASSES),
    ]
)
# Rank 0 looks, every rank follows (a rank looking later could find a half-written file).
if hvd_ops.broadcast_object(args.weights.exists() if rank == 0 else None):
    stored = np.load(args.weights)
    model.set_weights([stored[f"w{i}"] for i in range(len(stored.files))])
else:
    # Rank 0's weights on every rank from the start (Horovod's broadcast comes after a step).
    model.set_weights(hvd_ops.broadcast_object(model.get_weights(), root_rank=0))
    if rank == 0:
        np.savez(args.weights, **{f"w{i}": w for i, w in enumerate(model.get_weights())})

# Horovod's recipe: the rate scaled by the number of workers, reached after a warmup.
scaled_lr = BASE_LR * size * args.lr_scale
# Horovod's momentum correction sets `optimizer.momentum` for a batch: on Keras 2 that works only
# with the legacy optimizers (in the others momentum is a Python float, and Horovod's fails).
SGD = keras.optimizers.legacy.SGD if API == "horovod" else keras.optimizers.SGD
optimizer = hvd.DistributedOptimizer(SGD(scaled_lr, momentum=0.9))
model.compile(
    optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
)
losses = []


class StepLoss(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.model.reset_metrics()  # the loss at batch end is then this batch's alone

    def on_train_batch_end(self, batch, logs=None):
        losses.append(float(logs["loss"]))


callbacks = [
    # Every rank starts from rank 0's weights (here they are equal already).
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.LearningRateWarmupCallback(
        initial_lr=scaled_lr, warmup_epochs=1, momentum_correction=not args.no_momentum_correction
    ),
    StepLoss(),
]
model.fit(
    x, y, batch_size=PER_RANK_BATCH, epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=0
)
every_rank = hvd_ops.allgather_object(losses)
if rank == 0:
    record = {"api": API, "keras": importlib.metadata.version("keras"), "losses": every_rank}
    args.out.write_text(json.dumps(record))
