"""An elastic Keras script in Horovod's style (`hvd.elastic.run`, KerasState and its callbacks),
run by test_elastic_api.py under horovodrun's elastic mode with 2 workers and --min-np 1:

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script "discover_hosts.sh H" \\
        python tests/horovod_api/elastic_check.py --out facts.json

HVD_API picks the module as in api_check.py. The worker of rank 1 exits at the first batch of
epoch DIE_EPOCH; the survivor goes back to the last commit (the end of the epoch before), Horovod
restarts with one worker, and training goes on to EPOCHS. The survivor writes what it saw.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from chosen import API, hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", required=True, help="the surviving worker writes its facts here")
args = parser.parse_args()

hvd.init()

import numpy as np  # noqa: E402
from tensorflow import keras  # noqa: E402

FEATURES, CLASSES, BATCH, SAMPLES, EPOCHS, DIE_EPOCH, LR = 8, 4, 8, 64, 4, 2, 0.05
data = np.random.default_rng(0)
x_all = data.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
y_all = np.argmax(x_all @ data.normal(size=(FEATURES, CLASSES)), axis=1)

keras.utils.set_random_seed(hvd.rank())
model = keras.Sequential(
    [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
)
model.compile(
    optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR * hvd.size())),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
resets, sizes = [], []


def on_state_reset():
    # The rate follows the number of workers, which a reset changes.
    model.optimizer.learning_rate.assign(LR * hvd.size())
    resets.append(hvd.size())


state.register_reset_callbacks([on_state_reset])


class DieOnce(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if hvd.rank() == 1 and state.epoch == DIE_EPOCH and not resets:
            os._exit(1)  # a worker lost mid-epoch


@hvd.elastic.run
def train(state):
    rank, size = hvd.rank(), hvd.size()
    sizes.append(size)
    steps = SAMPLES // (BATCH * size)
    x, y = x_all[rank::size][: steps * BATCH], y_all[rank::size][: steps * BATCH]
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        # After the updates, so that a commit holds the epoch just finished; at epoch ends only:
        # a failure goes back to the end of the last epoch.
        hvd.elastic.CommitStateCallback(state, batches_per_commit=10**6),
        DieOnce(),
    ]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0)


train(state)
if hvd.rank() == 0:
    with open(args.out, "w") as out:
        facts = {"api": API, "epoch": state.epoch, "resets": resets, "sizes": sizes}
        facts["iterations"] = int(np.asarray(model.optimizer.iterations))
        json.dump(facts, out)
