"""Per-step training losses of the default job's first updates, for the stack parity test.

Run under a launcher with either stack's Python (tests/integration/test_classic.py does):

    mpirun -np 2 .venv/bin/python tests/integration/parity_steps.py --weights W.npz --out L.json

If W.npz does not exist, rank 0 writes the initial weights of the model built here (this stack's
initializers); if it exists, the model takes them, by variable order (Keras 2 and 3 order a
functional model's weights alike: layer by layer, kernel before bias). Everything else is the
default job's (configs/digits.yaml, as hvd_train.training.fit sets it up): data and its sharded
order, model, optimizer, learning-rate rule, DistributedOptimizer and distributed callbacks.
Rank 0 writes every rank's loss at each step, each the loss of that step's batch alone (the metrics
are reset before every batch, so it is not the epoch's running mean).

One change to the default job: the model's dropout is 0. Its masks come from each Keras's own
random generator, which the two stacks do not share, so with dropout the losses would differ by
design rather than by a fault.
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvd_train import comm
from hvd_train.keras import compat
from hvd_train.keras.optimizer import DistributedOptimizer

comm.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from hvd_train import data  # noqa: E402
from hvd_train.callbacks import distributed_callbacks  # noqa: E402
from hvd_train.core import config as config_lib  # noqa: E402
from hvd_train.keras.schedules import scaled_warmup_schedule  # noqa: E402
from hvd_train.training.setup import make_optimizer  # noqa: E402 -- the default job's optimizer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--weights", type=Path, required=True, help="initial weights (.npz)")
parser.add_argument("--out", type=Path, required=True, help="per-step losses (.json)")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

config = config_lib.load(CONFIG, ["model.params={dropout: 0.0}"])
train_cfg, opt_cfg = config.train, config.optimizer
rank, size = comm.rank(), comm.size()
keras.utils.set_random_seed(train_cfg.seed)
per_rank_batch, global_batch = config_lib.resolved_batch_sizes(config, size)
arrays = data.load(config.data)
train, steps = data.shard_dataset(
    (arrays.x_train, arrays.y_train), per_rank_batch, rank, size, seed=config.data.seed
)
if args.steps > steps:
    parser.error(f"--steps {args.steps}: the first epoch has only {steps}")

params = config.model.params
model = models.build(config.model.name, arrays.input_shape, arrays.num_classes, **params)
# Rank 0 looks, every rank follows (a rank looking later could find a half-written file).
load_weights = comm.broadcast_object(args.weights.exists() if rank == 0 else None)
if load_weights:
    stored = np.load(args.weights)
    initial = [stored[f"w{i}"] for i in range(len(stored.files))]
    shapes = ([w.shape for w in initial], [tuple(w.shape) for w in model.weights])
    assert shapes[0] == shapes[1], f"weights differ in order or shape: {shapes}"
    model.set_weights(initial)
elif rank == 0:
    np.savez(args.weights, **{f"w{i}": w for i, w in enumerate(model.get_weights())})

schedule = scaled_warmup_schedule(
    base_lr=opt_cfg.base_lr,
    base_batch_size=opt_cfg.base_batch_size,
    global_batch_size=global_batch,
    updates_per_epoch=steps,
    warmup_epochs=opt_cfg.warmup_epochs,
    epochs=train_cfg.epochs,
    rule=opt_cfg.lr_rule,
    decay=opt_cfg.decay,
    decay_rate=opt_cfg.decay_rate,
    decay_epochs=opt_cfg.decay_epochs,
)
model.compile(
    optimizer=DistributedOptimizer(make_optimizer(opt_cfg, schedule)),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
losses: list[float] = []


class StepLoss(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.model.reset_metrics()  # the loss at batch end is then this batch's alone

    def on_train_batch_end(self, batch, logs=None):
        losses.append(float(logs["loss"]))


model.fit(
    train,
    epochs=1,
    steps_per_epoch=args.steps,
    callbacks=[*distributed_callbacks(), StepLoss()],
    verbose=0,
    shuffle=False,
)
every_rank = comm.allgather_object(losses)
if rank == 0:
    record = {"stack": compat.NAME, "keras": keras.__version__, "losses": every_rank}
    args.out.write_text(json.dumps(record))
