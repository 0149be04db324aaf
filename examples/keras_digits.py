"""A plain Keras script on scikit-learn's digits, distributed with hvd_train in a few lines.

It runs unchanged on both stacks: Keras 3 (.venv) and Keras 2 (.venv-classic).

Every line that exists only because of distribution says why. Run on 2 workers:
    mpi_scripts/run.sh examples/keras_digits.py            (NP=2 by default; LAUNCHER=horovodrun)
or on one process, unchanged: .venv/bin/python examples/keras_digits.py
Batch arithmetic: 32 samples per rank per step; global batch = 32 x workers; the learning rate is
0.05 (tuned for batch 32) x workers, reached after 2 epochs of linear warmup.
"""

import argparse

import hvd_train

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--per-rank-batch-size", type=int, default=32)
args = parser.parse_args()

# Distributed: start Horovod and give this rank its GPU and its share of the CPU threads,
# before TensorFlow runs anything.
hvd_train.init()

import keras  # noqa: E402 -- after init, which must precede TensorFlow's first op
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import models  # noqa: E402

x, y = load_digits(return_X_y=True)
x = (x / 16.0).reshape(-1, 8, 8, 1).astype("float32")
y = y.astype("int32")
x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

# Distributed: each rank reads its own disjoint shard, reshuffled every epoch, and all ranks run
# the same number of steps (a rank with one step more would wait forever in its last allreduce).
train, steps = hvd_train.shard_dataset(
    (x_train, y_train), args.per_rank_batch_size, hvd_train.rank(), hvd_train.size(), seed=0
)
# Distributed: the global batch grows with the workers, so the learning rate grows with it
# (linear rule), reached by a warmup instead of at step 0 (Goyal et al. 2017).
global_batch_size = args.per_rank_batch_size * hvd_train.size()
schedule = hvd_train.scaled_warmup_schedule(
    base_lr=0.05,
    base_batch_size=32,
    global_batch_size=global_batch_size,
    updates_per_epoch=steps,
    warmup_epochs=2,
    epochs=args.epochs,
    decay="cosine",
)

model = models.build("cnn", x.shape[1:], 10)
# Distributed: average the gradients over all ranks before every update.
optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(schedule, momentum=0.9))
model.compile(
    optimizer=optimizer,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
model.fit(
    train,
    steps_per_epoch=steps,
    epochs=args.epochs,
    # Distributed: every rank starts from rank 0's weights (on every rank: it is a collective).
    callbacks=[hvd_train.BroadcastInitialState()],
    # Distributed: one progress line per epoch, from rank 0 only (its own shard's loss).
    verbose=2 if hvd_train.is_chief() else 0,
    shuffle=False,  # the sharded dataset reshuffles itself every epoch
)
# Every rank holds the same weights, so evaluating the whole validation set gives one answer.
loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
if hvd_train.is_chief():  # Distributed: one report, not one per rank
    print(
        f"workers={hvd_train.size()} global_batch={global_batch_size} "
        f"val_loss={loss:.4f} val_accuracy={accuracy:.4f} "
        f"params={model.count_params()} (samples per epoch: {steps * global_batch_size})"
    )
    if np.isnan(loss):
        raise SystemExit("training diverged")
